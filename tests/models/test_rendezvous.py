"""`models.rendezvous.free_port`: ports for servers that bind them later."""

from __future__ import annotations

import socket

from models import rendezvous
from models.rendezvous import LOW, ephemeral_low, free_port


def test_a_free_port_lies_outside_the_range_the_os_hands_out():
    """A port from the OS's own range can go to a connection, or to a process with a fixed
    default port there (Ray's dashboard agent: 52365), before the server binds it, and the
    server then fails to start."""
    top = ephemeral_low()
    ports = [free_port() for _ in range(40)]
    assert all(LOW <= p < top for p in ports), ports
    assert len(set(ports)) > 1                                  # drawn, not one fixed port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))                      # and free


def test_a_port_someone_holds_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        draws = iter([busy, busy, 23456])

        class Draws:
            def randrange(self, low, high):
                return next(draws)

        monkeypatch.setattr(rendezvous.random, "SystemRandom", Draws)
        assert free_port() == 23456


def test_the_iana_range_stands_in_where_the_os_range_cannot_be_read(monkeypatch, tmp_path):
    monkeypatch.setattr(rendezvous, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert ephemeral_low() == rendezvous.IANA_EPHEMERAL_LOW
    assert LOW <= free_port() < rendezvous.IANA_EPHEMERAL_LOW
