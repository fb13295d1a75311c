"""A throwaway local Ray cluster with Serve on a free loopback port, for the HTTP benchmarks."""

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def local_serve(num_cpus: int = 4) -> Iterator[str]:
    """Start Ray and Serve, yield the base URL, shut both down whatever happens."""
    import ray
    from ray import serve

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
