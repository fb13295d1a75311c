"""One attention API, three implementations: the reference oracle, the CPU fast path, Triton."""

from typing import Callable, NamedTuple

import torch


class AttentionBackend(NamedTuple):
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # a CUDA graph may capture it: it reads sequence lengths and tables on the device only (Triton); the reference
    # reads them on the host (a sync inside capture, and a replay would keep the captured lengths)
    graph_safe: bool = False


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA and the CPU fast path elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "reference":
        from kvloom.kernels import reference as impl
    elif name == "cpu":
        from kvloom.kernels import cpu_attention as impl

        impl.decode_extension()  # build (once per machine) now rather than on the first request
        impl.prefill_extension()
    elif name == "triton":
        from kvloom.kernels import triton_attention as impl
    else:
        raise ValueError(f"attention_backend must be auto, reference, cpu or triton, got {name!r}")
    return AttentionBackend(name, impl.write_kv, impl.paged_attention, graph_safe=name == "triton")
