# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install requirements.txt (pinned, CPU torch) the first time.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1

.PHONY: setup demo test test-fast lint format bench-peer-env

$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

setup: $(VENV)/.installed

demo: setup  ## the whole pipeline on the embedded demo, on a CPU
	PATH="$(abspath $(VENV))/bin:$$PATH" bash pipeline.sh

test: setup  ## every test, slow ones included (what CI runs)
	$(PY) -m pytest -n 2 --dist loadfile

test-fast: setup  ## skip the end-to-end script runs
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow"

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# The peer for bench/ppo_vs_trl011.py: TRL 0.11.4 in a virtual environment of its own (transformers 4.x).
PEER_VENV ?= .venv-trl011
$(PEER_VENV)/.installed: bench/trl011/requirements.txt
	python3 -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEER_VENV)/bin/python -m pip install --quiet -r bench/trl011/requirements.txt
	touch $@

bench-peer-env: $(PEER_VENV)/.installed  ## TRL 0.11.4 for bench/ppo_vs_trl011.py
