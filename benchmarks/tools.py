"""Tool calls that parse and validate: kvloom against vLLM's CPU build on the same model, template and requests.

Generates tool tasks (a user question meant for one of a set of tools, offered with two others) in three modes:
`auto`, `required`, and the named function. Each system serves SmolLM2 over HTTP: kvloom as `kvloom serve`, vLLM
as `vllm serve --enable-auto-tool-choice --tool-call-parser hermes` with a chat template that renders the tools as
kvloom's Hermes fallback does (peer_setup/smollm2_hermes_tools.jinja), so both see one prompt (the report compares
their prompt token counts). Greedy, one request at a time. Per system and mode: the calls returned, how many parse
as JSON and validate against the called tool's `parameters`, calls to tools not offered, tasks where the mode was
not honoured (no call under `required`/named, another tool under named), tool-call markup left in `content`, and
HTTP errors.

Run: `python -m kvloom.benchmarks.tools [--peers vllm]` (vLLM set up by `bash benchmarks/peer_setup/vllm.sh`);
writes `benchmarks/results/tools.{md,json}`.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import jsonschema

from kvloom.benchmarks.source_commit import source_commit
from kvloom.benchmarks.external_peers import SERVED_NAME, ServerUnavailable, running_server
from kvloom.benchmarks.harness import BenchSettings, SystemSpec
from kvloom.kernels.host_isa import host_isa

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TEMPLATE = Path(__file__).resolve().parent / "peer_setup" / "smollm2_hermes_tools.jinja"
MODES = ("auto", "required", "named")
MAX_TOKENS = 128


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = {
    "get_weather": (function("get_weather", "The current weather in a city",
                             {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                             ["city"]),
                    ["What is the weather in {city}?", "Is it raining in {city} right now?",
                     "How warm is it in {city} in fahrenheit?"]),
    "add": (function("add", "Add two integers", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
            ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute the sum of {a} and {b}."]),
    "convert_currency": (function("convert_currency", "Convert an amount between currencies",
                                  {"amount": {"type": "number", "minimum": 0},
                                   "from": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
                                   "to": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}},
                                  ["amount", "from", "to"]),
                         ["Convert {a} USD to EUR.", "How many yen is {a} pounds?", "Change {a} EUR into dollars."]),
    "search_flights": (function("search_flights", "Find flights between two airports on a date",
                                {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                 "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                 "date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
                                 "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                                ["origin", "destination", "date"]),
                       ["Find me a flight from JFK to LHR on 2026-05-{day}.",
                        "Are there flights from CDG to NRT for {small} people on 2026-07-{day}?",
                        "Book-search SFO to SEA on 2026-03-{day}."]),
    "create_event": (function("create_event", "Add an event to the calendar",
                              {"title": {"type": "string"}, "start": {"type": "string"},
                               "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                               "attendees": {"type": "array", "items": {"type": "string"}}},
                              ["title", "start"]),
                     ["Schedule a meeting called {word} tomorrow at 10am with Ana and Bo.",
                      "Put '{word} review' in my calendar on Friday for {small}0 minutes.",
                      "Create an event {word} at 3pm."]),
    "send_email": (function("send_email", "Send an email",
                            {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"},
                             "urgent": {"type": "boolean"}}, ["to", "subject", "body"]),
                   ["Email bob@example.com that the {word} report is ready.",
                    "Send an urgent email to ops@example.com about the {word} outage.",
                    "Write to ana@example.com with subject {word} saying thanks."]),
    "set_timer": (function("set_timer", "Set a timer", {"seconds": {"type": "integer", "minimum": 1},
                                                        "label": {"type": "string"}}, ["seconds"]),
                  ["Set a timer for {small} minutes.", "Remind me in {a} seconds to stretch.",
                   "Start a {small} minute timer called {word}."]),
    "lookup_order": (function("lookup_order", "Look up an order's status",
                              {"order_id": {"type": "string", "pattern": "^[0-9]{6}$"},
                               "include_items": {"type": "boolean"}}, ["order_id"]),
                     ["Where is my order {order}?", "What is in order {order}?", "Status of order number {order}?"]),
}
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Denver", "Seoul"]
WORDS = ["budget", "design", "launch", "hiring", "quarterly", "security", "offsite", "roadmap"]


@dataclass
class Task:
    task_id: str
    mode: str
    target: str
    tools: list[str]
    question: str

    def body(self, model: str) -> dict:
        choice = {"type": "function", "function": {"name": self.target}} if self.mode == "named" else self.mode
        return {"model": model, "messages": [{"role": "user", "content": self.question}], "temperature": 0,
                "max_tokens": MAX_TOKENS, "tools": [TOOLS[t][0] for t in self.tools], "tool_choice": choice,
                "parallel_tool_calls": False}


def make_tasks(per_mode: int, seed: int = 0) -> list[Task]:
    """`per_mode` tasks in each mode: every tool a target in turn, offered with two others, in a random order."""
    rng = random.Random(seed)
    names = sorted(TOOLS)
    tasks = []
    for mode in MODES:
        for i in range(per_mode):
            target = names[i % len(names)]
            offered = [target, *rng.sample([n for n in names if n != target], 2)]
            rng.shuffle(offered)
            question = rng.choice(TOOLS[target][1]).format(
                city=rng.choice(CITIES), a=rng.randint(2, 999), b=rng.randint(2, 999), day=f"{rng.randint(10, 28)}",
                small=rng.randint(2, 9), word=rng.choice(WORDS), order=f"{rng.randint(0, 999999):06d}")
            tasks.append(Task(f"{mode}-{i}", mode, target, offered, question))
    return tasks


@dataclass
class Outcome:
    """One task as a system answered it."""

    task_id: str
    status: int
    prompt_tokens: int = 0
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments", "valid", "why"}
    markup_in_content: bool = False
    finish_reason: str | None = None


def judge(task: Task, status: int, body: dict) -> Outcome:
    if status != 200:
        return Outcome(task.task_id, status)
    choice = body["choices"][0]
    message = choice["message"]
    calls = []
    for call in message.get("tool_calls") or ():
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        why = None
        if name not in task.tools:
            why = "a tool not offered"
        else:
            try:
                jsonschema.validate(json.loads(arguments), TOOLS[name][0]["function"]["parameters"])
            except json.JSONDecodeError as exc:
                why = f"not JSON: {exc.msg}"
            except jsonschema.ValidationError as exc:
                why = f"invalid: {exc.message[:80]}"
        calls.append({"name": name, "arguments": arguments, "valid": why is None, "why": why})
    return Outcome(task.task_id, status, body["usage"]["prompt_tokens"], calls,
                   "<tool_call>" in (message.get("content") or ""), choice["finish_reason"])


def run_tasks(base: str, model: str, tasks: list[Task]) -> list[Outcome]:
    outcomes = []
    with httpx.Client(timeout=300) as client:
        for task in tasks:
            response = client.post(f"{base}/v1/chat/completions", json=task.body(model))
            outcomes.append(judge(task, response.status_code, response.json() if response.status_code == 200 else {}))
    return outcomes


def summary(tasks: list[Task], outcomes: list[Outcome]) -> dict[str, dict]:
    by_id = {t.task_id: t for t in tasks}
    rows = {}
    for mode in MODES:
        mine = [o for o in outcomes if by_id[o.task_id].mode == mode]
        calls = [c for o in mine for c in o.calls]
        unhonoured = [o for o in mine if o.status == 200 and mode != "auto" and (
            not o.calls or (mode == "named" and any(c["name"] != by_id[o.task_id].target for c in o.calls)))]
        rows[mode] = {"tasks": len(mine), "errors": sum(o.status != 200 for o in mine),
                      "tasks_with_calls": sum(bool(o.calls) for o in mine), "calls": len(calls),
                      "valid_calls": sum(c["valid"] for c in calls), "unhonoured": len(unhonoured),
                      "unhonoured_cut_short": sum(o.finish_reason == "length" for o in unhonoured),
                      "markup_in_content": sum(o.markup_in_content for o in mine)}
    return rows


SYSTEMS = {
    "kvloom": SystemSpec("kvloom serve", "kvloom-serve"),
    "vllm": SystemSpec("vllm serve (hermes parser)", "vllm-serve", extra_args=(
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE))),
}


def measure(systems: list[str], tasks: list[Task], out: Path) -> dict:
    settings = BenchSettings(max_num_seqs=8, kv_cache_memory_bytes=1 << 30)
    results = {}
    for name in systems:
        started = time.monotonic()
        try:
            log = Path(tempfile.gettempdir()) / f"kvloom-tools-{name}.log"
            with running_server(SYSTEMS[name], settings, 2048, log) as server:
                outcomes = run_tasks(server.base, SERVED_NAME, tasks)
        except ServerUnavailable as exc:
            results[name] = {"status": f"{exc} (log: {log})"}
            print(f"[tools] {name}: {exc}", flush=True)
            continue
        results[name] = {"status": "ok", "seconds": time.monotonic() - started,
                         "summary": summary(tasks, outcomes), "outcomes": [asdict(o) for o in outcomes]}
        print(f"[tools] {name}: {results[name]['summary']}", flush=True)
    return results


def pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def write_report(doc: dict, out: Path) -> None:
    results, meta = doc["results"], doc["meta"]
    lines = ["# Tool calls that parse and validate", "",
             f"`python -m kvloom.benchmarks.tools` at {meta['commit']} on {meta['host']}, {meta['tasks']} tasks "
             f"({meta['per_mode']} a mode), SmolLM2-135M at each server's default dtype, greedy, one request at a "
             f"time, `max_tokens` {MAX_TOKENS}, `parallel_tool_calls: false`. A call is valid when its tool was "
             "offered and its arguments parse as JSON and validate against that tool's `parameters`.", "",
             "| system | mode | tasks | HTTP errors | tasks with calls | calls | valid | not honoured (cut at max_tokens) "
             "| markup in content |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, result in results.items():
        if result["status"] != "ok":
            lines.append(f"| {SYSTEMS[name].name} | {result['status']} | | | | | | | |")
            continue
        for mode, row in result["summary"].items():
            lines.append(f"| {SYSTEMS[name].name} | {mode} | {row['tasks']} | {row['errors']} | "
                         f"{row['tasks_with_calls']} | {row['calls']} | {row['valid_calls']} "
                         f"({pct(row['valid_calls'], row['calls'])}) | {row['unhonoured']} "
                         f"({row['unhonoured_cut_short']}) | {row['markup_in_content']} |")
    lines += ["", "## Reading", "", *reading(results), ""]
    (out / "tools.md").write_text("\n".join(lines) + "\n")


def reading(results: dict) -> list[str]:
    """Sentences made from the figures."""
    said = []
    for name, result in results.items():
        if result["status"] != "ok":
            said.append(f"- {SYSTEMS[name].name}: not measured ({result['status']}).")
            continue
        rows = result["summary"].values()
        calls, valid = sum(r["calls"] for r in rows), sum(r["valid_calls"] for r in rows)
        invalid = [c["why"] for o in result["outcomes"] for c in o["calls"] if not c["valid"]]
        said.append(f"- {SYSTEMS[name].name}: {valid} of {calls} calls valid ({pct(valid, calls)}); "
                    f"{sum(r['unhonoured'] for r in rows)} tasks where `required` or the named tool got no such "
                    f"call ({sum(r['unhonoured_cut_short'] for r in rows)} of them cut at max_tokens {MAX_TOKENS}, "
                    f"inside a call); {sum(r['markup_in_content'] for r in rows)} replies with tool-call markup left in "
                    f"content; {sum(r['errors'] for r in rows)} HTTP errors"
                    + (f"; the invalid ones: {', '.join(sorted(set(invalid))[:5])}." if invalid else "."))
    ok = {n: r for n, r in results.items() if r["status"] == "ok"}
    if len(ok) == 2:
        first, second = (ok[n]["outcomes"] for n in ok)
        same = sum(a["prompt_tokens"] == b["prompt_tokens"] for a, b in zip(first, second))
        said.append(f"- Prompts: {same} of {len(first)} tasks had the same prompt token count on both servers.")
    return said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.benchmarks.tools", description=__doc__.split("\n")[0])
    parser.add_argument("--per-mode", type=int, default=70)
    parser.add_argument("--peers", default="vllm", help="comma-separated: vllm, or '' for kvloom alone")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", type=Path, help="rewrite the report from this tools.json, measuring nothing")
    args = parser.parse_args(argv)
    if args.render:
        doc = json.loads(args.render.read_text())
        for result in doc["results"].values():
            if result["status"] == "ok":
                result["summary"] = summary([Task(**t) for t in doc["tasks"]],
                                            [Outcome(**o) for o in result["outcomes"]])
        write_report(doc, args.out)
        return 0
    tasks = make_tasks(args.per_mode)
    args.out.mkdir(parents=True, exist_ok=True)
    results = measure(["kvloom", *filter(None, args.peers.split(","))], tasks, args.out)
    doc = {"meta": {"commit": source_commit(), "host": f"{host_isa().describe()}", "tasks": len(tasks),
                    "per_mode": args.per_mode}, "tasks": [asdict(t) for t in tasks], "results": results}
    (args.out / "tools.json").write_text(json.dumps(doc, indent=1))
    write_report(doc, args.out)
    print(f"[tools] report: {args.out / 'tools.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
