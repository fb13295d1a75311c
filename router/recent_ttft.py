"""The time to first token clients see now: the autoscaler's `ttft_p90_s` signal.

The p90 of the last `window_s` seconds' first tokens, with each request still waiting for its first token
counted at its age so far: a backlog raises the figure while it builds, not only once it is served. At most
MAX_SAMPLES of the latest first tokens are kept (the router computes the figure on every stats push).
"""

import math
import time
from collections import deque

MAX_SAMPLES = 4096


class RecentTTFT:
    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (when, seconds)

    def add(self, seconds: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, seconds))

    def p90(self, waiting_since: list[float], now: float | None = None) -> float:
        """`waiting_since`: arrival times of the requests with no first token yet. 0 with nothing to go on."""
        now = time.monotonic() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        values = sorted([s for _, s in self._samples] + [now - arrival for arrival in waiting_since])
        return values[math.ceil(0.9 * len(values)) - 1] if values else 0.0
