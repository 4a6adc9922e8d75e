#!/usr/bin/env bash
# Prepare what `make gpu-check` needs on a GPU machine with no network (torch and transformers installed
# there; DeepSpeed, datasets and pydantic not): wheels for CPython 3.12 / manylinux x86-64, and the default
# target's tokenizer files, into the ignored folder .whl/ (at most 64 MiB: it travels with the tree).
#   bash benchmarks/gpu_wheels.sh            # run here, where pip reaches PyPI
# On the GPU machine (README, "GPU check"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
rm -f "$OUT"/*.whl

# Binary wheels, versions pinned as in requirements.txt (or what the pinned packages require).
# Already on the GPU machine's image (KINDS.md): numpy, pandas, pyarrow, xxhash, huggingface-hub, tqdm,
# pyyaml, psutil, py-cpuinfo, einops, msgpack, ninja, packaging, typing-extensions, safetensors, peft, aiohttp.
BINARY=(
  pydantic==2.14.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5   # the recipe schema
  datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.7.0                      # prepare's splits
  hjson==3.1.0                                                                             # DeepSpeed's config
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${BINARY[@]}"

# DeepSpeed ships an sdist only; without DS_BUILD_OPS its ops are built by JIT at first use, so the wheel
# is pure Python (py3-none-any). No build isolation: its setup.py imports torch, which the venv has.
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" deepspeed==0.19.8

# The real tokenizer (SmolLM2's): the tiny targets of the check are built around it.
TOK=$(ls -d .cache/targets/SmolLM2-135M-Instruct*/ | head -1)
mkdir -p "$OUT/smollm2-tokenizer"
cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$TOK"/chat_template.jinja "$OUT/smollm2-tokenizer/" 2>/dev/null \
  || cp "$TOK"/tokenizer* "$OUT/smollm2-tokenizer/"

ls -l "$OUT" "$OUT/smollm2-tokenizer"
du -sh "$OUT"
SIZE=$(du -sm "$OUT" | cut -f1)
[ "$SIZE" -le 64 ] || { echo "$OUT is ${SIZE} MiB, over the 64 MiB a device call carries" >&2; exit 1; }
