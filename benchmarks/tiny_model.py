"""A tiny random Llama-family checkpoint, built on the fly: for tests, and for benchmarks of the serving path
whose engine steps must cost next to nothing."""

from pathlib import Path


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def build_tiny_llama(path: Path, seed: int = 0, model_type: str = "llama", tied: bool = False,
                     chat: bool = False, context: int = 1024) -> Path:
    """A 2-layer random Llama-family model (llama, qwen2, qwen3) with grouped-query attention and a
    word-level tokenizer (`w3` .. `w511`); `tied`: the LM head shares the embedding table (like SmolLM2);
    `chat`: the tokenizer has a chat template (CHAT_TEMPLATE), so the chat endpoints serve it; `context`: its
    max_position_embeddings."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    config = AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=context,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
