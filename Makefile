# SJA — two commands: `make demo` and `make test`. Everything installs into .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CORE   := build/.core-attempted
CORE_SRC := $(wildcard libs/sja/core/*.py libs/sja/core/*/*.py) libs/sja/accel.py

.PHONY: demo test test-fast core lint typecheck up bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

# The decision core compiled with mypyc (sja.accel): about twice as fast, the same decisions. Without
# a C compiler it is skipped and the pure Python core runs; an edited core is used as Python until
# this runs again (every target below runs it first).
$(CORE): $(STAMP) $(CORE_SRC)
	$(BIN)/python -m sja.accel build --if-possible
	@mkdir -p build && touch $@

core: $(CORE)  ## compile the decision core (make demo and make test do it first)

demo: $(STAMP) $(CORE)  ## start the stack, run the demo jobs, write out/demo/summary.json and timeline.png
	$(BIN)/sja demo --out out/demo

test: $(STAMP) $(CORE)  ## the whole suite (unit, integration against a real nats-server, end-to-end)
	$(BIN)/python -m pytest -q --durations=15

test-fast: $(STAMP) $(CORE)  ## everything but the slow end-to-end tests
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check libs services tests bench
	$(BIN)/ruff format --check libs services tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

up: $(STAMP) $(CORE)  ## the stack in the foreground (Ctrl-C stops it)
	$(BIN)/sja up

clean:
	rm -rf out build .pytest_cache .mypy_cache .ruff_cache
