"""The batching strategies the lab compares: each is a set of engine knobs over the same engine and kernels."""

STRATEGIES: dict[str, dict] = {
    "static": {"batching": "static", "enable_chunked_prefill": False},
    "dynamic": {"batching": "dynamic", "enable_chunked_prefill": False},
    "continuous": {"batching": "continuous", "enable_chunked_prefill": False},
    "continuous+chunked": {"batching": "continuous", "enable_chunked_prefill": True},
}
