#!/usr/bin/env bash
# Prepares, on a development machine, what the device check (benchmarks/gpu_check.sh) carries to the GPU machine:
#   .whl/          the Python packages its image lacks (pydantic, xgrammar, ...), as wheels for its Python 3.12,
#                  at the versions in constraints.txt
#   .gpu_assets/   SmolLM2's config and tokenizer (its weights, 98 MB even quantized, stay here: the benchmark
#                  makes random ones of the same shape there), and the commit the report names
# Then, through the device tool: command `bash benchmarks/gpu_check.sh`, carry [".whl", ".gpu_assets"].
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl .gpu_assets && mkdir -p .whl .gpu_assets/smollm2
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions xgrammar apache-tvm-ffi \
            jsonschema jsonschema-specifications referencing rpds-py gguf \
            pytest-asyncio; do
  pin=$(grep -iE "^${name//[-_]/[-_]}==" constraints.txt)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pin" 2>&1 | grep -v "Location '" || true
done
model=$(.venv/bin/python -c "from kvloom.engine.model.model_files import resolve_model_dir; print(resolve_model_dir('smollm2'))")
cp "$model"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} \
  .gpu_assets/smollm2/
# the commit the check's report names (the device's copy of the tree may carry older git metadata)
echo "$(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- . ':!.whl' ':!.gpu_assets' || echo -dirty)" \
  > .gpu_assets/commit
du -sh .whl .gpu_assets
