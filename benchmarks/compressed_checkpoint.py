"""Integer checkpoints of any local model, as the quantizers write them: compressed-tensors (written by that library
itself, a test and benchmark dependency, not kvloom's: round-to-nearest scales from each group's min and max, as
llm-compressor's weight-only schemes compute them without calibration data, then its own compressor and config
writer), AutoAWQ's GEMM format (round to nearest as AutoAWQ's `pseudo_quantize_tensor`, without its activation
search, packed in its order), and GPTQ's (the integers of such a compressed-tensors checkpoint, laid out as AutoGPTQ
and GPTQModel pack theirs: GPTQ's own error-compensating rounding needs calibration data and changes only which
integers are stored)."""

from pathlib import Path

# llm-compressor's preset names, with the group size left to the caller (a tiny model's rows are short)
SCHEMES = {
    "W4A16": {"weights": {"num_bits": 4, "symmetric": True, "strategy": "group"}},
    "W4A16_ASYM": {"weights": {"num_bits": 4, "symmetric": False, "strategy": "group"}},
    "W8A16": {"weights": {"num_bits": 8, "symmetric": True, "strategy": "channel"}},
    "W8A8": {"weights": {"num_bits": 8, "symmetric": True, "strategy": "channel"},
             "input_activations": {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}},
}


def copy_tokenizer(model_dir: Path, target: Path) -> None:
    """The tokenizer's and generation config's files, which a quantizer saves beside its weights."""
    import shutil

    for path in model_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(path, target / path.name)


