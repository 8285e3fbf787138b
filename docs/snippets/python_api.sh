#!/usr/bin/env bash
# The Python API example (examples/python_api.py, shown in README.md and docs/api.md), run as a
# user runs it. Run by tests/test_docs.py.
cp "$ROOT/examples/python_api.py" .
# --8<-- [start:run]
python python_api.py
# --8<-- [end:run]
