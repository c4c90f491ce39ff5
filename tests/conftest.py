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
