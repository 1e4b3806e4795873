# sglang-fleet: one-command set-up, tests and demo. Run as root on Debian 12.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        ?= .venv
PYTHON      ?= python3
BIN         := $(abspath $(VENV))/bin
CACHE       ?= $(HOME)/.cache/sglang-fleet
export SGLANG_FLEET_CACHE := $(CACHE)
export CONTAINERS_CONF := $(abspath tools/testhost/containers.conf)
# Molecule, ansible-lint and the tests find ansible-* and python on PATH.
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(abspath ansible.cfg)

# The longest first: make molecule runs MOLECULE_JOBS of them at once (tools/molecule.sh). Three
# on the machine's two cores: the scenarios partly wait, so a third one fills what two leave idle.
SCENARIOS   ?= gitops retune pod generation fleet advisor server monitoring server_lxc default
MOLECULE_JOBS ?= 3
PYTEST_ARGS ?=

.PHONY: help setup apt venv collections image lint unit molecule test demo demo-hand demo-clean clean bench

help:
	@echo "make demo        set up, start a demo fleet of simulated GPU hosts, deploy, retune"
	@echo "make test        set up, then lint, unit tests and every Molecule scenario"
	@echo "make setup       apt packages, virtualenv, collections, test-host image"
	@echo "make lint | unit | molecule [SCENARIOS='default ...']"
	@echo "make demo-hand   the same fleet, retuned to the run's hand tuning instead of the advisor's patch"
	@echo "make demo-clean  remove the demo fleet"

setup: apt venv collections image

apt:
	@tools/setup/apt-packages.sh

# The test controller's caches: the compiled code of the modules its localhost tasks run, and the
# imports Ansible finds in each module_utils source (each file's docstring says why).
CONTROLLER_CACHES := tests/testbed/pyc_cache/sglang_fleet_testbed_pyc.py tests/testbed/ansiballz_cache/sglang_fleet_testbed_imports.py

$(VENV)/.installed: requirements/dev.txt requirements/constraints.txt client/pyproject.toml tests/doubles/gpusim/pyproject.toml ops/pyproject.toml $(CONTROLLER_CACHES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip==26.3 setuptools==84.2.1 wheel==0.48.0
	@$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements/dev.txt -c requirements/constraints.txt
	@$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e client -e tests/doubles/gpusim -e ops
	@site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	  && for f in $(CONTROLLER_CACHES); do \
	       m=$$(basename "$$f" .py); install -m 0644 "$$f" "$$site/" && echo "import $$m" > "$$site/$$m.pth"; done
	@touch $@
	@echo "virtualenv ready: $(VENV)"

venv: $(VENV)/.installed

collections: venv
	@tools/setup/collections.sh $(BIN)/python .cache/collections

image: apt venv
	@tools/testhost/build-image.sh $(BIN)/python

lint: venv collections
	@$(BIN)/ruff check .
	@$(BIN)/ruff format --check --quiet . || { echo "ruff format: files need formatting (run: $(BIN)/ruff format .)"; exit 1; }
	@$(BIN)/ansible-lint --profile production --offline -q
	@BIN=$(BIN) tools/lint_pipelines.sh
	@MYPYPATH=collections $(BIN)/mypy --config-file mypy.ini --no-error-summary -p ansible_collections.sglang_ops.fleet.plugins
	@$(BIN)/mypy --config-file client/pyproject.toml --no-error-summary client/src
	@$(BIN)/mypy --config-file ops/pyproject.toml --no-error-summary ops/src
	@tools/collection_checks.sh

unit: venv collections
	@PYTEST=$(BIN)/pytest tools/unit.sh $(PYTEST_ARGS)

molecule: venv collections image
	@MOLECULE=$(BIN)/molecule tools/molecule.sh $(MOLECULE_JOBS) $(SCENARIOS)

test:
	@tools/stages.sh setup lint+unit molecule

DEMO := $(abspath .cache/demo)

demo: setup
	@$(BIN)/ansible-playbook playbooks/demo.yml
	@date +%s > $(DEMO)/began
	@echo; echo "=== sglang-fleet-ops advise --measure --trial   (what limits the servers while the job runs; the advisor's own patch tried on one canary)"
	@$(BIN)/sglang-fleet-ops advise --window 15 --interval 0.5 --measure --trial --settle 15 --out $(DEMO)/sglang-fleet-advice.yml
	@$(BIN)/python tools/demo_advice.py extravars $(DEMO)/sglang-fleet-advice.yml $(DEMO)/advised.yml
	@echo; echo "=== ansible-playbook retune.yml -e @.cache/demo/advised.yml   (the advisor's patch, to the whole fleet while the job generates)"
	@$(BIN)/ansible-playbook retune.yml -e @$(DEMO)/advised.yml
	@echo; echo "=== ansible-playbook retune.yml -e @.cache/demo/advised.yml   (again: nothing to change)"
	@$(BIN)/ansible-playbook retune.yml -e @$(DEMO)/advised.yml
	@echo; echo "=== sglang-fleet-ops advise   (the fleet after the advisor's patch)"
	@$(BIN)/sglang-fleet-ops advise --window 15 --interval 0.5 --out $(DEMO)/sglang-fleet-advice-after.yml
	@echo; echo "=== predicted and measured throughput, side by side"
	@$(BIN)/python tools/demo_advice.py compare .sglang-fleet-ops/runs $$(cat $(DEMO)/began) $(DEMO)/advised.yml
	@echo; echo "=== the generation job ran through every retune: its completions so far, each exactly once"
	@$(BIN)/ansible-playbook playbooks/demo_verify.yml

demo-hand: setup
	@$(BIN)/ansible-playbook playbooks/demo.yml
	@echo; echo "=== sglang-fleet-ops advise   (what limits the servers while the job runs, and the change to make)"
	@$(BIN)/sglang-fleet-ops advise --window 15 --interval 1 --out $(DEMO)/sglang-fleet-advice.yml
	@echo; echo "=== ansible-playbook retune.yml -e @inventories/demo/hand_tuning.yml   (the run's own tuning: Mamba cache 80 -> 200 slots, memory fraction 0.93, ...)"
	@$(BIN)/ansible-playbook retune.yml -e @inventories/demo/hand_tuning.yml
	@echo; echo "=== ansible-playbook retune.yml -e @inventories/demo/hand_tuning.yml   (again: nothing to change)"
	@$(BIN)/ansible-playbook retune.yml -e @inventories/demo/hand_tuning.yml
	@echo; echo "=== the generation job ran through both: its completions so far, each exactly once"
	@$(BIN)/ansible-playbook playbooks/demo_verify.yml

demo-clean:
	@$(BIN)/ansible-playbook playbooks/demo_clean.yml

clean: demo-clean
	rm -rf $(VENV) .cache

bench: setup
	@$(BIN)/python bench/retune/bench_retune.py
	@$(BIN)/python bench/client/bench_client.py
	@$(BIN)/python bench/retune_capacity/bench_retune_capacity.py
