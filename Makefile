VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: test venv clean models demo

# The venv is (re)built only when pyproject.toml changes; torch first, from the CPU wheel.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

test: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

# The main job on the embedded models: ReFusion, AR and LLaDA decoding of the synthetic task, side by side.
demo: venv
	HF_HUB_OFFLINE=1 $(VENV)/bin/refusion eval --task synthetic --decoder refusion ar llada --limit 20 --output results/demo

# Rebuild the embedded tiny models (about 2 hours on 2 CPU cores); see results/models/README.md.
models: venv
	$(PY) -m refusion_cli.models.build --threads 2

clean:
	rm -rf $(VENV) .pytest_cache
