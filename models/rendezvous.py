"""A free TCP port: for torch.distributed rendezvous (DeepSpeed in `models/distill.py`, the
tensor-parallel group in `deployments/tp_group.py`) and for local servers (`cluster/`, tests).

Lives in `models/`, the bottom layer, so every layer may import it. No torch import.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port no process holds now (a fixed one clashes with concurrent runs)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
