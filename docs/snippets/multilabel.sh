#!/usr/bin/env bash
# Multi-label classifiers (docs/multilabel.md): composed digits, a sigmoid per class.
# Run by tests/test_docs.py.
# --8<-- [start:multilabel]
bayescli train --likelihood bernoulli --model builtin:mlp --data composed-digits:train --out multi.safetensors --quiet
bayescli fit-laplace --model builtin:mlp --checkpoint multi.safetensors --data composed-digits:train \
    --out multi-laplace.safetensors --quiet
bayescli predict --posterior multi-laplace.safetensors --data composed-digits:test --link beta \
    --out multi-pred.json --quiet
bayescli evaluate --posterior multi-laplace.safetensors --data composed-digits:test --ood noise:uniform \
    --out multi-report.json --quiet --fail-if "in_distribution.glm-probit.per_label.nll.3 > 0.5"
# --8<-- [end:multilabel]
# --8<-- [start:refused]
bayescli evaluate --posterior multi-laplace.safetensors --data composed-digits:test --methods temp  # exit 2
# --8<-- [end:refused]
