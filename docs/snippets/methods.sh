#!/usr/bin/env bash
# The methods (docs/methods/*.md): one fit of each family on the same checkpoint, each tuned on the
# validation split, then all compared in one report (GGP VI, BBB and all-layer Laplace fit once per
# δ candidate or run the net per input: minutes even on digits, so not here). Run by tests/test_docs.py.
test -f model.safetensors || bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
# --8<-- [start:laplace]
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --hessian diag --out laplace-diag.safetensors --quiet
bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --prior-precision auto --out laplace-marglik.safetensors --quiet
# --8<-- [end:laplace]
# --8<-- [start:vi]
bayescli fit-vi --method mnvi --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --out mnvi.safetensors --quiet
bayescli fit-vi --method fsvi --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --out fsvi.safetensors --quiet
bayescli fit-vi --method dirichlet-fvi --model builtin:small-cnn --checkpoint model.safetensors \
    --data digits:train --out dirichlet-fvi.safetensors --quiet
bayescli fit-vi --method glm-vi --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --out glm-vi.safetensors --quiet
# --8<-- [end:vi]
# --8<-- [start:compare]
bayescli evaluate --posterior laplace-diag.safetensors --posterior laplace-marglik.safetensors \
    --posterior mnvi.safetensors --posterior fsvi.safetensors --posterior dirichlet-fvi.safetensors \
    --posterior glm-vi.safetensors --data digits:test --methods map,temp,glm-probit --ood patches \
    --ood-scores msp --out compare.json --quiet --json \
    | python -c "import json, sys; r = json.load(sys.stdin)['results']; [print(f'{m:32s} NLL {v[\"nll\"]:.4f}  ECE {v[\"ece\"]:.4f}') for m, v in r['in_distribution'].items()]"
# --8<-- [end:compare]
