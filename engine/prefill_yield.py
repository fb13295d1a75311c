"""Prefills that yield: a flooding tenant's prompts are computed in small chunks, and not at all in a step that
computes another's prompt, so that prompt waits neither for a long step in progress nor shares its own with the
flood.

A request yields when the router marked it so (`SubmitRequest.yields_prefill`: its tenant held more than its
weighted share of the replica's slots among the tenants active there lately). On a CPU a prompt's step costs
about its tokens (on one core a 32-token prefill of SmolLM2 takes ~100 ms, a decode step of four sequences ~30),
so a request arriving while a flood's prompt is computed would otherwise wait out that whole step, then share its
own with the next one. The scheduler runs the yielding prompts last in a step (after admissions), each step's
`tokens_per_step` among them, and none once another's prompt is in the step. Their decodes are untouched and
their prompt tokens move to steps that run anyway, so the flood's throughput stays about what it was.
"""

from dataclasses import dataclass

from kvloom.engine.request import Request


@dataclass
class PrefillYield:
    tokens_per_step: int | None  # the yielding requests' prefill tokens in one step, all together (None: no yielding)
    left: int = 0  # of those, what this step still has

    def yields(self, request: Request) -> bool:
        return request.yields_prefill and self.tokens_per_step is not None

    def start(self) -> None:
        self.left = self.tokens_per_step or 0

    def room(self, num_new: int) -> int:
        """How many of a yielding prompt's `num_new` tokens it may compute this step (0: a later step)."""
        return min(num_new, self.left)

    def spend(self, request: Request, num_new: int) -> None:
        """A prompt got `num_new` tokens in this step: a yielding one uses up its room, any other closes it (the
        yielding ones wait for the next step)."""
        self.left = self.left - num_new if self.yields(request) else 0
