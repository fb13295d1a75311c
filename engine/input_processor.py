"""Turning what a caller asks into an engine `Request`: tokenized, checked field by field, nothing queued.

Every check raises `InvalidRequestError` naming the field at fault, so a bad request never reaches the
scheduler and touches no engine state: any thread may build requests.
"""

import operator
import time

from kvloom.engine.errors import AdapterNotFoundError, InvalidRequestError
from kvloom.engine.logits_processors import LogitsAdjuster
from kvloom.engine.lora.adapter import AdapterRef
from kvloom.engine.lora.identity import LoRARequest
from kvloom.engine.lora.registry import LoRARegistry
from kvloom.engine.request import Request
from kvloom.engine.sampling import MAX_BAD_WORD_TOKENS, SamplingParams, truncated_prompt
from kvloom.engine.structured_output import GrammarCompiler
from kvloom.engine.tool_calls.conversation import chat_token_ids
from kvloom.engine.tool_calls.tool_format import ToolFormat
from kvloom.engine.tool_calls.tools import ToolUse
from kvloom.engine.unicode_text import not_unicode_field


def check_unicode(field: str, value) -> None:
    """Text the tokenizer can encode (see engine/unicode_text.py), else an error naming `field`."""
    if (where := not_unicode_field(value)) is not None:
        raise InvalidRequestError(field, "is not valid Unicode text (a lone UTF-16 surrogate"
                                         f"{f' at {where}' if where else ''})")


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: set[int],
                 grammars: GrammarCompiler, tool_format: ToolFormat, adapters: LoRARegistry | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.adapters = adapters
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars

    def apply_chat_template(self, messages: list[dict], tools: ToolUse | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template")
        check_unicode("messages", messages)
        return chat_token_ids(self.tokenizer, messages, self.tool_format, tools)

    def encode(self, prompt: str) -> list[int]:
        check_unicode("prompt", prompt)
        return self.tokenizer.encode(prompt)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None,
                     lora: str | LoRARequest | None = None, cache_namespace: int | None = None) -> Request:
        """Validate and tokenize; a missing max_tokens becomes what max_model_len leaves after the prompt. `lora`:
        the adapter (its name, or name and directory), read from disk now if it is not loaded; `cache_namespace`:
        whose prefix cache it shares (engine/cache_namespace.py; None: the engine's common one)."""
        params = params or SamplingParams()
        adapter = self.adapter(lora) if lora else None
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        try:  # a float id would pass the range check below and then fail every later step
            token_ids = [operator.index(t) for t in token_ids]
        except TypeError:
            raise InvalidRequestError("prompt", "token ids must be integers") from None
        token_ids = self._truncated(token_ids, params)
        if not token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"is {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)",
            )
        params = self._within_room(params, len(token_ids))
        self.check_vocabulary("prompt", token_ids)
        self.check_vocabulary("logit_bias", params.logit_bias)
        self.check_vocabulary("stop_token_ids", params.stop_token_ids)
        self.check_vocabulary("allowed_token_ids", params.allowed_token_ids or ())
        bad_words = self.bad_word_sequences(params.bad_words)
        return Request(
            request_id, token_ids, params, priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time, prompt=text,
            logits_adjuster=LogitsAdjuster.for_request(params, self.eos_token_ids, bad_words),
            grammar=self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None,
            lora=adapter, cache_namespace=cache_namespace,
        )

    def adapter(self, lora: str | LoRARequest) -> AdapterRef:
        lora = LoRARequest(name=lora) if isinstance(lora, str) else lora
        if self.adapters is None:
            raise AdapterNotFoundError(lora.name)
        return self.adapters.resolve(lora.name, lora.path)

    def _truncated(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt cut to truncate_prompt_tokens (engine/sampling.py's `truncated_prompt`), before any other check;
        a length that leaves no room for max_tokens is refused, as vLLM refuses it."""
        keep, generated = params.truncate_prompt_tokens, params.max_tokens or 1
        room = self.max_model_len - generated
        if keep is not None and keep > room:
            raise InvalidRequestError("truncate_prompt_tokens", f"is {keep}, but max_model_len ({self.max_model_len}) "
                                      f"less {generated} tokens to generate leaves room for {room}")
        return truncated_prompt(token_ids, keep, room)

    def bad_word_sequences(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word as it starts a text, and after a space (as it comes
        mid-text) where that is as many tokens but a different first one."""
        check_unicode("bad_words", words)
        sequences = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not bare:
                raise InvalidRequestError("bad_words", f"{word!r} has no tokens")
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences += [bare, spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [bare]
        tokens = [token for sequence in sequences for token in sequence]
        if len(tokens) > MAX_BAD_WORD_TOKENS:
            raise InvalidRequestError("bad_words", f"come to {len(tokens)} tokens; at most {MAX_BAD_WORD_TOKENS}")
        self.check_vocabulary("bad_words", tokens)
        return tuple(sequences)

    def _within_room(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """max_tokens within what max_model_len leaves (None: all of it), refused as vLLM and OpenAI refuse it
        rather than stopping short silently."""
        room = self.max_model_len - prompt_len
        taken = f"max_model_len is {self.max_model_len} and the prompt takes {prompt_len} tokens of it"
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise InvalidRequestError("min_tokens", f"is {params.min_tokens}, but {taken}")
            return params.model_copy(update={"max_tokens": room})
        if params.max_tokens > room:
            raise InvalidRequestError("max_tokens", f"is {params.max_tokens}, but {taken}: at most {room} can be "
                                                    "generated")
        return params

    def check_vocabulary(self, field: str, token_ids) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(field, f"token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})")

    def check_continuation(self, request: Request, output_token_ids: list[int]) -> None:
        """Tokens another engine generated for `request`: in the vocabulary, and leaving room for one more."""
        self.check_vocabulary("output_token_ids", output_token_ids)
        max_tokens = request.sampling_params.max_tokens
        if not 0 < len(output_token_ids) < max_tokens:
            raise InvalidRequestError("output_token_ids", f"continues with {len(output_token_ids)} tokens; "
                                      f"max_tokens is {max_tokens}")
