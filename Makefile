# Developer entry points. `make test` is what CI runs (.ci/run) and what the README tells you.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.maru-installed

.PHONY: install test test-fast lint format check bench dist-check clean

install: $(STAMP)

# A venv with Maru (editable), the dev tools, and the real SGLang and LMCache for CPU-only
# test runs (LMCache last: its check imports the shipped MaruBackend, which imports
# maru_lmcache); vLLM goes to build/vllm-site, outside the venv (requirements/vllm-nodeps.txt);
# Mooncake Store's CPU wheel for the cluster tier, its three libraries in <venv>/mooncake-libs.
$(STAMP): pyproject.toml requirements/constraints.txt requirements/sglang-cpu.txt requirements/sglang-nodeps.txt scripts/install_sglang_cpu.sh scripts/install_torch_cpu.sh requirements/lmcache-nodeps.txt scripts/install_lmcache_cpu.sh requirements/vllm-nodeps.txt scripts/install_vllm_cpu.sh requirements/mooncake-cpu.txt scripts/install_mooncake_cpu.sh
	test -x $(PY) || python3 -m venv $(VENV)
	PYTHON=$(PY) bash scripts/install_sglang_cpu.sh
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e '.[dev]'
	PYTHON=$(PY) bash scripts/install_lmcache_cpu.sh
	PYTHON=$(PY) bash scripts/install_vllm_cpu.sh
	PYTHON=$(PY) bash scripts/install_mooncake_cpu.sh
	touch $(STAMP)

test: install
	$(PY) -m pytest

# Store tests only (no SGLang servers): quick feedback while editing src/maru.
test-fast: install
	$(PY) -m pytest tests/unit tests/integration

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# What to run before every commit.
check: lint test

# The wheel and the sdist, each installed into a fresh venv and smoke-tested (CI runs it).
dist-check:
	bash scripts/check_dist.sh

bench: install
	$(PY) benchmarks/bench_store.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
