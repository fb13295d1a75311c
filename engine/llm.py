"""LLM: offline batch generation, the simplest way to use the engine."""

import torch
from tqdm import tqdm

from kvloom.engine.config import EngineConfig
from kvloom.engine.errors import InvalidRequestError
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.outputs import RequestOutput
from kvloom.engine.sampling import SamplingParams, StructuredOutputs
from kvloom.engine.tool_calls.tool_format import ToolFormat
from kvloom.engine.tool_calls.tools import parse_tool_choice, parse_tools
from kvloom.kernels.item_pool import torch_threads


class LLM:
    """The engine on the caller's thread: that thread's torch ops run on the engine's thread count (one where
    kvloom's kernels run on the item pool, a rank's share under tensor parallelism) only while it steps, so the
    caller's own torch work keeps its cores."""

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        if model is not None:
            engine_kwargs["model"] = model
        with torch_threads(torch.get_num_threads()):
            self.engine = LLMEngine(EngineConfig(**engine_kwargs))
            self.step_threads = torch.get_num_threads()  # as the engine set this thread up for its steps

    @property
    def tool_format(self) -> ToolFormat:
        """The format tool calls are written in (`tool_call_parser`): its `parse` reads them from an output."""
        return self.engine.inputs.tool_format

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt as one continuous batch; outputs come back in prompt order. One prompt (a string or
        a list of token ids) is a batch of one, as vLLM takes it. Every prompt is checked before any is queued,
        so a bad one raises with the engine as it was. `lora`: a LoRA adapter's name for every prompt, or one
        per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("params", f"{len(params_list)} sampling params for {len(prompts)} prompts")
        adapters = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(adapters) != len(prompts):
            raise InvalidRequestError("lora", f"{len(adapters)} adapter names for {len(prompts)} prompts")
        requests = [self.engine.make_request(f"offline-{i}", prompt, p, lora=name)
                    for i, (prompt, p, name) in enumerate(zip(prompts, params_list, adapters))]
        for request in requests:
            self.engine.add_prepared(request)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(prompts), disable=not use_tqdm, desc="generating")
        with progress as bar, torch_threads(self.step_threads):
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r.request_id] for r in requests]

    def chat(
        self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None, use_tqdm: bool = False,
        tools: list[dict] | None = None, tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, as vLLM takes them. With `tools` (OpenAI's form) the
        server's tool calling applies: the tools reach the template, calls are constrained to their schemas; read
        them from an output's text with the engine's format: `llm.tool_format.parse(text)`."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        use = self.tool_format.tool_use(parse_tools(tools) if tools else None, parse_tool_choice(tool_choice),
                                        parallel_tool_calls)
        prompts = [self.engine.apply_chat_template(messages, use) for messages in conversations]
        if use is not None:
            params = (params or SamplingParams()).model_copy(update={"structured_outputs": StructuredOutputs(
                structural_tag=self.tool_format.structural_tag(use), field="tools")})
        return self.generate(prompts, params, use_tqdm)
