import json

import pytest
import torch

from bayescli.errors import BayescliError
from bayescli.io import atomic_path, load_tensors, save_tensors, sha256_file, write_json
from bayescli.models.checkpoints import read_checkpoint


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "out.json"
    write_json(target, {"a": 1})
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text("partial")
        raise KeyboardInterrupt
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_json_writes_nan_as_null(tmp_path):
    write_json(tmp_path / "x.json", {"v": float("nan"), "t": torch.tensor([1.5])})
    assert json.loads((tmp_path / "x.json").read_text()) == {"v": None, "t": [1.5]}


def test_safetensors_roundtrip_with_metadata(tmp_path):
    path = tmp_path / "t.safetensors"
    save_tensors(path, {"a": torch.arange(6.0).reshape(2, 3)}, {"k": [1, 2], "name": "x"})
    tensors, meta = load_tensors(path)
    assert torch.equal(tensors["a"], torch.arange(6.0).reshape(2, 3))
    assert meta == {"k": [1, 2], "name": "x"}


def test_truncated_safetensors_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    save_tensors(path, {"a": torch.zeros(100)}, {})
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(BayescliError, match="truncated or corrupt"):
        load_tensors(path)


def test_pickled_object_is_never_unpickled(tmp_path):
    import argparse

    path = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "obj": argparse.Namespace(cmd="rm -rf")}, path)
    with pytest.raises(BayescliError, match="weights-only"):
        read_checkpoint(path)


def test_plain_state_dict_pt_loads(tmp_path):
    path = tmp_path / "ok.pth"
    torch.save({"state_dict": {"w": torch.ones(3)}}, path)
    ckpt = read_checkpoint(path)
    assert torch.equal(ckpt.content["state_dict"]["w"], torch.ones(3)) and ckpt.metadata == {}
    assert ckpt.format == "torch-zip"


def test_unknown_checkpoint_format_is_refused(tmp_path):
    path = tmp_path / "model.h5"
    path.write_bytes(b"x")
    with pytest.raises(BayescliError, match="unsupported checkpoint format"):
        read_checkpoint(path)


def test_sha256_matches_hashlib(tmp_path):
    import hashlib

    path = tmp_path / "b"
    path.write_bytes(b"abc" * 1000)
    assert sha256_file(path) == hashlib.sha256(b"abc" * 1000).hexdigest()
