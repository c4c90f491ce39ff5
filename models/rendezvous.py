"""A free TCP port: for torch.distributed rendezvous (DeepSpeed in `models/distill.py`, the
tensor-parallel group in `deployments/tp_group.py`) and for local servers (`cluster/`, tests).

Lives in `models/`, the bottom layer, so every layer may import it. No torch import.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's worker processes listen on 10002-19999 by default; ports below LOW are left to them.
LOW = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL_LOW = 49152       # where the OS's range cannot be read (macOS uses it)


def ephemeral_low() -> int:
    """The first port of the range the OS hands out to connections and to binds of port 0."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return IANA_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1") -> int:
    """A port no process holds now, for a server that binds it later (a fixed one clashes with
    concurrent runs). Drawn at random between LOW and the OS's ephemeral range: a port the OS
    gave out would be free for anyone meanwhile, and a process that starts in between with a
    fixed default port in that range (Ray's dashboard agent listens on 52365) or a connection
    may take it first. Falls back to a port the OS picks if none there is free."""
    top = ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if top - LOW > 1024 else 0):
        port = rng.randrange(LOW, top)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
