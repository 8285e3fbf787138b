#!/usr/bin/env bash
# Evaluation and CI gating (docs/evaluation.md). Run by tests/test_docs.py.
test -f model.safetensors || bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
test -f posterior.safetensors || bayescli fit-laplace --model builtin:small-cnn --checkpoint model.safetensors \
    --data digits:train --out posterior.safetensors --quiet
# --8<-- [start:suite]
bayescli evaluate --posterior posterior.safetensors --data digits:test --ood noise:uniform --ood patches \
    --rotation 0:180:15 --corruption all --severity 1-5 --fgsm 0,2/255,4/255,8/255 --conformal 0.1 \
    --out report.json --html report.html
# --8<-- [end:suite]
# --8<-- [start:gates]
bayescli evaluate --posterior posterior.safetensors --data digits:test --ood patches --out gate.json --quiet \
    --fail-if "in_distribution.glm-probit.ece > 0.05" --fail-if "ood.patches.glm-probit.max_prob.auroc < 0.90"
bayescli evaluate --posterior posterior.safetensors --data digits:test --quiet \
    --fail-if "in_distribution.glm-probit.accuracy < 0.999"  # exit 1
bayescli evaluate --posterior posterior.safetensors --data digits:test --quiet \
    --fail-if "in_distribution.glm-probit.acuracy < 0.9"  # exit 2
# --8<-- [end:gates]
# --8<-- [start:jq]
python -c "import json; r = json.load(open('gate.json')); print(r['schema_version'], sorted(r['results']))"
# --8<-- [end:jq]
