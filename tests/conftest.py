import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)   # this machine has 2 cores; tests never oversubscribe them


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    from tiny_models import make_family

    return make_family(tmp_path_factory.mktemp("tiny-family"))
