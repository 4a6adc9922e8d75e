#!/usr/bin/env bash
# Prepare what `make gpu-check` needs on a GPU machine with no network (torch and transformers installed
# there; DeepSpeed, datasets and pydantic not): wheels for CPython 3.12 / manylinux x86-64, and the default
# target's tokenizer files, into the ignored folder .whl/ (at most 64 MiB: it travels with the tree).
#   bash benchmarks/gpu_wheels.sh            # run here, where pip reaches PyPI
# On the GPU machine (docs/GPU.md, "GPU check"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
rm -f "$OUT"/*.whl

# What the lent machine's image already holds (its device notes, KINDS.md, read 2026-11-17), of what gpu-check
# and the wheels below import: not carried. benchmarks/gpu_wheels.py reads these arrays; tests/test_gpu_check.py
# checks that every requirement of a carried wheel and of the project is carried or here.
ON_IMAGE=(
  torch transformers tokenizers safetensors peft huggingface-hub numpy pandas pyarrow xxhash tqdm pyyaml psutil
  py-cpuinfo einops msgpack ninja packaging filelock aiohttp requests jinja2 matplotlib scipy tensorboard
)

# Binary wheels, versions as in this venv (requirements.txt's pins, or what the pinned packages require).
BINARY=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5   # the recipe schema
  typing-extensions==4.16.0   # pydantic needs >=4.16.0; the image's version is unread
  datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.7.0                      # prepare's splits
  hjson==3.1.0                                                                             # DeepSpeed's config
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${BINARY[@]}"

# DeepSpeed ships an sdist only; without DS_BUILD_OPS its ops are built by JIT at first use, so the wheel
# is pure Python (py3-none-any). No build isolation: its setup.py imports torch, which the venv has.
DEEPSPEED=(deepspeed==0.19.8)
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "${DEEPSPEED[@]}"

# The real tokenizer (SmolLM2's): the tiny targets of the check are built around it.
TOK=$(ls -d .cache/targets/SmolLM2-135M-Instruct*/ | head -1)
mkdir -p "$OUT/smollm2-tokenizer"
cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$TOK"/chat_template.jinja "$OUT/smollm2-tokenizer/" 2>/dev/null \
  || cp "$TOK"/tokenizer* "$OUT/smollm2-tokenizer/"

ls -l "$OUT" "$OUT/smollm2-tokenizer"
# one wheel per pin at its version, installable by CPython 3.12 on x86-64, the tokenizer, <= 64 MiB in all
"$PY" -m benchmarks.gpu_wheels "$OUT"
