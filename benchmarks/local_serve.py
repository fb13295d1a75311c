"""A throwaway local Ray cluster with Serve on a free loopback port, for the HTTP benchmarks."""

import os
from collections.abc import Iterator
from contextlib import contextmanager

from kvloom.cluster.ports import free_port


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
