"""The tool-call benchmark's parts, without servers: the template vLLM gets renders each task's prompt as kvloom
does, tasks come evenly per mode, a reply's calls are judged against the offered tools' schemas, and the report
says what its figures say."""

from kvloom.benchmarks import tools as bench
from kvloom.engine.model.fast_tokenizer import _compile_template
from kvloom.engine.tool_calls.conversation import chat_token_ids
from kvloom.engine.tool_calls.formats import FORMATS
from kvloom.engine.tool_calls.tools import parse_tool_choice, parse_tools, tool_use


def test_the_template_given_to_vllm_renders_every_task_as_kvloom_does(smollm2_dir):
    from kvloom.engine.model.fast_tokenizer import load_fast_tokenizer

    tokenizer = load_fast_tokenizer(smollm2_dir)
    template = _compile_template(bench.TEMPLATE.read_text())
    for task in bench.make_tasks(10):
        body = task.body("m")
        use = tool_use(parse_tools(body["tools"]), parse_tool_choice(body["tool_choice"]), False)
        for messages in (body["messages"], [{"role": "system", "content": "Be brief."}, *body["messages"]]):
            theirs = template.render(messages=messages, tools=body["tools"], add_generation_prompt=True)
            assert tokenizer.encode(theirs, add_special_tokens=False) == chat_token_ids(tokenizer, messages, FORMATS["hermes"], use)


def test_tasks_come_evenly_per_mode_every_tool_a_target_offered_with_two_others():
    tasks = bench.make_tasks(16)
    assert [sum(t.mode == m for t in tasks) for m in bench.MODES] == [16, 16, 16]
    assert all(t.target in t.tools and len(set(t.tools)) == 3 for t in tasks)
    assert {t.target for t in tasks} == set(bench.TOOLS)
    assert bench.make_tasks(16) == tasks  # the same tasks every run


def reply(calls: list[tuple[str, str]], content: str | None = None) -> dict:
    return {"choices": [{"finish_reason": "tool_calls", "message": {"content": content, "tool_calls": [
        {"function": {"name": n, "arguments": a}} for n, a in calls]}}], "usage": {"prompt_tokens": 9}}


def test_a_reply_is_judged_against_the_offered_tools_schemas():
    task = bench.Task("named-0", "named", "add", ["add", "get_weather", "set_timer"], "Add 2 and 3.")
    outcome = bench.judge(task, 200, reply([("add", '{"a": 2, "b": 3}'), ("add", '{"a": "2"}'), ("add", "{oops"),
                                            ("send_email", "{}")], content="<tool_call>"))
    assert [c["valid"] for c in outcome.calls] == [True, False, False, False]
    assert [c["why"].split(":")[0] for c in outcome.calls[1:]] == ["invalid", "not JSON", "a tool not offered"]
    assert outcome.markup_in_content and outcome.prompt_tokens == 9
    assert bench.judge(task, 500, {}).status == 500


def test_the_report_reads_its_figures(tmp_path):
    tasks = bench.make_tasks(2)
    outcomes = [bench.judge(t, 200, reply([(t.target, "{}")])) for t in tasks]
    doc = {"meta": {"commit": "abc", "host": "x86", "tasks": len(tasks), "per_mode": 2},
           "results": {"kvloom": {"status": "ok", "summary": bench.summary(tasks, outcomes),
                                  "outcomes": [o.__dict__ for o in outcomes]},
                       "vllm": {"status": "not set up: run `bash benchmarks/peer_setup/vllm.sh`"}}}
    bench.write_report(doc, tmp_path)
    report = (tmp_path / "tools.md").read_text()
    valid = sum(c["valid"] for o in outcomes for c in o.calls)
    assert f"{valid} of {len(outcomes)} calls valid" in report
    assert "not measured (not set up" in report
