"""Seeded benchmark workloads, saved as JSONL so every system replays identical input.

Prompts are windows cut from a deterministic synthetic English corpus tokenized with the model's
own tokenizer: the token statistics (and so attention patterns) look like text, not like one
repeated id, and no dataset download is needed. Output lengths are forced (the systems ignore EOS),
so every system produces exactly the same number of tokens per request.
"""

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# A small vocabulary sampled with Zipf-like weights gives text whose token frequencies resemble prose.
_WORDS = """
the of and to a in is that for it as was with be by on not he this are or his from at which but have
an they you were her she there been one all we their has would when if so no will more can its what
about time only other new some could these two may first then do any like my now over such our man me
even most made after also did many before must through back years where much your way well down should
because each just those people how too little state good very make world still own see men work long get
here between both life being under never day same another know while last might us great old year off
come since against go came right used take three system model memory cache token request batch server
engine network kernel layer block queue latency throughput compute value design data signal process
river mountain city market music history science language water light garden window letter story
question answer problem reason number table paper voice school family country house morning evening
quickly slowly carefully often rarely together almost always never perhaps simply really quite rather
""".split()
_ENDS = [".", ".", ".", ".", "?", "!"]


def synthetic_text(num_words: int, seed: int = 0) -> str:
    """Deterministic prose-like text: Zipf-weighted words, sentences of 6-24 words with commas, paragraphs."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(_WORDS) + 1) ** 1.1
    words = rng.choice(len(_WORDS), size=num_words, p=weights / weights.sum())
    out: list[str] = []
    sentence_left = 0
    for i, w in enumerate(words):
        word = _WORDS[w]
        if sentence_left == 0:
            sentence_left = int(rng.integers(6, 25))
            word = word.capitalize()
            if out and rng.random() < 0.15:
                out.append("\n\n")
        sentence_left -= 1
        if sentence_left == 0:
            word += _ENDS[rng.integers(len(_ENDS))]
        elif rng.random() < 0.08:
            word += ","
        out.append(word)
    return " ".join(out).replace(" \n\n ", "\n\n")


@dataclass(frozen=True)
class TokenCorpus:
    """Token ids of one long text; prompts are windows cut at seeded offsets."""

    token_ids: np.ndarray

    def window(self, rng: np.random.Generator, length: int) -> list[int]:
        if length > len(self.token_ids):
            raise ValueError(f"window of {length} tokens exceeds the {len(self.token_ids)}-token corpus")
        start = int(rng.integers(0, len(self.token_ids) - length + 1))
        return self.token_ids[start : start + length].tolist()


def load_tokenizer(model: str):
    from kvloom.engine.model import model_files, model_loader

    return model_loader.load_tokenizer(model_files.resolve_model_dir(model))


def default_corpus(model: str = "smollm2", num_words: int = 60_000) -> TokenCorpus:
    """The synthetic corpus tokenized by `model`'s tokenizer (~70k tokens: room for 4k windows)."""
    ids = load_tokenizer(model).encode(synthetic_text(num_words), add_special_tokens=False)
    return TokenCorpus(np.asarray(ids, dtype=np.int64))


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    prompt: list[int] | str  # token ids (what the generators write) or text
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the replay starts
    tenant: str = "default"
    priority: int = 0
    lora: str | None = None  # the LoRA adapter it runs with (kvloom: engine/lora/)


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    params: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "Workload":
        requests = [WorkloadRequest(**json.loads(line)) for line in path.read_text().splitlines() if line]
        return cls(path.stem, requests, {"path": str(path)})

    def tokenized(self, encode: Callable[[str], list[int]]) -> "Workload":
        """The same workload with every text prompt turned into ids, the way the engine encodes text."""
        requests = [r if isinstance(r.prompt, list) else WorkloadRequest(**{**asdict(r), "prompt": encode(r.prompt)})
                    for r in self.requests]
        return Workload(self.name, requests, self.params)

    def with_token_ids(self, model: str) -> "Workload":
        """Token ids for every prompt (loading `model`'s tokenizer only if some prompt is text), so every
        system, peers included, gets identical ids."""
        if all(isinstance(r.prompt, list) for r in self.requests):
            return self
        return self.tokenized(load_tokenizer(model).encode)

    def head(self, n: int) -> "Workload":
        """The first `n` requests (a stated subset, for a system that cannot finish them all)."""
        return Workload(self.name, self.requests[:n], {**self.params, "subset": n})


