# The two commands a user needs: `make demo` and `make test`. Both create or reuse the virtual
# environment under ~/.cache/bayescli (keyed by the dependency list) and install bayescli into it.
SHELL := /bin/bash
ENV = $(shell bash scripts/env.sh)
DEMO_DIR ?= demo-output

.PHONY: demo test lint bench env clean

env:
	@bash scripts/env.sh

demo:
	@V="$(ENV)" && test -n "$$V" && "$$V/bin/bayescli" demo --out-dir $(DEMO_DIR)

test:
	@V="$(ENV)" && test -n "$$V" && "$$V/bin/ruff" check bayescli tests benchmarks && "$$V/bin/python" -m pytest -q tests

lint:
	@V="$(ENV)" && "$$V/bin/ruff" check bayescli tests benchmarks

bench:
	@V="$(ENV)" && "$$V/bin/python" benchmarks/run.py

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
