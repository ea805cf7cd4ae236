# SJA — two commands: `make demo` and `make test`. Everything installs into .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck up bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)  ## start the stack, run the demo jobs, write out/demo/summary.json and timeline.png
	$(BIN)/sja demo --out out/demo

test: $(STAMP)  ## the whole suite (unit, integration against a real nats-server, end-to-end)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)  ## everything but the slow end-to-end tests
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check libs services tests bench
	$(BIN)/ruff format --check libs services tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

up: $(STAMP)  ## the stack in the foreground (Ctrl-C stops it)
	$(BIN)/sja up

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache
