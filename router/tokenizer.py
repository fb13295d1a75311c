"""The router's tokenizer, without transformers or torch.

The router only encodes prompts, renders chats through the model's template and decodes single tokens
for logprobs. transformers' AutoTokenizer does that with the same `tokenizers` backend, but importing it
maps torch into the router process (~250 MB of its ~440 MB). This reads the model folder's
tokenizer.json with `tokenizers` and renders `chat_template.jinja` (or tokenizer_config.json's
`chat_template`) with jinja2 the way transformers does: a sandboxed environment with trimmed blocks,
its `tojson`, `raise_exception` and `strftime_now`, the special tokens as variables, `None`-valued
message fields dropped, and the rendered text encoded without adding special tokens (the template
writes them). A folder with no tokenizer.json (a slow, sentencepiece-only tokenizer) gets transformers'
own tokenizer, which has the same methods.
"""

import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def load_router_tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").is_file():
        from kvloom.engine.model.model_loader import load_tokenizer

        return load_tokenizer(model_dir)
    return RouterTokenizer(model_dir)


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


class RouterTokenizer:
    """The part of transformers' tokenizer API the router uses, on `tokenizers` and jinja2 alone."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {name: value["content"] if isinstance(value, dict) else value
                               for name in SPECIAL_TOKEN_NAMES if (value := config.get(name)) is not None}
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self.template = _compile_template(template) if isinstance(template, str) else None

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=False)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(t) for t in token_ids]

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False) -> list[int]:
        """Token ids of the rendered chat (`tokenize` and `return_dict` exist for transformers' signature:
        the router always asks for ids)."""
        if not tokenize or return_dict:
            raise ValueError("RouterTokenizer renders chats into token ids only")
        if self.template is None:
            raise ValueError("this model's tokenizer has no chat template")
        messages = [{k: v for k, v in message.items() if v is not None} for message in conversation]
        text = self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return self.encode(text, add_special_tokens=False)
