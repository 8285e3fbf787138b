#!/usr/bin/env bash
# Scale (docs/scale.md): streaming with workers, the feature cache, bf16, several processes.
# Run by tests/test_docs.py (on the CPU; torchrun with two Gloo processes).
test -f model.safetensors || bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
# --8<-- [start:cache]
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --num-workers 2 --feature-cache features --out posterior.safetensors --quiet
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --hessian diag --feature-cache features --out posterior-diag.safetensors --quiet
# --8<-- [end:cache]
# --8<-- [start:precision]
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --precision bf16 --device cpu --out posterior-bf16.safetensors --quiet
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --precision fp16 --device cpu --out posterior-fp16.safetensors  # exit 2
# --8<-- [end:precision]
# --8<-- [start:torchrun]
torchrun --nproc_per_node 2 -m bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors \
    --data digits:train --device cpu --out posterior-2proc.safetensors --quiet
torchrun --nproc_per_node 2 -m bayescli evaluate --posterior posterior-2proc.safetensors --data digits:test \
    --ood patches --device cpu --out report-2proc.json --quiet
# --8<-- [end:torchrun]
