"""A compressed-tensors checkpoint of any local model, written by the compressed-tensors library itself (a test and
benchmark dependency, not kvloom's): round-to-nearest scales from each group's min and max, as llm-compressor's
weight-only schemes compute them without calibration data, then its own compressor and config writer."""

from pathlib import Path

# llm-compressor's preset names, with the group size left to the caller (a tiny model's rows are short)
SCHEMES = {
    "W4A16": {"weights": {"num_bits": 4, "symmetric": True, "strategy": "group"}},
    "W4A16_ASYM": {"weights": {"num_bits": 4, "symmetric": False, "strategy": "group"}},
    "W8A16": {"weights": {"num_bits": 8, "symmetric": True, "strategy": "channel"}},
    "W8A8": {"weights": {"num_bits": 8, "symmetric": True, "strategy": "channel"},
             "input_activations": {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}},
}


def write_compressed(model_dir: Path, target: Path, scheme: str, group_size: int = 128, dtype: str = "bfloat16",
                     ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """`model_dir`'s linears quantized by `scheme` (SCHEMES; `group_size` for the grouped ones), the model loaded in
    `dtype` (the scales' dtype), saved with its tokenizer files to `target` as llm-compressor saves."""
    import shutil

    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    args = {part: QuantizationArgs(type="int", **values, **({"group_size": group_size}
                                                            if values.get("strategy") == "group" else {}))
            for part, values in SCHEMES[scheme].items()}
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **args)},
                                ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        weights = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if weights is None:
            continue
        w = module.weight.data
        groups = w.unflatten(-1, (-1, weights.group_size)) if weights.strategy == "group" else w[:, None, :]
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    for path in model_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(path, target / path.name)
    return target
