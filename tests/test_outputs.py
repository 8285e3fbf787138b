"""Prediction files: the streamed JSON Lines output carries the same rows as the JSON document."""

import json
import math

import torch

from bayescli.io import plain, to_json, write_jsonl


def test_jsonl_rows_equal_json_rows(cli, digits_posterior, tmp_path):
    args = ["predict", "--posterior", digits_posterior, "--data", "digits:test", "--limit", "50", "--bridge"]
    assert cli(*args, "--out", tmp_path / "p.json", "--quiet").code == 0
    assert cli(*args, "--out", tmp_path / "p.jsonl", "--quiet").code == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["kind"] == "prediction" and header["results"] == doc["results"]
    assert [json.loads(line) for line in lines[1:]] == doc["rows"] and len(doc["rows"]) == 50
    row = doc["rows"][0]
    assert {"alpha", "alpha0", "mutual_information", "top5", "entropy", "label"} <= set(row)
    top = sorted(row["top5"], key=lambda ip: -ip[1])
    assert row["predicted"] == top[0][0] and row["max_prob"] == top[0][1]


def test_non_finite_numbers_become_null_everywhere(tmp_path):
    obj = {"a": float("nan"), "b": [1.0, float("inf")], "t": torch.tensor([0.5, float("-inf")])}
    assert json.loads(to_json(obj)) == {"a": None, "b": [1.0, None], "t": [0.5, None]}
    write_jsonl(tmp_path / "x.jsonl", {"n": 2}, iter([{"v": math.nan}, {"v": 1.5}]))
    assert [json.loads(s) for s in (tmp_path / "x.jsonl").read_text().splitlines()] == [
        {"n": 2},
        {"v": None},
        {"v": 1.5},
    ]
    assert plain({1: (2, 3)}) == {"1": [2, 3]}
