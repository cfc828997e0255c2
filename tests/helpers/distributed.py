"""Shared pieces of the tests that spawn a gloo process group on the CPU."""
import socket


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous of a spawned group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
