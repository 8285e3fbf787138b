#!/usr/bin/env bash
# Troubleshooting (docs/troubleshooting.md): each class of error, as bayescli reports it.
# Every command here but one (a warning) fails on purpose (exit 2: bad usage or input, nothing
# written).
# Run by tests/test_docs.py.
test -f model.safetensors || bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
python -c "import numpy as np; np.savez('pixels.npz', x=np.full((4, 1, 8, 8), 200.0, dtype=np.float32), y=np.zeros(4, dtype=np.int64))"
# --8<-- [start:data]
bayescli inspect --model builtin:small-cnn --checkpoint model.safetensors --data digit:test  # exit 2
bayescli inspect --model builtin:small-cnn --checkpoint model.safetensors --data cifar10:test --data-root nowhere  # exit 2
bayescli inspect --model builtin:small-cnn --checkpoint model.safetensors --data npz:pixels.npz  # exit 2
# --8<-- [end:data]
# --8<-- [start:model]
bayescli inspect --model builtin:mlp --checkpoint model.safetensors  # exit 2
bayescli inspect --model builtin:small-cnn --checkpoint missing.safetensors  # exit 2
bayescli inspect --model builtin:small-cnn --checkpoint model.safetensors --head conv1  # exit 2
# --8<-- [end:model]
# --8<-- [start:validation]
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --val-data digits:train --out p.safetensors --quiet
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --prior-precision -1 --out p.safetensors  # exit 2
# --8<-- [end:validation]
# --8<-- [start:runtime]
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --device cuda:3 --out p.safetensors  # exit 2
# --8<-- [end:runtime]
