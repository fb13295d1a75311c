"""Multi-LoRA over real HTTP: two replicas of the tiny model with adapters from the config, from a dynamic loading
path and loaded at run time; requests land where their adapter is loaded, tenants are held to their adapters, and
every refusal has its status and names its field."""

import shutil
import time

import httpx
import pytest

from kvloom.benchmarks.random_weights import write_random_adapter
from kvloom.cluster.config import ClusterConfig
from kvloom.engine.llm import LLM
from kvloom.engine.model.model_config import ModelConfig
from kvloom.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = [[17, 5, 99, 23, 7], [201, 45, 3, 88, 120, 9, 14], [300, 301, 302]]
MAX_TOKENS = 12
POOL = 1 << 24  # KV bytes of the offline reference (the default 2 GiB costs an engine 1-7 s to fault in here)
TENANTS = [{"name": "alice", "api_keys": ["sk-alice"]},
           {"name": "limited", "api_keys": ["sk-limited"], "lora_adapters": ["qv"]}]
ALICE, ADMIN = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-admin"}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("http-adapters")
    config = ModelConfig.from_dir(tiny_model_dir)
    made = {name: str(write_random_adapter(root / name, config, rank, seed=seed, targets=targets))
            for seed, (name, rank, targets) in enumerate([
                ("qv", 4, ("q_proj", "v_proj")), ("mlp", 8, ("gate_proj", "up_proj", "down_proj")),
                ("late", 2, ("o_proj", "v_proj")), ("wide", 32, ("q_proj",))])}
    shutil.copytree(made.pop("mlp"), root / "dynamic" / "mlp")
    return {**made, "mlp": str(root / "dynamic" / "mlp")}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters) -> dict[str | None, list[str]]:
    """Each prompt's greedy text under the base and each adapter, from the offline engine (itself equal to
    transformers + peft: test_lora.py)."""
    llm = LLM(str(tiny_model_dir), dtype="float32", lora={"adapters": {n: adapters[n] for n in ("qv", "mlp", "late")}},
              kv_cache_memory_bytes=POOL)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {name: [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, lora=name)]
            for name in (None, "qv", "mlp", "late")}


@pytest.fixture(scope="module")
def server(ray_serve, deploy_app, tiny_model_dir, adapters):
    config = ClusterConfig.model_validate({
        "served_model_name": "tiny", "num_replicas": 2, "tenants": TENANTS, "admin_keys": ["sk-admin"],
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "kv_cache_memory_bytes": 8 << 20,
                   "max_num_seqs": 8},
        "lora": {"adapters": {"qv": adapters["qv"]}, "dynamic_loading_path": str(adapters["mlp"].rsplit("/", 1)[0]),
                 "max_lora_rank": 16},
    })
    router = deploy_app(config)
    return ray_serve, router


def complete(base: str, model: str, prompt: list[int], key: dict = ALICE) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", headers=key, timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def holders(router, adapter: str) -> list[str]:
    return [s["replica_id"] for s in router.replica_stats.remote().result() if adapter in s["lora_adapters"]]


def reported_holders(router, adapter: str, within_s: float = 10.0) -> list[str]:
    """`holders` once a replica's stats report the adapter: they come every 0.5 s, and a fast host serves the
    requests after its last one sooner."""
    deadline = time.monotonic() + within_s
    while not (found := holders(router, adapter)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_requests_for_an_adapter_land_on_the_replica_that_loaded_it_and_equal_the_offline_engine(server, expected):
    """One at a time, so both replicas are idle at each choice: without the adapter preference the router's
    least-loaded choice would alternate between them. Usage and metrics count each adapter's work."""
    base, router = server
    for name in ("qv", "mlp", "tiny:qv"):
        for i, prompt in enumerate(PROMPTS):
            assert text(complete(base, name, prompt)) == expected[name.removeprefix("tiny:")][i]
    assert text(complete(base, "tiny", PROMPTS[0])) == expected[None][0]
    for name in ("qv", "mlp"):
        assert len(reported_holders(router, name)) == 1, router.replica_stats.remote().result()
    usage = httpx.get(f"{base}/v1/usage", headers=ADMIN).json()["data"]
    alice = next(entry for entry in usage if entry["tenant"] == "alice")
    assert alice["lora"]["mlp"]["requests"] == len(PROMPTS) and alice["lora"]["qv"]["requests"] == 2 * len(PROMPTS)
    assert alice["lora"]["mlp"]["completion_tokens"] == len(PROMPTS) * MAX_TOKENS
    generated = f'kvloom:generation_tokens_total{{lora="mlp",tenant="alice"}} {float(len(PROMPTS) * MAX_TOKENS)}'
    assert generated in httpx.get(f"{base}/metrics").text


def test_a_tenant_is_held_to_its_adapters_and_unknown_models_are_404(server):
    base, _ = server
    limited = {"Authorization": "Bearer sk-limited"}
    assert complete(base, "qv", PROMPTS[0], limited).status_code == 200
    refused = complete(base, "mlp", PROMPTS[0], limited)
    assert refused.status_code == 403
    assert refused.json()["error"]["param"] == "model" and "'mlp'" in refused.json()["error"]["message"]
    unknown = complete(base, "tiny:nobody", PROMPTS[0])
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert complete(base, "../qv", PROMPTS[0]).status_code == 404


def test_adapters_load_and_unload_over_http(server, adapters, expected):
    base, _ = server
    load = {"lora_name": "late", "lora_path": adapters["late"]}
    assert httpx.post(f"{base}/v1/load_lora_adapter", json=load, headers=ALICE).status_code == 401
    loaded = httpx.post(f"{base}/v1/load_lora_adapter", json=load, headers=ADMIN)
    assert loaded.status_code == 200, loaded.text
    models = httpx.get(f"{base}/v1/models", headers=ALICE).json()["data"]
    assert {(m["id"], m["parent"]) for m in models} == {("tiny", None), ("qv", "tiny"), ("mlp", "tiny"),
                                                       ("late", "tiny")}
    assert text(complete(base, "late", PROMPTS[1])) == expected["late"][1]
    again = httpx.post(f"{base}/v1/load_lora_adapter", json=load, headers=ADMIN)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    wide = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": adapters["wide"]},
                      headers=ADMIN)
    assert wide.status_code == 400 and "max_lora_rank is 16" in wide.json()["error"]["message"]
    assert wide.json()["error"]["param"] == "lora_path"
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ADMIN).status_code == 200
    assert complete(base, "late", PROMPTS[1]).status_code == 404
    gone = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ADMIN)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


def models_ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", headers=ALICE).status_code == 200
    except httpx.HTTPError:  # the proxy found no router yet
        return False


def test_adapters_loaded_and_unloaded_at_run_time_outlive_a_router_killed_mid_service(server, adapters, expected,
                                                                                     router_killer):
    """Serve restarts a crashed router with its deployment's arguments, which name the configured adapters only:
    what was loaded and unloaded since comes back from the deployment's ledger (router/adapter_ledger.py)."""
    base, _ = server
    load = {"lora_name": "late", "lora_path": adapters["late"]}
    assert httpx.post(f"{base}/v1/load_lora_adapter", json=load, headers=ADMIN).status_code == 200
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "qv"}, headers=ADMIN).status_code == 200
    router_killer(lambda: models_ready(base))
    models = httpx.get(f"{base}/v1/models", headers=ALICE).json()["data"]
    assert {m["id"] for m in models} == {"tiny", "mlp", "late"}
    assert text(complete(base, "late", PROMPTS[1])) == expected["late"][1]
    assert complete(base, "qv", PROMPTS[0]).status_code == 404
