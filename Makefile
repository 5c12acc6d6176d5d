VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: test test-all check venv clean models demo

# The venv is (re)built only when pyproject.toml changes; torch first. Where pip would otherwise
# fetch the multi-GB CUDA build, name the CPU wheel index: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# Two workers (pytest-xdist), a test file each at a time, longest first, one torch thread each (tests/conftest.py).
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
test: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(XDIST)

# Everything, the tests marked slow included (the rest of each exhaustive sweep): before a release.
test-all: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(XDIST) -m ''

# The package's types (mypy, [tool.mypy] of pyproject.toml): half a minute from a cold cache, a second warm.
# CI runs it after `make test`; tests/test_types.py (slow) runs the same check under `make test-all`.
check: venv
	$(PY) -m mypy

# The main job on the embedded models: ReFusion (the paper's decoder and the toolkit's variants), AR and LLaDA
# decoding of the synthetic task, side by side.
demo: venv
	HF_HUB_OFFLINE=1 $(VENV)/bin/refusion eval --task synthetic --decoder refusion ar llada --causal-fix --causal-first --recheck --limit 20 --output results/demo

# Rebuild the embedded tiny models with the recipe they were built with: the three fine-tunes side
# by side on one GPU (about 7 minutes of fine-tuning each on an H200); see results/models/README.md.
# On CPUs only, run them one after the other: make models MODELS_ARGS="--threads 2" (about a day and a half on 2 cores: the CPU-only fine-tunes logged a median 1.0 s per 32-example step, so about 8 s per 256-example step, times 3 x 4,800 steps).
MODELS_ARGS ?= --parallel --threads 2 --num-workers 4 --mixed-precision bf16
models: venv
	$(PY) -m tools.build_models $(MODELS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
