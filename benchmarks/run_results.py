"""Lookups in a benchmark run (the JSON-ready dicts `bench` writes): the one module reports and goals both read.
"""


def system_result(run: dict, system: str) -> dict | None:
    return next((r for r in run["results"] if r["spec"]["name"] == system), None)


def metric(run: dict, system: str, path: str):
    """A metric of one system in a run, by dotted path ("output_tok_s", "tpot.p99"); None if absent."""
    for r in run["results"]:
        if r["spec"]["name"] == system and r["metrics"]:
            value = r["metrics"]
            for key in path.split("."):
                value = value.get(key) if isinstance(value, dict) else None
            return value
    return None


def cpu_efficiency(m: dict) -> float | None:
    """Output tokens per CPU second of the run: on a shared machine this moves far less with the
    neighbours' load than tokens per wall second (a waiting thread sleeps, so it is not charged)."""
    return m["output_tokens"] / m["cpu_s"] if m.get("cpu_s") else None


def latency_cell(stats: dict | None, key: str, ms: bool) -> str:
    """One latency statistic for a table: milliseconds or seconds, a dash where there is none."""
    if not stats or stats[key] is None:
        return "–"
    return format(stats[key] * 1000 if ms else stats[key], ".0f" if ms else ".1f")
