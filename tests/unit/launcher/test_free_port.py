"""The master port the local launcher (and the tests) pick: free, and out of the kernel's ephemeral range, so a
gloo connection opened meanwhile by another job cannot be given it (a suite run lost a test to EADDRINUSE)."""
import socket

from dsrun.utils.net import ephemeral_range, free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low, high = ephemeral_range()
    assert 1024 <= low <= high
    ports = {free_port() for _ in range(20)}
    for port in ports:
        assert 10_000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))  # free: nobody holds it
    assert len(ports) > 1  # chosen at random, not one fixed port every job would share


def test_free_port_skips_a_port_that_is_taken(monkeypatch):
    import random

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, taken + 1 if taken + 1 < ephemeral_range()[0] else taken - 1])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        assert free_port() != taken
