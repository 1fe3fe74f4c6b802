# hybridllm developer entry points. `make demo` and `make test` do every set-up step themselves.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTEST_ARGS ?=
# PYTEST_WORKERS=2 runs two pytest-xdist workers: the control-plane tests as one unit
# beside the model-bound modules (tests/conftest.py groups them). Measured 18.2 min on
# 2026-11-29 against 28.6 in one process, all passed; but memory peaked at 20.7 of the
# machine's 23 GiB, so one process stays the default until the workers keep less
# (docs/testing.md).
PYTEST_WORKERS ?= 0

.PHONY: help setup setup-python up down demo test lint crds bench-index cluster-up cluster-down testenv dashboard-screenshot

help:
	@echo "make up            run the example LLMService on this machine and ask it a question per tier"
	@echo "make down          stop it"
	@echo "make demo          the Kubernetes walkthrough: a real node runs the example LLMService, which answers (root)"
	@echo "make test          set up everything, lint, check CRD drift, run all tests"
	@echo "make lint          ruff, mypy, the CRD drift check, the chart values table and the benchmark index"
	@echo "make crds          regenerate crds/ from the models"
	@echo "make bench-index   regenerate bench/README.md's index and README.md's Performance table from bench/results/"
	@echo "make dashboard-screenshot  docs/images/dashboard.png: the built-in page of a local service under load"
	@echo "make cluster-up    start the local control plane (.testenv/kubeconfig)"
	@echo "make cluster-down  stop it (and the demo operator)"

setup:
	@hack/phase.sh setup hack/setup.sh

setup-python:
	@HYBRIDLLM_SKIP_TESTENV=1 hack/phase.sh setup hack/setup.sh

up: setup-python
	@hack/up.sh

down:
	@uv run --no-sync hybridllm down

testenv:
	@hack/testenv/build.sh

demo: setup
	@hack/demo.sh

lint:
	@hack/phase.sh lint bash -c 'uv run --no-sync ruff check . && uv run --no-sync ruff format --check . && uv run --no-sync mypy && uv run --no-sync hybridllm crds generate --check && uv run --no-sync hybridllm chart docs --check && uv run --no-sync hybridllm observability generate --check && uv run --no-sync python bench/index.py --check && uv run --no-sync hack/chart-score.sh'

test: setup lint
	@hack/phase.sh pytest uv run --no-sync pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

crds:
	uv run --no-sync hybridllm crds generate

bench-index:
	uv run --no-sync python bench/index.py

dashboard-screenshot: setup
	HYBRIDLLM_DASHBOARD_SCREENSHOT=$(CURDIR)/docs/images/dashboard.png uv run --no-sync pytest -q \
	  "tests/hybridllm_operator/test_local_e2e.py::test_the_local_autoscaler_starts_a_replica_under_load_and_retires_it_when_idle"

cluster-up: setup
	@uv run --no-sync python hack/testenv/cluster.py up

cluster-down:
	@python3 hack/testenv/cluster.py down
