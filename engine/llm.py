"""LLM: offline batch generation, the simplest way to use the engine."""

from tqdm import tqdm

from kvloom.engine.config import EngineConfig
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.outputs import RequestOutput
from kvloom.engine.sampling import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        if model is not None:
            engine_kwargs["model"] = model
        self.engine = LLMEngine(EngineConfig(**engine_kwargs))

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt as one continuous batch; outputs come back in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.engine.add_request(request_id, prompt, p)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

    def chat(
        self, conversations: list[list[dict]], params: SamplingParams | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        prompts = [self.engine.apply_chat_template(messages) for messages in conversations]
        return self.generate(prompts, params, use_tqdm)