def write_compressed(model_dir: Path, target: Path, scheme: str, group_size: int = 128, dtype: str = "bfloat16",
                     ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """`model_dir`'s linears quantized by `scheme` (SCHEMES; `group_size` for the grouped ones), the model loaded in
    `dtype` (the scales' dtype), saved with its tokenizer files to `target` as llm-compressor saves."""
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
    copy_tokenizer(model_dir, target)
    return target


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's gemm packing: nibble i of a word holds output 8c + AWQ_ORDER[i]


def write_awq(model_dir: Path, target: Path, group_size: int = 128) -> Path:
    """`model_dir`'s layer linears as AutoAWQ's 4-bit gemm checkpoint (float16 scales, zero points), with its config."""
    import json
    import torch
    from safetensors.torch import load_file, save_file

    def pack(nibbles: torch.Tensor) -> torch.Tensor:  # [R, C] in 0..15 -> int32 [R, C / 8] in AutoAWQ's order
        words = nibbles.to(torch.int32).unflatten(-1, (-1, 8))[..., AWQ_ORDER]
        return (words << (torch.arange(8, dtype=torch.int32) * 4)).sum(-1, dtype=torch.int32)

    tensors = {name: t.half() for name, t in load_file(model_dir / "model.safetensors").items()}
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        w = tensors.pop(name).float().T.unflatten(0, (-1, group_size))  # [K / g, g, N]
        low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        scales = ((high - low).clamp(min=1e-5) / 15).half()
        zeros = (-torch.round(low / scales.float())).clamp(0, 15)
        q = (torch.round(w / scales.float()[:, None]) + zeros[:, None]).clamp(0, 15).flatten(0, 1)  # [K, N]
        prefix = name.removesuffix(".weight")
        tensors |= {f"{prefix}.qweight": pack(q), f"{prefix}.qzeros": pack(zeros), f"{prefix}.scales": scales}
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": None}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(model_dir, target)
    return target


def write_gptq(source: Path, target: Path, checkpoint_format: str = "gptq") -> Path:
    """A compressed-tensors checkpoint `write_compressed` wrote (pack-quantized, one config group) as a GPTQ one:
    qweight int32 [K * bits / 32, N] (inputs packed down the columns, input k at bit (k % (32 / bits)) * bits),
    qzeros [G, N * bits / 32] (outputs packed along the rows), scales [G, N], g_idx [K], with the config AutoGPTQ
    (`gptq`: zero points less one) or GPTQModel (`gptq_v2`) writes."""
    import json

    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file, save_file

    from kvloom.engine.model.gptq import V1_ZERO_OFFSET, int32_bits

    config = json.loads((source / "config.json").read_text())
    [group] = config["quantization_config"]["config_groups"].values()
    bits, symmetric = group["weights"]["num_bits"], group["weights"]["symmetric"]
    middle = 1 << (bits - 1)

    def pack_columns(unsigned: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R * bits / 32, C] 32-bit words
        per_word = 32 // bits
        shifts = (torch.arange(per_word, dtype=torch.int64) * bits)[None, :, None]
        return (unsigned.to(torch.int64).unflatten(0, (-1, per_word)) << shifts).sum(1)

    tensors = load_file(source / "model.safetensors")
    out = {name: t for name, t in tensors.items()
           if not name.endswith((".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape"))}
    for prefix in [n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")]:
        shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())  # [N, K]
        q = unpack_from_int32(tensors[f"{prefix}.weight_packed"], bits, shape)
        scale = tensors[f"{prefix}.weight_scale"]  # [N, G]
        zero = torch.zeros_like(scale, dtype=torch.int32) if symmetric else unpack_from_int32(
            tensors[f"{prefix}.weight_zero_point"], bits, scale.shape, packed_dim=0)
        zero_words = pack_columns(zero.to(torch.int64) + middle)  # [N * bits / 32, G]: outputs packed
        if checkpoint_format == "gptq":
            zero_words = zero_words - V1_ZERO_OFFSET[bits]
        out |= {f"{prefix}.qweight": int32_bits(pack_columns(q.T.to(torch.int64) + middle)),
                f"{prefix}.qzeros": int32_bits(zero_words.T.contiguous()), f"{prefix}.scales": scale.T.contiguous(),
                f"{prefix}.g_idx": (torch.arange(shape[1]) // (shape[1] // scale.shape[1])).to(torch.int32)}
    target.mkdir(parents=True, exist_ok=True)
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    group_size = group["weights"].get("group_size") if group["weights"]["strategy"] == "group" else -1
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                     "desc_act": False, "sym": symmetric, "checkpoint_format": checkpoint_format,
                                     "pack_dtype": "int32", "true_sequential": True}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(source, target)
    return target


def library_dequantized(model_dir: Path) -> dict:
    """Every quantized linear's weight as the compressed-tensors library de-quantizes it, in float64 (an AutoAWQ
    checkpoint through the library's converter to its own format first)."""
    import json

    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as library_dequantize
    from safetensors.torch import load_file

    tensors = load_file(model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    if config["quant_method"] == "awq":
        converter = AutoAWQConverter.from_autoawq_config(config)
        tensors, config = converter.process(tensors), converter.update_config(None).model_dump()
    [group] = config["config_groups"].values()
    args = QuantizationArgs(**group["weights"])
    weights = {}
    for prefix in sorted(n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")):
        scale, zero_point = tensors[f"{prefix}.weight_scale"].double(), tensors.get(f"{prefix}.weight_zero_point")
        if config["format"] == "pack-quantized":
            shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
            q = unpack_from_int32(tensors[f"{prefix}.weight_packed"], args.num_bits, shape)
            if zero_point is not None:
                zero_point = unpack_from_int32(zero_point, args.num_bits, torch.Size([shape[0], scale.shape[1]]),
                                               packed_dim=0)
        else:
            q = tensors[f"{prefix}.weight"]
        weights[f"{prefix}.weight"] = library_dequantize(q, scale, zero_point, args, dtype=torch.float64)
    return weights


def write_with_references(jobs: list[dict]) -> None:
    """Each job's checkpoint (`write_awq` for scheme AWQ; `write_compressed`: model_dir, target, scheme, group_size,
    dtype; with `gptq` set to a checkpoint format, that one through `write_gptq`) and, beside it,
    `<target>.reference.safetensors`: `library_dequantized` of it (for GPTQ, of the compressed-tensors checkpoint its
    integers came from). Tests run this in a process of their own: the compressed-tensors library imports triton,
    which a test process must import later."""
    from safetensors.torch import save_file

    for job in jobs:
        source, target = Path(job["model_dir"]), Path(job["target"])
        if job["scheme"] == "AWQ":
            write_awq(source, target, job["group_size"])
            compressed = target
        else:
            compressed = target.with_name(f"{target.name}.compressed") if job.get("gptq") else target
            write_compressed(source, compressed, job["scheme"], job["group_size"], job.get("dtype", "bfloat16"))
        if job.get("gptq"):
            write_gptq(compressed, target, job["gptq"])
        save_file(library_dequantized(compressed), target.parent / f"{target.name}.reference.safetensors")


if __name__ == "__main__":
    import json
    import sys

    write_with_references(json.loads(sys.argv[1]))
