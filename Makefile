# The two commands a user needs: `make demo` and `make test`. Both create or reuse the shared
# dependencies under ~/.cache/bayescli (keyed by the dependency list) and this clone's own .venv/,
# which runs this clone's code (scripts/env.sh). `make install` says how to put `bayescli` on PATH,
# or with PREFIX=~/.local links $(PREFIX)/bin/bayescli to this clone's command.
SHELL := /bin/bash
ENV = $(shell bash scripts/env.sh)
DEMO_DIR ?= demo-output
PREFIX ?=
prefix = $(patsubst ~/%,$(HOME)/%,$(PREFIX))

# The emulated-GPU slice `make test` also runs (BAYESCLI_EMULATE_GPU=1: the session runs as on a
# GPU machine, so `--device auto` picks the emulated CUDA): the emulation's own tests and the
# default Laplace and temperature fits through the CLI (the test_device_*.py modules of the plain
# run already put every method through every command on the emulated device). Every op of an
# emulated session goes through Python dispatch, so VI fits run 2-4x slower (the default GLM VI fit
# of tests/test_defaults.py 19 s vs 5.5 s plain, the default BBB fit 145 s vs 77 s): `make test-gpu`
# runs the whole suite so, outside CI's budget (14 min on 2 cores, 33 min when other work shares
# them; the slice ~40 s, most of it training the suite's checkpoint).
GPU_SLICE ?= tests/test_emulated_cuda.py \
  "tests/test_defaults.py::test_default_fit_with_validation_data_is_no_worse_than_map[laplace]" \
  "tests/test_defaults.py::test_default_fit_with_validation_data_is_no_worse_than_map[temperature]"

.PHONY: demo test test-gpu gpu-check lint docs docs-serve bench env install clean

env:
	@bash scripts/env.sh

demo:
	@V="$(ENV)" && test -n "$$V" && "$$V/bin/bayescli" demo --out-dir $(DEMO_DIR)

test:
	@V="$(ENV)" && test -n "$$V" && "$$V/bin/ruff" check bayescli tests benchmarks examples scripts docs/snippets \
	  && NO_MKDOCS_2_WARNING=1 "$$V/bin/python" -m mkdocs build --strict --quiet && "$$V/bin/python" -m pytest -q tests \
	  && BAYESCLI_EMULATE_GPU=1 "$$V/bin/python" -m pytest -q $(GPU_SLICE)

test-gpu:
	@V="$(ENV)" && test -n "$$V" && BAYESCLI_EMULATE_GPU=1 "$$V/bin/python" -m pytest -q tests

gpu-check:
	@V="$(ENV)" && test -n "$$V" && "$$V/bin/python" scripts/gpu_check.py

lint:
	@V="$(ENV)" && test -n "$$V" && "$$V/bin/ruff" check bayescli tests benchmarks examples scripts docs/snippets

# The docs site (mkdocs.yml) into site/, strict: what `make test` builds too. The guides' commands
# and outputs come from docs/snippets/ (scripts/docs_snippets.py), the generated pages from
# scripts/docs_gen.py; tests/test_docs.py checks both are current.
docs:
	@V="$(ENV)" && test -n "$$V" && NO_MKDOCS_2_WARNING=1 "$$V/bin/python" -m mkdocs build --strict

docs-serve:
	@V="$(ENV)" && test -n "$$V" && NO_MKDOCS_2_WARNING=1 "$$V/bin/python" -m mkdocs serve

bench:
	@V="$(ENV)" && test -n "$$V" && "$$V/bin/python" benchmarks/run.py

install:
	@V="$(ENV)" && test -n "$$V" && if [ -n "$(prefix)" ]; then \
	  mkdir -p "$(prefix)/bin" && ln -sfn "$$V/bin/bayescli" "$(prefix)/bin/bayescli" \
	  && echo "$(prefix)/bin/bayescli -> $$V/bin/bayescli (this clone's code)"; \
	else \
	  echo "bayescli is $$V/bin/bayescli (this clone's code). Put it on PATH with" \
	  && echo "  export PATH=\"$$V/bin:\$$PATH\"" \
	  && echo "or link it from a directory already on PATH: make install PREFIX=~/.local"; \
	fi

clean:
	rm -rf $(DEMO_DIR) .pytest_cache site
