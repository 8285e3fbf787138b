#!/usr/bin/env bash
# Bringing a checkpoint (docs/checkpoints.md): formats, inspect, --model-arg, --output, and the
# rule that files never choose code to run. Run by tests/test_docs.py.
# Set-up, not shown: the guide's model file (docs/snippets/mynet.py) in the working directory.
cp "$SNIPPETS/mynet.py" .
# --8<-- [start:save]
python mynet.py
# --8<-- [end:save]
# --8<-- [start:inspect]
bayescli inspect --model py:mynet:mlp --checkpoint mlp.pt \
    --model-arg input_dim=64 --model-arg output_dim=10 --data digits:val
# --8<-- [end:inspect]
# --8<-- [start:formats]
bayescli inspect --model py:mynet:mlp --checkpoint training.pt --model-arg input_dim=64 --model-arg output_dim=10 --json
bayescli inspect --model py:mynet:mlp --checkpoint module.pt --model-arg input_dim=64 --model-arg output_dim=10 --json
bayescli inspect --model py:mynet:with_features --checkpoint tuple.pt --output 0 --json
# --8<-- [end:formats]
# --8<-- [start:missing-arg]
bayescli inspect --model py:mynet:mlp --checkpoint mlp.pt  # exit 2
# --8<-- [end:missing-arg]
# --8<-- [start:trust]
bayescli fit-laplace --model py:mynet:mlp --checkpoint mlp.pt --model-arg input_dim=64 \
    --model-arg output_dim=10 --data digits:train --val-data digits:val --out mlp-laplace.safetensors --quiet
bayescli predict --posterior mlp-laplace.safetensors --data digits:test  # exit 2
bayescli predict --posterior mlp-laplace.safetensors --data digits:test --model py:mynet:mlp --quiet --out pred.json
# --8<-- [end:trust]