# ---- distributions ------------------------------------------------------------------------------
def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """Lognormal lengths with the given mean before clipping (mu = ln(mean) - sigma^2 / 2)."""
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(int)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times of a Poisson process (exponential gaps of mean 1/rate), first one at t=0."""
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _build(name: str, corpus: TokenCorpus, rng: np.random.Generator, prompt_lens, output_lens, arrivals,
           prefix: list[int] = ()) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(f"{name}-{i}", list(prefix) + corpus.window(rng, int(p)), int(o), round(float(t), 6))
        for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, arrivals))
    ]


# ---- generators ---------------------------------------------------------------------------------
def offline_mixed(corpus: TokenCorpus, rng: np.random.Generator, num_requests: int = 64,
                  prompt_len: tuple[int, int] = (16, 512), output_len: tuple[int, int] = (16, 256)):
    """W1: everything at t=0, prompt and output lengths uniform (inclusive bounds)."""
    prompts = rng.integers(prompt_len[0], prompt_len[1] + 1, num_requests)
    outputs = rng.integers(output_len[0], output_len[1] + 1, num_requests)
    return _build("w1", corpus, rng, prompts, outputs, np.zeros(num_requests))


def chat(corpus: TokenCorpus, rng: np.random.Generator, num_requests: int = 48, rate: float = 0.5,
         prompt_mean: float = 250, output_mean: float = 200, sigma: float = 0.8):
    """ShareGPT-like: lognormal prompt/output lengths (means ~250 / 200 tokens), Poisson arrivals."""
    prompts = lognormal_lengths(rng, num_requests, prompt_mean, sigma, 4, 2048)
    outputs = lognormal_lengths(rng, num_requests, output_mean, sigma, 4, 1024)
    return _build("chat", corpus, rng, prompts, outputs, poisson_arrivals(rng, num_requests, rate))


def single_stream(corpus: TokenCorpus, rng: np.random.Generator, num_requests: int = 8, prompt_len: int = 256,
                  output_len: int = 128, gap_s: float = 8.0):
    """One request at a time: fixed lengths, arrivals `gap_s` apart (each finishes well before the next
    arrives on every system measured here), so TTFT and TPOT are per-request overheads, not batching."""
    return _build("single", corpus, rng, np.full(num_requests, prompt_len), np.full(num_requests, output_len),
                  np.arange(num_requests) * gap_s)


def long_prefill(corpus: TokenCorpus, rng: np.random.Generator, num_requests: int = 40, num_long: int = 4,
                 rate: float = 0.5, long_len: tuple[int, int] = (2048, 4096), long_output: int = 32,
                 prompt_mean: float = 250, output_mean: float = 200, sigma: float = 0.8):
    """A few 2-4k-token prompts among short chats: unchunked, each long prefill stalls every decode."""
    prompts = lognormal_lengths(rng, num_requests, prompt_mean, sigma, 4, 1024)
    outputs = lognormal_lengths(rng, num_requests, output_mean, sigma, 4, 512)
    long_idx = rng.choice(np.arange(1, num_requests), size=num_long, replace=False)  # not first: decodes run
    prompts[long_idx] = rng.integers(long_len[0], long_len[1] + 1, num_long)
    outputs[long_idx] = long_output
    return _build("long", corpus, rng, prompts, outputs, poisson_arrivals(rng, num_requests, rate))


def shared_prefix(corpus: TokenCorpus, rng: np.random.Generator, num_requests: int = 32,
                  prefix_len: int = 1024, suffix_len: tuple[int, int] = (16, 128),
                  output_len: tuple[int, int] = (16, 128)):
    """One 1k-token system prompt shared by every request (at t=0), then a short own question."""
    prefix = corpus.window(rng, prefix_len)
    suffixes = rng.integers(suffix_len[0], suffix_len[1] + 1, num_requests)
    outputs = rng.integers(output_len[0], output_len[1] + 1, num_requests)
    return _build("shared", corpus, rng, suffixes, outputs, np.zeros(num_requests), prefix)


_NOUNS = """system model memory cache token request batch server engine network kernel layer block queue
value design data signal process river mountain city market music history science language water light garden
window letter story question answer problem reason number table paper voice school family country house""".split()
_VERBS = "moved found kept opened carried wrote followed changed checked watched built answered".split()
_ADJECTIVES = "small old quiet bright long busy empty new slow careful green heavy".split()
_PLACES = "near the, behind the, under the, after the, beside the, across the".split(", ")


def _plain_sentences(rng: np.random.Generator, num_sentences: int) -> str:
    """Grammatical sentences ("The busy server kept the old letter near the river."): text a small model
    copies the way it would copy real prose, which word salad is not."""
    pick = lambda words: words[int(rng.integers(len(words)))]  # noqa: E731
    sentences = [f"The {pick(_ADJECTIVES)} {pick(_NOUNS)} {pick(_VERBS)} the {pick(_NOUNS)} "
                 f"{pick(_PLACES)} {pick(_NOUNS)}." for _ in range(num_sentences)]
    return " ".join(sentences)


def _typos(rng: np.random.Generator, text: str, rate: float = 0.03) -> str:
    """`text` with about `rate` of its words misspelt (two letters swapped): what a rewrite fixes."""
    words = text.split(" ")
    for i in np.flatnonzero(rng.random(len(words)) < rate):
        w = words[i]
        if len(w) > 3 and w.isalpha():
            j = int(rng.integers(len(w) - 1))
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def _synthetic_code(rng: np.random.Generator, num_functions: int) -> str:
    """Python functions built from the corpus words: loops, arithmetic and calls that look like code."""
    names = [w for w in _WORDS if w.isalpha() and len(w) > 2]
    pick = lambda k: [names[i] for i in rng.choice(len(names), k, replace=False)]  # noqa: E731
    functions = []
    for _ in range(num_functions):
        fn, a, b, acc, item = pick(5)
        body = [f"def {fn}_{a}({a}, {b}):", f'    """Return the {acc} of every {item} in {a}."""', f"    {acc} = 0",
                f"    for {item} in {a}:"]
        for _ in range(int(rng.integers(1, 4))):
            op = ["+=", "-=", "*="][int(rng.integers(3))]
            body.append(f"        {acc} {op} {item} * {b} + {int(rng.integers(1, 100))}")
        body += [f"    if {acc} > {b}:", f"        return {acc} - {b}", f"    return {acc}"]
        functions.append("\n".join(body))
    return "\n\n\n".join(functions)


def copy_heavy(corpus: TokenCorpus, rng: np.random.Generator, num_requests: int = 32,
               passage_words: tuple[int, int] = (80, 240)):
    """Answers that largely repeat the prompt: rewrite (fix typos in a passage), extract (copy the
    matching lines of a table) and code edit (rename a variable in a file), in turn. Text prompts in a
    completion format any model follows; max_tokens is about the answer's length (4 characters a token).
    The corpus is unused: the passages are generated text, so the answer's source is in the prompt."""
    requests = []
    for i in range(num_requests):
        kind = ("rewrite", "extract", "code")[i % 3]
        if kind == "rewrite":
            answer = _plain_sentences(rng, int(rng.integers(*passage_words)) // 9)
            prompt = f"Rewrite the text below, fixing the spelling mistakes.\n\nText:\n{_typos(rng, answer)}\n\nRewritten text:\n"
        elif kind == "extract":
            cities = ["river", "mountain", "garden", "market"]
            rows = [f"{j + 1}. name: {_WORDS[w]}, city: {cities[int(rng.integers(4))]}, year: {int(rng.integers(1900, 2030))}"
                    for j, w in enumerate(rng.integers(len(_WORDS), size=int(rng.integers(*passage_words)) // 8))]
            answer = "\n".join(r for r in rows if "city: river" in r)
            prompt = "Copy the records whose city is river, unchanged.\n\nRecords:\n" + "\n".join(rows) + "\n\nRecords in river:\n"
        else:
            code = _synthetic_code(rng, int(rng.integers(2, 5)))
            old = code.split("(")[1].split(",")[0]
            answer = code.replace(old, old + "_list")
            prompt = f"Rename `{old}` to `{old}_list` in this code and return the whole file.\n\n```python\n{code}\n```\n\nThe whole file:\n```python\n"
        requests.append(WorkloadRequest(f"copy-{i}", prompt, max(16, len(answer) // 4)))
    return requests


GENERATORS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "offline-mixed": offline_mixed,
    "chat": chat,
    "long-prefill": long_prefill,
    "shared-prefix": shared_prefix,
    "single-stream": single_stream,
    "copy-heavy": copy_heavy,
}


def make_workload(name: str, corpus: TokenCorpus, seed: int = 0, **params) -> Workload:
    """Generate workload `name`; the same (name, seed, params, corpus) always gives the same requests."""
    try:
        generator = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(GENERATORS)}") from None
    rng = np.random.default_rng(seed)
    return Workload(name, generator(corpus, rng, **params), {"seed": seed, **params})
