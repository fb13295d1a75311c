"""kvloom's tokenizer: the model folder's tokenizer.json through `tokenizers`, without transformers or torch.

The router encodes prompts, renders chats and decodes tokens for logprobs; the engine encodes, renders chats,
detokenizes its output and knows its end tokens. transformers' AutoTokenizer does all that with the same
`tokenizers` backend, but importing it costs a process seconds (2-3 s of a replica's start, and a router
would map torch, ~250 MB of its ~440 MB). This reads tokenizer.json with `tokenizers` and renders
`chat_template.jinja` (or tokenizer_config.json's `chat_template`) with jinja2 the way transformers does: a
sandboxed environment with trimmed blocks, its `tojson`, `raise_exception` and `strftime_now`, the special
tokens as variables, `None`-valued message fields dropped, and the rendered text encoded without adding special
tokens (the template writes them). What needs transformers' own tokenizer object (xgrammar's vocabulary, for
structured outputs) loads it on first use (`huggingface`). A folder with no tokenizer.json (a slow,
sentencepiece-only tokenizer) gets transformers' tokenizer, which has the same methods.
"""

import functools
import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def huggingface_tokenizer(model_dir: Path, model_config=None):
    """transformers' own tokenizer for the folder (AutoTokenizer, local files only); `model_config`, a
    ModelConfig, tells it the tokenizer class where the folder's files do not."""
    from transformers import AutoTokenizer

    config = model_config.transformers_config if model_config is not None else None
    return AutoTokenizer.from_pretrained(model_dir, config=config, local_files_only=True)


def load_fast_tokenizer(model_dir: Path, model_config=None):
    """A FastTokenizer where the folder has tokenizer.json, else transformers' tokenizer."""
    if not (model_dir / "tokenizer.json").is_file():
        return huggingface_tokenizer(model_dir, model_config)
    return FastTokenizer(model_dir, model_config)


def as_huggingface(tokenizer):
    """transformers' tokenizer object for a library that wants one."""
    return tokenizer.huggingface if isinstance(tokenizer, FastTokenizer) else tokenizer


def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(source)


class FastTokenizer:
    """The part of transformers' tokenizer API kvloom uses, on `tokenizers` and jinja2 alone."""

    def __init__(self, model_dir: Path, model_config=None) -> None:
        """`model_config`: what `huggingface` passes on (see `huggingface_tokenizer`)."""
        from tokenizers import Tokenizer

        self.model_dir, self.model_config = model_dir, model_config
        self.backend_tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {name: value["content"] if isinstance(value, dict) else value
                               for name in SPECIAL_TOKEN_NAMES if (value := config.get(name)) is not None}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None
        self.template = _compile_template(template) if self.chat_template else None

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.backend_tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    @functools.cached_property
    def huggingface(self):
        """transformers' tokenizer for the same folder, loaded on first use."""
        return huggingface_tokenizer(self.model_dir, self.model_config)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.clean_up_tokenization_spaces:  # what transformers does after the backend: leave it to it
            return self.huggingface.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(t) for t in token_ids]

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat (`tokenize` and `return_dict` exist for transformers' signature:
        kvloom always asks for ids); `tools` for a template that takes them (tool_calls/conversation.py)."""
        if not tokenize or return_dict:
            raise ValueError("FastTokenizer renders chats into token ids only")
        if self.template is None:
            raise ValueError("this model's tokenizer has no chat template")
        messages = [{k: v for k, v in message.items() if v is not None} for message in conversation]
        text = self.template.render(messages=messages, tools=tools, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return self.encode(text, add_special_tokens=False)
