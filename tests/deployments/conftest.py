"""Fixtures for the Ray tests: one cluster per test module, or per group of modules that serve
the same config (tests/app_groups.py; serving_helpers.py: `shared_app`)."""

import pytest

from app_groups import group_of
from serving_helpers import close_shared


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test, stop the shared app unless the next test on this worker is of its group."""
    yield
    close_shared(unless_group=group_of(nextitem.nodeid.split("::")[0]) if nextitem else None)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("served")


@pytest.fixture(scope="session")
def long_family(tiny_family, tmp_path_factory):
    """The tiny family with a 4096-token context, so a stream can outlive a disconnect."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("long-family")
    family = {}
    for role, folder in tiny_family.items():
        copy = shutil.copytree(folder, root / role)
        config = json.loads((copy / "config.json").read_text())
        config["max_position_embeddings"] = 4096
        (copy / "config.json").write_text(json.dumps(config))
        family[role] = copy
    return family
