"""From sampled tokens to what a caller sees: stop checks token by token, incremental text, `RequestOutput`s.

A step may bring a request several tokens (speculation): each is checked in turn and the ones after a stop are
dropped. Text is detokenized incrementally, and held back while it could still become a stop string. As in vLLM, a
stop or EOS token's text is left out unless the request asks for `include_stop_str_in_output`.
"""

import time
from collections.abc import Callable

from kvloom.engine.detokenizer import IncrementalDetokenizer, token_decoder
from kvloom.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.sampler import SampledToken


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        # token ids to text, by skip_special_tokens
        self.decoders: dict[bool, Callable[[list[int]], str]] = {skip: token_decoder(tokenizer, skip)
                                                                 for skip in (True, False)}
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def track(self, request: Request) -> None:
        """Start a request's text (from its tokens so far: an imported decode has the prompt and first token)."""
        params = request.sampling_params
        if params.detokenize:
            self.detokenizers[request.request_id] = IncrementalDetokenizer(
                self.decoders[params.skip_special_tokens], request.token_ids, params.stop,
                params.include_stop_str_in_output)

    def replay(self, request: Request, output_token_ids: list[int], emitted_chars: int) -> None:
        """Take up an output another engine began: its tokens become this request's own, the client already
        has `emitted_chars` of their text."""
        detok = self.detokenizers.get(request.request_id)
        for token in output_token_ids:
            request.token_ids.append(token)
            if request.grammar is not None:
                request.grammar.accept(token)
            if detok is not None:
                detok.add_token(token, check_stop=False)  # it did not stop there, or it would not go on
        if detok is not None:
            detok.emitted = min(emitted_chars, len(detok.text))

    def accept(self, request: Request, tokens: list[SampledToken]) -> tuple[list[int], RequestStatus | None]:
        """Check stop conditions token by token; drop the tokens after a stop. The new tokens and the status
        the request finished with, if it did."""
        first = request.num_tokens - len(tokens)
        new_tokens: list[int] = []
        status = None
        for token in tokens:
            new_tokens.append(token.token_id)
            if token.logprobs is not None:
                request.output_logprobs.append(token.logprobs)
            status = self._check_stop(request, token.token_id, first + len(new_tokens) - request.num_prompt_tokens)
            if status is not None:
                del request.token_ids[first + len(new_tokens):]
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                break
        return new_tokens, status

    def _check_stop(self, request: Request, token_id: int, num_output: int) -> RequestStatus | None:
        """Whether the output ends at `token_id`, its `num_output`-th token."""
        params = request.sampling_params
        if request.grammar is not None and request.grammar.accept(token_id):
            return self._stopped_on_token(request, token_id)  # the grammar ends on an end token
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return self._stopped_on_token(request, token_id)
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return self._stopped_on_token(request, token_id)
        detok = self.detokenizers.get(request.request_id)
        if detok is not None:
            stop = detok.add_token(token_id, check_stop=num_output >= params.min_tokens)
            if stop is not None:
                request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or request.num_prompt_tokens + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _stopped_on_token(self, request: Request, token_id: int) -> RequestStatus:
        """The output ends on a token rather than on text: the token's text is left out, unless the request asks for
        include_stop_str_in_output (vLLM's: then it is decoded as any other, a special token's text skipped unless
        skip_special_tokens is off)."""
        detok = self.detokenizers.get(request.request_id)
        if detok is not None and request.sampling_params.include_stop_str_in_output:
            detok.add_token(token_id, check_stop=False)
        return RequestStatus.FINISHED_STOPPED

    def output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        """The request as it stands after this step; a finished request's text is released whole and its
        detokenizer dropped."""
        finished = request.is_finished
        detok = self.detokenizers.pop(request.request_id, None) if finished else \
            self.detokenizers.get(request.request_id)
        delta = detok.release(finished) if detok else ""
        wants_logprobs = request.sampling_params.logprobs is not None
        completion = CompletionOutput(
            text=detok.text[: detok.emitted] if detok else "",
            token_ids=request.output_token_ids,
            delta_text=delta,
            delta_token_ids=new_tokens,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if wants_logprobs else None,
        )
        metrics = RequestMetrics(
            request.arrival_time, request.first_scheduled_time, request.first_token_time,
            time.monotonic() if finished else None,
        )
        first = len(new_tokens) == len(request.output_token_ids) and bool(new_tokens)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, [completion], finished,
            request.num_cached_prompt_tokens, metrics, request.priority,
            prompt_logprobs=request.prompt_logprobs if first or finished else None,
        )
