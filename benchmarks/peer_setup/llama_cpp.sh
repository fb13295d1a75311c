#!/usr/bin/env bash
# Sets up llama.cpp's llama-server as a benchmark peer: built from the source the llama-cpp-python sdist
# carries (-march=native, so the build folder is keyed by this CPU's instruction set), plus the embedded
# SmolLM2 as GGUF files of each type that may be llama.cpp's fastest on a CPU: F16 and BF16 and Q8_0 (by
# llama.cpp's own converter) and Q4_0 (by its llama-quantize, from the F16 file). Idempotent.
#   bash benchmarks/peer_setup/llama_cpp.sh     (under ~/.cache/kvloom/peers, or $KVLOOM_PEERS_DIR)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=.venv/bin/python   # kvloom's environment: the converter needs torch, transformers and gguf
[[ -x $python ]] || { echo "run ./dev.sh test (or serve) once first: it creates .venv" >&2; exit 1; }
root="${KVLOOM_PEERS_DIR:-$HOME/.cache/kvloom/peers}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
key=$($python -c "from kvloom.kernels.host_isa import host_isa; print(host_isa().build_key)")
prefix="$root/llama.cpp-$key"
src="$root/src/llama-cpp-python-$version"
if [[ ! -d $src ]]; then
  mkdir -p "$root/src"
  $python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root/src"
  tar -xzf "$root/src/llama_cpp_python-$version.tar.gz" -C "$root/src"
  mv "$root/src/llama_cpp_python-$version" "$src"
fi
if [[ ! -x $prefix/bin/llama-server || ! -x $prefix/bin/llama-quantize ]]; then
  cmake -S "$src/vendor/llama.cpp" -B "$prefix/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
  cmake --build "$prefix/build" --target llama-server llama-quantize -j "$(nproc)"
  mkdir -p "$prefix/bin"
  cp "$prefix/build/bin/llama-server" "$prefix/build/bin/llama-quantize" "$prefix/bin/"
fi
model_dir=$($python -c "from kvloom.engine.model.model_loader import resolve_model_dir; print(resolve_model_dir('smollm2'))")
mkdir -p "$root/gguf"
# the converter tries sentencepiece before the tokenizer.json route, and fails if the module is missing
$python -c "import sentencepiece" 2>/dev/null || $python -m pip install -q sentencepiece
for type in f16 bf16 q8_0; do
  out="$root/gguf/smollm2-$type.gguf"
  [[ -f $out ]] || $python "$src/vendor/llama.cpp/convert_hf_to_gguf.py" "$model_dir" --outtype "$type" --outfile "$out"
done
[[ -f $root/gguf/smollm2-q4_0.gguf ]] || "$prefix/bin/llama-quantize" "$root/gguf/smollm2-f16.gguf" \
  "$root/gguf/smollm2-q4_0.gguf" Q4_0 >/dev/null
echo "$prefix/bin/llama-server"
