import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)   # this machine has 2 cores; tests never oversubscribe them


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    from tiny_models import make_family

    return make_family(tmp_path_factory.mktemp("tiny-family"))


@pytest.fixture(scope="session")
def odd_draft(tiny_family, tmp_path_factory):
    """A draft whose KV shape differs from the tiny target's (see tiny_models.make_odd_draft)."""
    from tiny_models import make_odd_draft

    return make_odd_draft(tmp_path_factory.mktemp("odd-draft") / "draft", tiny_family["target"])


def pytest_collection_modifyitems(items):
    """The modules of an app group run in the group's order (tests/app_groups.py)."""
    from app_groups import run_order

    order = run_order([item.nodeid.split("::")[0] for item in items])
    items[:] = [items[i] for i in order]


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the modules of one app group (tests/app_groups.py) as one unit:
    they run on one worker, one after the other, on one served app."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    from app_groups import group_of, served

    class AppGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::")[0]) or super()._split_scope(nodeid)

        def schedule(self) -> None:
            """After the first units go out, the served modules (a Ray cluster and an app each,
            25-120 s) before the rest, so that no worker is left with one of them at the end."""
            first = self.collection is None
            super().schedule()
            if first and self.workqueue:
                order = sorted(self.workqueue.items(), key=lambda unit: not served(unit[0]))
                self.workqueue.clear()
                self.workqueue.update(order)

    return AppGroupScheduling(config, log)
