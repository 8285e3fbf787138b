#!/usr/bin/env bash
# Segmentation (docs/segmentation.md): digit scenes, a small dense net, last-layer Laplace per pixel.
# Run by tests/test_docs.py.
# --8<-- [start:train]
bayescli train --model builtin:small-segnet --data digit-scenes:train --lr 0.01 --out seg.safetensors --quiet
bayescli inspect --model builtin:small-segnet --checkpoint seg.safetensors --data digit-scenes:test
# --8<-- [end:train]
# --8<-- [start:fit]
bayescli fit-laplace --model builtin:small-segnet --checkpoint seg.safetensors --data digit-scenes:train \
    --out seg-laplace.safetensors
# --8<-- [end:fit]
# --8<-- [start:evaluate]
bayescli evaluate --posterior seg-laplace.safetensors --data digit-scenes:test --ood digit-scenes:anomaly \
    --methods map,temp,glm-probit --out seg-report.json \
    --fail-if "in_distribution.glm-probit.pixel_accuracy < 0.8" \
    --fail-if "anomaly.digit-scenes:anomaly.glm-probit.entropy.auroc < 0.6"
# --8<-- [end:evaluate]
