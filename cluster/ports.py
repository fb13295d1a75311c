"""Free loopback ports, for a server that needs one no one else holds (tests, benchmarks, Serve's proxy)."""

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
