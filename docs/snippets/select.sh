#!/usr/bin/env bash
# Choosing a posterior (docs/select.md). Run by tests/test_docs.py.
test -f model.safetensors || bayescli train --model builtin:small-cnn --data digits:train --out model.safetensors
# --8<-- [start:select]
bayescli select --model builtin:small-cnn --checkpoint model.safetensors --data digits:train \
    --val-data digits:val --ood patches --out-dir select
# --8<-- [end:select]
# --8<-- [start:ls]
ls select
# --8<-- [end:ls]
