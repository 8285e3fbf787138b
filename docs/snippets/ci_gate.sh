#!/usr/bin/env bash
# The script the CI job in docs/evaluation.md runs: fit a posterior of the model a pipeline just
# trained and fail the job when its uncertainty is worse than agreed. Run by tests/test_docs.py.
test -f model.safetensors || bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
# --8<-- [start:gate]
bayescli inspect --model builtin:small-cnn --checkpoint model.safetensors --data digits:val --json > inspect.json
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --val-data digits:val --out posterior.safetensors --quiet
bayescli evaluate --posterior posterior.safetensors --data digits:test --ood noise:uniform --ood patches \
    --out report.json --html report.html --quiet \
    --fail-if "in_distribution.map.accuracy < 0.95" \
    --fail-if "in_distribution.glm-probit.ece > 0.05" \
    --fail-if "ood.patches.glm-probit.max_prob.auroc < 0.90"
# --8<-- [end:gate]
