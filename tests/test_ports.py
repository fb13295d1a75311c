"""Free ports for servers that tests and benchmarks start: one no one holds now, and one that the Ray
cluster the server starts cannot take before the server binds it."""

import socket

from kvloom.cluster import ports


def test_free_ports_come_from_outside_what_the_kernel_and_ray_hand_out(monkeypatch):
    """Between Ray's worker ports and the kernel's ephemeral range (bind(0) and outgoing connections draw
    from it); the kernel's pick where none is free there."""
    port = ports.free_port()
    assert ports.FIRST_QUIET_PORT <= port < ports._ephemeral_start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    monkeypatch.setattr(ports, "_binds", lambda port: False)
    assert ports.free_port() >= ports._ephemeral_start()
