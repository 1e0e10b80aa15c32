# kuberl — `make test` is what CI runs (through .ci/run); `make demo` runs the main job.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
EXTRAS ?= operator,trainer,rollout,dev

.PHONY: test tier-reset lint unit contract integration e2e cluster-up cluster-down crd goldens \
	demo coverage clean
# Each tier's wall time (.ci/tier): `make test` prints them against their budgets at the end.
TIER := $(PYTHON) .ci/tier

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install whenever pyproject.toml changes (the stamp carries its hash).
$(STAMP): pyproject.toml | $(BIN)/python
	@$(TIER) start install
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@
	@$(TIER) end install

test: tier-reset lint unit contract integration e2e
	@$(TIER) report

tier-reset:
	@$(TIER) reset

lint: $(STAMP)
	@$(TIER) start lint
	$(BIN)/ruff check .
	$(BIN)/mypy operator trainer_image rollout_image wire env_image
	$(BIN)/mypy --strict e2e
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile.trainer Dockerfile.rollout Dockerfile.operator Dockerfile.environment
	@$(TIER) end lint

# Test processes per tier (pytest-xdist): the tiers' tests are independent, and a local run
# waits on its engines and workers as much as it computes, so two share two cores well.
TEST_WORKERS ?= 2

unit: $(STAMP)
	@$(TIER) start unit
	$(BIN)/pytest -q -n $(TEST_WORKERS) -m "not integration and not e2e" tests
	@$(TIER) end unit

# The SGLang contract (tests/sglang_contract/): the launcher's command lines and the trainer's
# request bodies checked against the pinned SGLang's own parser and request types. Its wheel
# (no dependencies, plus the few its parser and io_struct import: requirements.txt there) is
# installed once per version and requirements under the user cache dir, beside the venv.
SGLANG_VERSION := 0.5.6
SGLANG_REQS := tests/sglang_contract/requirements.txt
SGLANG_DIR := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kuberl/sglang-$(SGLANG_VERSION)-$(shell sha1sum $(SGLANG_REQS) | cut -c1-12)

$(SGLANG_DIR)/.installed: $(SGLANG_REQS) | $(STAMP)
	grep -qx 'sglang==$(SGLANG_VERSION)' $(SGLANG_REQS)
	rm -rf $(SGLANG_DIR)
	$(BIN)/pip install --quiet --no-deps --target $(SGLANG_DIR) -r $(SGLANG_REQS)
	touch $@

contract: $(STAMP) $(SGLANG_DIR)/.installed
	@$(TIER) start contract
	KUBERL_SGLANG_PATH=$(SGLANG_DIR) $(BIN)/pytest -q tests/sglang_contract
	@$(TIER) end contract

integration: $(STAMP)
	@$(TIER) start integration
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal -m integration --durations=15 tests
	@$(TIER) end integration

# Line coverage of operator/, trainer_image/, rollout_image/ and wire/ by the unit and
# integration tiers, every process they start included ([tool.coverage] in pyproject.toml):
# the per-file table in out/coverage/report.txt, then each package's total. Not in `make test`.
coverage: $(STAMP)
	rm -rf out/coverage && mkdir -p out/coverage
	$(BIN)/pytest -q -n $(TEST_WORKERS) -m "not e2e" --cov --cov-report= tests
	@# pytest-cov has combined what its session saw; processes that saved later (Ray's own
	@# daemons at shutdown) are appended to it, never in its place ("No data to combine": none).
	-$(BIN)/coverage combine --append -q
	$(BIN)/coverage report > out/coverage/report.txt
	@for p in operator trainer_image rollout_image wire; do \
	  printf '%-15s' $$p; $(BIN)/coverage report --include="$$p/*" | grep TOTAL; done

# A real local control plane (e2e/README.md): binaries built once per version and cached under
# ~/.cache/kuberl/e2e (cold: ~20 min on 2 cores), then a no-op; the tests start their own.
# The whole tier runs on the oldest supported KubeRay (e2e/versions.env); on the newest, the
# tests where KubeRay acts on what kuberl renders (marker `kuberay`): the rest (the CRD's
# validation, the chart, the make targets) never meets KubeRay's operator. The two runs go side
# by side, each with a control plane of its own (free ports, own state): most of their time is
# waiting on the controllers' clocks (KubeRay failing a job, a heartbeat timing out), so
# together they take little more than the longer one. Their output: out/e2e/, shown at the end.
e2e: $(STAMP)
	@$(TIER) start e2e-build
	$(BIN)/python e2e/cluster.py build
	KUBERL_E2E_KUBERAY=newest $(BIN)/python e2e/cluster.py build kuberay
	@$(TIER) end e2e-build
	@$(TIER) start e2e
	@mkdir -p out/e2e && rm -f out/e2e/*.rc && echo "e2e: oldest and newest KubeRay side by side (out/e2e/)"
	@( $(BIN)/pytest -q -m e2e --durations=10 e2e > out/e2e/oldest.log 2>&1; \
	   echo $$? > out/e2e/oldest.rc ) & \
	 ( KUBERL_E2E_KUBERAY=newest $(BIN)/pytest -q -m "e2e and kuberay" --durations=10 e2e \
	     > out/e2e/newest.log 2>&1; echo $$? > out/e2e/newest.rc ) & \
	 wait; \
	 for v in oldest newest; do echo "== e2e on the $$v supported KubeRay"; cat out/e2e/$$v.log; done; \
	 test "$$(cat out/e2e/oldest.rc)" = 0 && test "$$(cat out/e2e/newest.rc)" = 0
	@$(TIER) end e2e

# The same control plane for manual use: prints the KUBECONFIG (and PATH) lines to export.
# STATE_DIR: where it keeps its state (default ~/.cache/kuberl/e2e/run).
STATE_DIR ?=
STATE_ARG := $(if $(STATE_DIR),--state-dir $(STATE_DIR))
cluster-up: $(STAMP)
	$(BIN)/python e2e/cluster.py build
	$(BIN)/python e2e/cluster.py up --crds crds $(STATE_ARG)
cluster-down: $(STAMP)
	$(BIN)/python e2e/cluster.py down $(STATE_ARG)

# Regenerate crds/ (the CRD and the policy with the RLJob's rules) and the chart's copies from
# the model (unit tests fail when they drift).
crd: $(STAMP)
	$(BIN)/kuberl crd --output crds/rljob.yaml
	$(BIN)/kuberl crd --policy --output crds/rljob-policy.yaml
	cp crds/rljob.yaml helm/kuberl/crds/rljob.yaml
	cp crds/rljob-policy.yaml helm/kuberl/policy/rljob-policy.yaml

# Regenerate the renderer golden files from examples/.
goldens: $(STAMP)
	$(BIN)/pytest -q tests/unit/test_render_golden.py --update-goldens

# The main job: build the tiny model and data (seeded, cached in out/tiny), then GRPO on CPU.
# (DEMO_TINY, DEMO_JOB, DEMO_OUT: another build folder, manifest and output folder; the
# integration tier runs the target with a two-step copy of the manifest.)
DEMO_TINY ?= out/tiny
DEMO_JOB ?= examples/tiny-grpo.yaml
DEMO_OUT ?= out/tiny-grpo
demo: $(STAMP)
	$(BIN)/python -m kuberl_trainer.tiny build --out $(DEMO_TINY)
	rm -rf $(DEMO_OUT)  # a fresh run each time (a kept checkpoint would resume, at the end)
	$(BIN)/kuberl run $(DEMO_JOB) --output-dir $(DEMO_OUT)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
