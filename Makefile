# The two commands of README's quick start, and the pieces they are made of.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
INSTALLED := $(VENV)/.installed

.PHONY: demo test test-fast test-stress lint docs docs-serve docs-generate wheel system-deps venv clean

demo: system-deps $(INSTALLED)  ## set up everything, start Redis and a worker, stream one chat
	$(VENV)/bin/python scripts/demo.py

# Two processes, each taking whole files (their module fixtures stay shared): most of the
# suite's time is engine start-ups, whose imports keep one core busy at a time.
TEST_PROCESSES ?= 2

test: system-deps $(INSTALLED) lint  ## the whole suite against real Redis, arq and vLLM
	$(VENV)/bin/python -m pytest -n $(TEST_PROCESSES) --dist loadfile

# The tests that start no vLLM engine (nor build wheels or bundles; those are marked engine
# too): about a minute and a half on a 2-core machine. Real Redis, arq, the CLI, settings.
test-fast: system-deps $(INSTALLED) lint  ## everything but the engine tests, in under two minutes
	$(VENV)/bin/python -m pytest -n $(TEST_PROCESSES) --dist loadfile -m "not engine"

# Flakes found before CI finds them: the tests that kill, freeze, restart or race something,
# STRESS_COUNT times each, beside STRESS_CPU busy-loop processes that take the cores the
# engines and the tests themselves want. A test that passes here does not hope for a fast or a
# slow machine (docs/development.md, "Tests that race nothing").
STRESS_FILES ?= tests/test_adapters.py tests/test_responses_faults.py tests/test_batches.py \
	tests/test_leases.py tests/test_chat_e2e.py tests/test_liveness.py tests/chaos/test_guarantees.py
STRESS_COUNT ?= 2
STRESS_CPU ?= 2

test-stress: system-deps $(INSTALLED)  ## chosen engine tests, repeated, on a loaded machine
	$(VENV)/bin/python -m pytest -n $(TEST_PROCESSES) --dist loadfile \
		--stress-cpu $(STRESS_CPU) --count $(STRESS_COUNT) $(STRESS_FILES)

# The docs site into site/. --strict: a broken link or anchor, or a page left out of the nav,
# fails it. `make test` builds it too (tests/test_docs_blocks.py), and runs every example.
docs: $(INSTALLED)  ## build the docs site (mkdocs.yml, docs/) into site/
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The same site, served from docs/ and rebuilt on every save. Not on 8000: that is the
# gateway's default port, so a box under test and its docs can run side by side.
DOCS_ADDR ?= 127.0.0.1:8001
docs-serve: $(INSTALLED)  ## serve the docs site on http://$(DOCS_ADDR)/ while you edit
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict --dev-addr $(DOCS_ADDR)

# The references generated from the code: settings, command line, JSON Schemas (also shipped
# in the package). A test fails while a committed one differs from what this makes.
docs-generate: $(INSTALLED)  ## rewrite docs/reference/ and src/edgeq/core/schemas/ from the code
	$(VENV)/bin/python -m edgeq.testing.docs

# The client wheel (edgeq without extras: no torch, no vLLM) for services to install, built
# from a clean copy of the checkout with PYTHON's pip. Needs no virtualenv: a service's
# machine can build it from a fresh clone (docs/python-client.md, "Install").
DIST ?= dist
wheel:  ## build the edgeq wheel into dist/ (pip install dist/edgeq-*.whl, extras [gateway])
	$(PYTHON) deploy/wheel.py $(DIST)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .

system-deps:  ## Debian packages: redis-server, systemd (for systemd-analyze; not started)
	scripts/install-system-deps.sh

venv: $(INSTALLED)

$(INSTALLED): pyproject.toml scripts/setup-venv.sh
	VENV=$(VENV) PYTHON=$(PYTHON) scripts/setup-venv.sh
	touch $@

clean:
	rm -rf $(VENV) .demo .pytest_cache .ruff_cache edgeq.egg-info site build $(DIST)
