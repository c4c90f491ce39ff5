import os
import sys
import warnings

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


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_behind(request):
    """A module leaves no Ray connection behind: the next module on this worker starts a cluster
    of its own (ray.init twice fails) or asserts there is none. A group's shared app stays for
    the group's next module (tests/app_groups.py). One left behind is shut down and the module
    named in a warning, so one module's leak does not fail the modules after it."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    helpers = sys.modules.get("serving_helpers")
    if helpers is not None and helpers._SHARED["stack"] is not None:
        return
    warnings.warn(f"{request.module.__name__} left Ray initialized; shut down after it")
    ray.shutdown()


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
