#!/usr/bin/env bash
# Getting started (docs/index.md): train a small CNN on the embedded digits data, fit a posterior,
# predict, top-k and conformal sets. Run by tests/test_docs.py.
# --8<-- [start:train]
bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
# --8<-- [end:train]
# --8<-- [start:fit]
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --hessian kron --out posterior.safetensors
# --8<-- [end:fit]
# --8<-- [start:predict]
bayescli predict --posterior posterior.safetensors --data digits:test --link probit --out pred.json
bayescli predict --posterior posterior.safetensors --data digits:test --bridge --out dirichlet.safetensors
bayescli topk --posterior posterior.safetensors --data digits:test --threshold 0.05 --max-k 10 --out topk.json
bayescli conformal --posterior posterior.safetensors --data digits:test --calibration-data digits:val \
    --alpha 0.1 --out conformal.json
# --8<-- [end:predict]
