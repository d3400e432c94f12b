# One task runner. Every target sets up what is missing first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint typecheck bench soak clean

setup:
	@scripts/setup.sh

demo: setup
	$(VENV)/bin/proctor demo

# Two processes: the tests marked host (sandboxes, mounts, namespaces, cgroups) one
# at a time in one, every other test beside them in the other (tests/host_group.py).
test: setup lint typecheck
	scripts/test.sh $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests bench fuzz
	$(VENV)/bin/ruff format --check src tests bench fuzz

typecheck: setup
	$(VENV)/bin/mypy

# Figures for the README. Each script compares side by side in one run.
bench: setup
	$(PY) bench/ledger.py
	$(PY) bench/ledger_pg.py
	$(PY) bench/sandbox.py
	$(PY) bench/policy.py
	$(PY) bench/broker_sql.py
	$(PY) bench/broker_proxy.py
	$(PY) bench/telemetry.py
	$(PY) bench/transparent.py
	$(PY) bench/peers.py
	$(PY) bench/evidence.py
	$(PY) bench/api.py
	$(PY) bench/fair.py

# The adversarial suite at full size: faults, the 32-run load, fuzzing, escapes.
# `make test` runs the same tests at bounded sizes.
soak: setup
	PROCTOR_SOAK=1 $(PY) -m pytest tests/faults tests/fuzz tests/security -p no:cacheprovider $(PYTEST_ARGS)
	$(PY) bench/soak.py
	@scripts/fuzz.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
