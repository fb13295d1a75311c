"""How long each part of an engine's start took: what a cold start is made of (model load, kernels and KV cache,
warm-up), reported to the router with the replica's stats and shown by `kvloom status`."""

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupTimes:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # phase -> seconds, in the order they ran

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start
