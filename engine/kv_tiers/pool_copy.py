"""How a load's block files reach the pool: read into a host buffer kept from load to load (fresh buffers cost more
in page faults than the read), then copied to the pool's device. On CUDA the buffer is pinned and the copy runs on a
stream of the tier worker's own, finished before the load is reported done, so the step's stream that reads the
blocks next never sees them half-written; elsewhere the pool's own write is the copy."""

import time
from collections.abc import Callable

import torch


class PoolCopy:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_side_stream = device.type == "cuda"
        self.buffer = torch.empty(0, 0, dtype=torch.uint8)
        self.stream: "torch.cuda.Stream | None" = None  # made once: the worker is the only thread that uses it
        self.seconds = 0.0  # copying loaded blocks into the pool

    def rows(self, count: int, size: int) -> torch.Tensor:
        """`count` rows of `size` bytes from the kept buffer (grown when short)."""
        if len(self.buffer) < count:
            self.buffer = self.host_buffer(max(count, 2 * len(self.buffer)), size)
        return self.buffer[:count]

    def host_buffer(self, count: int, size: int) -> torch.Tensor:
        return torch.empty(count, size, dtype=torch.uint8, pin_memory=self.on_side_stream)

    def into_pool(self, rows: torch.Tensor, place: Callable[[torch.Tensor], None]) -> None:
        """`rows` (of the kept buffer) on the pool's device, handed to `place`, which writes them into pool blocks;
        done when this returns."""
        started = time.perf_counter()
        if not self.on_side_stream:
            place(rows)
        else:
            if self.stream is None:
                self.stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self.stream):
                place(rows.to(self.device, non_blocking=True))
            self.stream.synchronize()
        self.seconds += time.perf_counter() - started
