"""Conformance with clients nobody on this project wrote: `kvloom serve` and `vllm serve` side by side, each
started as a user would (its own process tree, loopback HTTP), then the same checks against each: the
`openai` package (sync and async, streamed and not), `litellm` (chat, text completion, streamed, async)
from `peer_drivers/client_checks.py`, and a short `guidellm` run at 1 and 16 concurrent streams (256
prompt tokens, 128 out). The clients live in a virtual environment of their own (`peer_setup/clients.sh`).

    python -m kvloom.benchmarks.studies.conformance      (~15 minutes; writes benchmarks/results/conformance.{md,json})
"""

import argparse
import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from kvloom.benchmarks.bench import environment
from kvloom.benchmarks.external_peers import (HERE, SERVED_NAME, PeerInstall, ServerUnavailable, peers_root,
                                              running_server)
from kvloom.benchmarks.harness import BenchSettings, SystemSpec
from kvloom.benchmarks.report import environment_lines
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.kernels.host_isa import auto_cpu_dtype, host_isa

RESULTS_DIR = HERE / "results"
RUNS_DIR = HERE / "out" / "conformance"
MAX_MODEL_LEN = 1024
GUIDELLM_CONCURRENCY = (1, 16)
GUIDELLM_SECONDS = 60
GUIDELLM_DATA = "prompt_tokens=256,output_tokens=128"
CLIENT_ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # litellm would fetch its price list online


def clients_install() -> PeerInstall:
    return PeerInstall(peers_root() / "clients" / "bin" / "python", "bash benchmarks/peer_setup/clients.sh")


def servers(dtype: str) -> list[SystemSpec]:
    """Each at the same dtype (kvloom's `auto` for this CPU), so only the server differs."""
    return [SystemSpec("kvloom serve", "kvloom-serve", engine={"dtype": dtype}),
            SystemSpec("vllm serve", "vllm-serve", engine={"dtype": dtype})]


def guidellm_command(clients_python: Path, base: str, model_dir: Path, concurrency: int, out: Path) -> list[str]:
    """guidellm 0.8's `run`: chat completions at a fixed number of streams; token counts with the served model's
    own tokenizer, read from its local folder (never a hub download)."""
    return [str(clients_python.parent / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={base},model={SERVED_NAME}",
            "--profile", f"kind=concurrent,streams={concurrency}",
            "--constraint", f"kind=max_duration,seconds={GUIDELLM_SECONDS}",
            "--data", f"kind=synthetic_text,{GUIDELLM_DATA}",
            "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def guidellm_summary(doc: dict) -> dict:
    """Requests that succeeded, failed and were cut at the end, output tokens per second over all of them, and
    the median TTFT, from guidellm's JSON report."""
    metrics = doc["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    return {"successful": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "output_tok_s": metrics["output_tokens_per_second"]["total"]["mean"],
            "ttft_ms_p50": metrics["time_to_first_token_ms"]["successful"]["median"]}


def run_guidellm(clients_python: Path, base: str, model_dir: Path, concurrency: int, out_dir: Path) -> dict:
    out = out_dir / f"guidellm-{concurrency}.json"
    with (out_dir / f"guidellm-{concurrency}.log").open("w") as log:
        done = subprocess.run(guidellm_command(clients_python, base, model_dir, concurrency, out), stdout=log,
                              stderr=subprocess.STDOUT, timeout=GUIDELLM_SECONDS + 300, env=CLIENT_ENV)
    if done.returncode != 0 or not out.is_file():
        return {"error": f"guidellm exited {done.returncode} (see {out_dir / f'guidellm-{concurrency}.log'})"}
    return guidellm_summary(json.loads(out.read_text()))


def check_server(spec: SystemSpec, settings: BenchSettings, clients_python: Path, out_dir: Path) -> dict:
    """Start the server, run every client against it, stop it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        with running_server(spec, settings, MAX_MODEL_LEN, out_dir / "server.txt") as server:
            checks_out = out_dir / "client-checks.json"
            subprocess.run([str(clients_python), str(HERE / "peer_drivers" / "client_checks.py"), server.base,
                            SERVED_NAME, str(checks_out)], check=True, timeout=900, env=CLIENT_ENV)
            guidellm = {str(c): run_guidellm(clients_python, server.base, resolve_model_dir(settings.model), c, out_dir)
                        for c in GUIDELLM_CONCURRENCY}
    except ServerUnavailable as exc:
        return {"server": spec.name, "status": str(exc)}
    return {"server": spec.name, "status": "ok", "checks": json.loads(checks_out.read_text()), "guidellm": guidellm,
            "wall_s": time.monotonic() - started}


def _cell(check: dict | None) -> str:
    if check is None:
        return "–"
    return "pass" if check["ok"] else f"**FAIL** {check['detail'][:160]}".replace("|", "\\|").replace("\n", " ")


def _guidellm_cell(result: dict | None) -> str:
    if result is None:
        return "–"
    if "error" in result:
        return f"**FAIL** {result['error']}"
    return (f"{result['successful']} ok, {result['errored']} errored, {result['incomplete']} cut at the end; "
            f"{result['output_tok_s']:.1f} out tok/s, TTFT p50 {result['ttft_ms_p50']:.0f} ms")


def write_report(doc: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "conformance.json").write_text(json.dumps(doc, indent=1))
    runs = doc["servers"]
    names = [r["server"] for r in runs]
    by_server = {r["server"]: {c["check"]: c for c in r.get("checks", [])} for r in runs}
    checks = list(dict.fromkeys(c for r in runs for c in (x["check"] for x in r.get("checks", []))))
    lines = ["# Conformance: clients nobody on this project wrote, against kvloom and vLLM", "",
             environment_lines(doc["environment"]), "",
             f"Both servers at dtype {doc['dtype']}, max_model_len {MAX_MODEL_LEN}; clients: "
             + ", ".join(f"{k} {v}" for k, v in doc["clients"].items()) + ". "
             f"Regenerate: `python -m kvloom.benchmarks.studies.conformance` ({doc['wall_s'] / 60:.0f} minutes).", "",
             "| check | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for check in checks:
        lines.append(f"| {check} | " + " | ".join(_cell(by_server[n].get(check)) for n in names) + " |")
    for concurrency in GUIDELLM_CONCURRENCY:
        lines.append(f"| guidellm, {concurrency} concurrent, {GUIDELLM_SECONDS} s, {GUIDELLM_DATA} | " + " | ".join(
            _guidellm_cell(r.get("guidellm", {}).get(str(concurrency))) for r in runs) + " |")
    for run in runs:
        if run["status"] != "ok":
            lines.append(f"\n{run['server']}: {run['status']}")
    path = out_dir / "conformance.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def client_versions(clients_python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({p: m.version(p) for p in ('openai', 'litellm', 'guidellm')}))")
    return json.loads(subprocess.run([str(clients_python), "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.studies.conformance", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)
    install = clients_install()
    if not install.ready:
        print(f"the clients are {install.missing}")
        return 1
    started = time.monotonic()
    dtype = auto_cpu_dtype(host_isa())
    settings = replace(BenchSettings(model=args.model), max_num_seqs=16, kv_cache_memory_bytes=1 << 30)
    runs = [check_server(spec, settings, install.executable, RUNS_DIR / spec.kind) for spec in servers(dtype)]
    doc = {"environment": environment(settings), "dtype": dtype, "clients": client_versions(install.executable),
           "servers": runs, "wall_s": time.monotonic() - started}
    print(f"report: {write_report(doc, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
