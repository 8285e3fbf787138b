#!/usr/bin/env bash
# The quickstart of README.md and docs/index.md: a trained checkpoint through inspect, fit-laplace,
# evaluate with a CI gate, and report. Run by tests/test_docs.py; output recorded by
# scripts/docs_snippets.py.
# Set-up, not shown: a checkpoint written by `bayescli train` stands for yours.
test -f model.safetensors || bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
# --8<-- [start:quickstart]
bayescli inspect --model builtin:small-cnn --checkpoint model.safetensors --data digits:val
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --val-data digits:val --out posterior.safetensors
bayescli evaluate --posterior posterior.safetensors --data digits:test --ood patches \
    --out report.json --fail-if "ood.patches.glm-probit.max_prob.auroc < 0.90"
bayescli report report.json --out report.html --png-dir figures
# --8<-- [end:quickstart]
