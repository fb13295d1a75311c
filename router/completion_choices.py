"""A completion choice as OpenAI writes it (`text`, `logprobs` columns), with `echo` and prompt logprobs.

With `echo` the prompt's text leads the choice's first text; with `echo` and `logprobs` the prompt's tokens lead
the logprob columns too (the first token's null, as OpenAI's is), from the prompt logprobs the engine computed
(engine/prompt_logprobs.py). vLLM's `prompt_logprobs` is the choice's own field: per prompt token (null for the
first) its logprob and the top alternatives, each with its rank and text. A prompt's later choices (n > 1) fork
its KV, so they show its first choice's prompt logprobs."""

from dataclasses import dataclass, field

from kvloom.router.protocol import CompletionRequest
from kvloom.router.responses import Choice, LogprobsFormat


@dataclass
class CompletionChoices:
    body: CompletionRequest
    tokenizer: object
    logprobs: LogprobsFormat | None
    _prompts: dict[int, tuple[list[int], Choice]] = field(default_factory=dict)  # id(choice) -> (prompt ids, lead)

    def start(self, choices: list[Choice], prompts: list[list[int]], texts: list) -> None:
        """Each choice's prompt (in choice order, as started) and its prompt's first choice."""
        for choice, ids, text in zip(choices, prompts, texts):
            lead = choices[choice.index - choice.index % self.body.candidates]
            self._prompts[id(choice)] = ids, lead
            if self.body.echo:
                choice.prefix = text if isinstance(text, str) else self.tokenizer.decode(ids)

    def write(self, choice: Choice, text: str, token_ids: list[int], token_logprobs, reason, first: bool) -> dict:
        """The choice's next part (`first`: the one that starts it)."""
        offset = choice.sent_chars
        if first and self.body.echo:
            text = choice.prefix + text
            if self.logprobs is not None:
                prompt_ids, _ = self._prompts[id(choice)]
                entries = [None if p is None else p[1] for p in self._prompt_logprobs(choice)]
                token_ids, token_logprobs = prompt_ids + token_ids, entries + list(token_logprobs or ())
        choice.sent_chars += len(text)
        written = {"index": choice.index, "text": text, "finish_reason": reason,
                   "logprobs": self.logprobs.completion(token_ids, token_logprobs, offset) if self.logprobs else None}
        if first and self.body.prompt_logprobs is not None:
            written["prompt_logprobs"] = prompt_logprobs_field(self._prompt_logprobs(choice), self.tokenizer)
        return written

    def _prompt_logprobs(self, choice: Choice) -> list:
        _, lead = self._prompts[id(choice)]
        return lead.first.prompt_logprobs or []


def prompt_logprobs_field(entries: list, tokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), token id -> its logprob, rank (1: the most
    likely) and text, the prompt's own token first."""
    def ranked(rank: int, entry: dict[int, float]) -> dict:
        chosen = next(iter(entry))
        alternatives = sorted((t for t in entry if t != chosen), key=lambda t: -entry[t])
        ranks = {t: i + 1 for i, t in enumerate(alternatives)} | {chosen: rank}
        return {str(t): {"logprob": entry[t], "rank": ranks[t], "decoded_token": tokenizer.decode([t])}
                for t in [chosen, *alternatives]}

    return [None if entry is None else ranked(*entry) for entry in entries]
