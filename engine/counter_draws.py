"""Counter-based random draws: a request's uniform for (seed, position, lane) is a hash of those three numbers.

A seeded request's i-th token draws from (seed, i) whatever its neighbours in the batch, the replica it runs
on, or the replica its stream moved to; no per-row `torch.Generator` is kept or re-seeded. Everything a draw
depends on is known on the host when the step is built, so the sampler computes the step's uniforms there
(about a microsecond a row) and ships them with the rows' other knobs in its one copy to the device.
Lanes keep the draws of one position apart: the token itself, a drafted token's acceptance test, the draft
model's own draw.

The hash is Chris Wellons' lowbias32 mixer applied three times (position and lane, then each 32-bit half of
the seed); 24 bits of the result make a float32 uniform in [0, 1).
"""

import enum

MASK32 = 0xFFFFFFFF


class Lane(enum.IntEnum):
    TOKEN = 0  # the token sampled at a position
    ACCEPT = 1  # the acceptance test of the token drafted for a position (speculative decoding)
    DRAFT = 2  # a draft model's own draw for a position


def seed_words(seed: int) -> tuple[int, int]:
    """A seed as SamplingParams admits it (-2**63 .. 2**64-1) split in two 32-bit words (low, high)."""
    return seed & MASK32, (seed >> 32) & MASK32


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: tuple[int, int], position: int, lane: Lane) -> float:
    """The uniform in [0, 1) of (seed words, position, lane): 24 bits of the hash, exact in float32."""
    x = _mix((position & MASK32) ^ ((int(lane) * 0x9E3779B9) & MASK32))
    x = _mix(x ^ seed[1])
    x = _mix(x ^ seed[0])
    return (x >> 8) / (1 << 24)
