"""lm-evaluation-harness against a live kvloom, as an eval user runs it: its `local-completions` model (echo with
logprobs on /v1/completions) on a small multiple-choice task made here as a JSONL file picks the same answers as
its `hf` backend on the same checkpoint, with loglikelihoods within 1e-3 (float32 on both sides)."""

import json

import pytest

from kvloom.cluster.config import ClusterConfig

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32"}
SHARED_APP = "smollm2"  # the app these modules serve is one: conftest.deploy starts it once for them all
QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Madrid"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The largest planet in our solar system is", [" Jupiter", " Mars", " Venus"], 0),
    ("A week has seven", [" days", " months", " years"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Bees make", [" honey", " milk", " silk"], 0),
]
TASK = """task: kvloom_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm-eval-task")
    data = directory / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (directory / "kvloom_mc.yaml").write_text(TASK.format(data=data))
    return directory


def loglikelihoods(model: str, model_args: str, task_dir) -> dict[int, list[float]]:
    """Each question's choices' loglikelihoods, as lm-eval computed them."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=["kvloom_mc"], log_samples=True,
                              task_manager=TaskManager(include_path=str(task_dir)), batch_size=1)
    return {sample["doc_id"]: [float(resp[0]) for resp in sample["filtered_resps"]]
            for sample in results["samples"]["kvloom_mc"]}


def test_local_completions_scores_a_multiple_choice_task_as_the_hf_backend_does(ray_serve, deploy_app, smollm2_dir,
                                                                                 task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    deploy_app(ClusterConfig.model_validate({"engine": ENGINE, "num_replicas": 1}))
    served = loglikelihoods("local-completions", f"base_url={ray_serve}/v1/completions,model=smollm2,"
                            f"tokenizer_backend=huggingface,tokenizer={smollm2_dir},max_retries=1", task_dir)
    reference = loglikelihoods("hf", f"pretrained={smollm2_dir},dtype=float32,device=cpu", task_dir)
    assert served.keys() == reference.keys() == set(range(len(QUESTIONS)))
    for doc_id, expected in reference.items():
        assert served[doc_id] == pytest.approx(expected, abs=1e-3)
        assert max(range(3), key=served[doc_id].__getitem__) == max(range(3), key=expected.__getitem__)
