# Two entry points that do all the set-up on a fresh machine:
#   make demo   -> install into .venv, then run the main job on the built-in target
#   make test   -> install into .venv, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,train,bench,hf]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spot-dlm demo --methods standard,spot

test: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/spot-dlm bench --n-prompts 50 --json runs/bench.json --plots runs/plots
