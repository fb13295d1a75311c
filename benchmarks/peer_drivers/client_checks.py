"""OpenAI-API clients nobody on this project wrote, against one server: the `openai` package (sync and async,
streamed and not) and `litellm`. Run inside the clients' own virtual environment (peer_setup/clients.sh);
imports neither kvloom nor anything it pins. Writes one JSON list: per check, its name, whether it passed,
and what it saw (or the error).
    python client_checks.py BASE_URL MODEL OUT.json
"""

import argparse
import asyncio
import json
import time
import traceback

import litellm
import openai

PROMPT = "The three most useful kitchen tools are"
QUESTION = [{"role": "user", "content": "Name two rivers in Europe."}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
               "required": ["city", "population"], "additionalProperties": False}


def completions(client: openai.OpenAI, model: str) -> str:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, n=2, logprobs=2)
    assert [c.index for c in result.choices] == [0, 1], result.choices
    assert result.choices[0].text == result.choices[1].text, "greedy choices differ"
    assert len(result.choices[0].logprobs.tokens) == 12 and len(result.choices[0].logprobs.top_logprobs[-1]) == 2
    assert result.usage.completion_tokens == 24, result.usage
    return repr(result.choices[0].text)


def echo(client: openai.OpenAI, model: str) -> str:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert result.choices[0].text.startswith(PROMPT), result.choices[0].text
    return repr(result.choices[0].text)


def echo_with_logprobs(client: openai.OpenAI, model: str) -> str:
    """OpenAI's way of scoring a prompt: the prompt tokens' logprobs come back with the echoed text."""
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) > result.usage.prompt_tokens - 1 and logprobs.token_logprobs[0] is None, logprobs
    return f"{len(logprobs.tokens)} tokens scored"


def streamed_completions(client: openai.OpenAI, model: str) -> str:
    chunks = list(client.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices, chunks[-1]
    assert all(texts.values()), texts
    return f"{len(chunks)} chunks"


def chat(client: openai.OpenAI, model: str) -> str:
    result = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0.7, seed=7,
                                            logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0.7, seed=7)
    message = result.choices[0].message
    assert message.role == "assistant" and message.content, message
    assert message.content == again.choices[0].message.content, "the same seed drew differently"
    assert len(result.choices[0].logprobs.content) == result.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in result.choices[0].logprobs.content)
    return repr(message.content)


def streamed_chat(client: openai.OpenAI, model: str) -> str:
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens > 0
    return repr("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def json_schema(client: openai.OpenAI, model: str) -> str:
    result = client.chat.completions.create(
        model=model, max_tokens=64, temperature=0.8, seed=1,
        messages=[{"role": "user", "content": "Give a city and its population as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    value = json.loads(result.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int), value
    return json.dumps(value)


def bad_request(client: openai.OpenAI, model: str) -> str:
    try:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=10**6)
    except openai.BadRequestError as exc:
        return f"400: {str(exc)[:120]}"
    raise AssertionError("max_tokens=10**6 was accepted")


def models(client: openai.OpenAI, model: str) -> str:
    listed = [m.id for m in client.models.list()]
    assert model in listed, listed
    return ", ".join(listed)


async def async_streams(base: str, model: str) -> str:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model=model, max_tokens=16, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}])
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(texts), texts
    return f"8 concurrent streams, {sum(map(len, texts))} characters"


def litellm_chat(base: str, model: str) -> str:
    result = litellm.completion(model=f"openai/{model}", api_base=f"{base}/v1", api_key="unused", messages=QUESTION,
                                max_tokens=16, temperature=0)
    assert result.choices[0].message.content and result.usage.completion_tokens > 0, result
    return repr(result.choices[0].message.content)


def litellm_streamed_chat(base: str, model: str) -> str:
    chunks = list(litellm.completion(model=f"openai/{model}", api_base=f"{base}/v1", api_key="unused",
                                     messages=QUESTION, max_tokens=16, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text, chunks
    return repr(text)


def litellm_text_completion(base: str, model: str) -> str:
    result = litellm.text_completion(model=f"text-completion-openai/{model}", api_base=f"{base}/v1",
                                     api_key="unused", prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text, result
    return repr(result.choices[0].text)


async def litellm_async(base: str, model: str) -> str:
    results = await asyncio.gather(*(litellm.acompletion(
        model=f"openai/{model}", api_base=f"{base}/v1", api_key="unused", max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": f"Say a word that starts with {letter}."}]) for letter in "ABCD"))
    assert all(r.choices[0].message.content for r in results)
    return f"{len(results)} concurrent"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.base}/v1", api_key="unused", max_retries=0, timeout=300)
    checks = {
        "openai: completions (n=2, logprobs)": lambda: completions(client, args.model),
        "openai: completions, echo": lambda: echo(client, args.model),
        "openai: completions, echo with logprobs (prompt scoring)": lambda: echo_with_logprobs(client, args.model),
        "openai: streamed completions, two prompts, usage": lambda: streamed_completions(client, args.model),
        "openai: chat, seeded, top_logprobs": lambda: chat(client, args.model),
        "openai: streamed chat, usage": lambda: streamed_chat(client, args.model),
        "openai: chat response_format json_schema": lambda: json_schema(client, args.model),
        "openai: a bad request raises BadRequestError": lambda: bad_request(client, args.model),
        "openai: models.list": lambda: models(client, args.model),
        "openai async: 8 concurrent streamed chats": lambda: asyncio.run(async_streams(args.base, args.model)),
        "litellm: completion": lambda: litellm_chat(args.base, args.model),
        "litellm: completion, streamed": lambda: litellm_streamed_chat(args.base, args.model),
        "litellm: text_completion": lambda: litellm_text_completion(args.base, args.model),
        "litellm: acompletion, 4 concurrent": lambda: asyncio.run(litellm_async(args.base, args.model)),
    }
    results = []
    for name, check in checks.items():
        start = time.monotonic()
        try:
            results.append({"check": name, "ok": True, "detail": check()})
        except Exception as exc:  # a failed check is a result, not a crash: the others still run
            results.append({"check": name, "ok": False,
                            "detail": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]})
        results[-1]["seconds"] = round(time.monotonic() - start, 2)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
