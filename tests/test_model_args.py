"""Factory arguments: --model-arg typing, Lightning hyper-parameters, and what files may supply."""

from __future__ import annotations

import pytest

from bayescli.errors import BayescliError
from bayescli.models.args import check_file_spec, factory_arguments, is_plain_json, parse_model_args


def annotated(input_dim: int, output_dim: int = 10, act: str = "relu", scale: float | None = None,
              widths: list[int] | None = None, bias: bool = True):  # fmt: skip
    return None


def untyped(hidden=32, name=None):  # noqa: ANN001, ANN201 (what users write)
    return None


def open_kwargs(depth: int = 2, **kwargs):  # noqa: ANN003, ANN201
    return None


def test_values_are_typed_by_the_signature():
    items = ["input_dim=784", "output_dim=10", "act=tanh", "scale=0.5", "widths=[64, 32]", "bias=false"]
    args = parse_model_args(items, annotated)
    assert args == {"input_dim": 784, "output_dim": 10, "act": "tanh", "scale": 0.5, "widths": [64, 32],
                    "bias": False}  # fmt: skip
    assert type(args["input_dim"]) is int and type(args["scale"]) is float
    assert parse_model_args(["scale=none"], annotated) == {"scale": None}
    # a str parameter keeps digits as text; an unannotated one takes its default's type, else JSON
    assert parse_model_args(["act=123"], annotated) == {"act": "123"}
    assert parse_model_args(["hidden=64", "name=abc"], untyped) == {"hidden": 64, "name": "abc"}
    assert parse_model_args(["name=[1, 2]"], untyped) == {"name": [1, 2]}


@pytest.mark.parametrize(
    ("items", "phrase"),
    [
        (["input_dim"], "takes NAME=VALUE"),
        (["input_dim=abc"], "takes int for 'input_dim'"),
        (["bias=maybe"], "takes bool for 'bias'"),
        (["hiden=3"], "takes no argument 'hiden'; it takes input_dim, output_dim"),
    ],
)
def test_bad_model_args_name_the_problem(items, phrase):
    with pytest.raises(BayescliError, match=phrase):
        parse_model_args(items, annotated)


def test_kwargs_factories_accept_any_name_as_json():
    assert parse_model_args(["depth=3", "drop_rate=0.1", "act_layer=gelu"], open_kwargs) == {
        "depth": 3, "drop_rate": 0.1, "act_layer": "gelu"}  # fmt: skip


def test_lightning_hyper_parameters_as_load_from_checkpoint_passes_them():
    hp = {"input_dim": 784, "output_dim": 10, "lr": 1e-3, "_instantiator": "x.y"}
    args = factory_arguments(annotated, hyper_parameters=hp)
    assert args.kwargs == {"input_dim": 784, "output_dim": 10}
    assert args.sources == {"input_dim": "hyper_parameters", "output_dim": "hyper_parameters"}
    assert "lr" in args.ignored and "_instantiator" not in args.ignored
    # a factory with **kwargs receives every hyper-parameter (Lightning's rule), bookkeeping excepted
    assert factory_arguments(open_kwargs, hyper_parameters=hp).kwargs == {
        "input_dim": 784, "output_dim": 10, "lr": 1e-3}  # fmt: skip
    # --model-arg overrides
    args = factory_arguments(annotated, hyper_parameters=hp, user={"output_dim": 5})
    assert args.kwargs["output_dim"] == 5 and args.sources["output_dim"] == "--model-arg"


def test_arguments_from_files_are_plain_json_and_declared():
    evil = {"act": "tanh", "input_dim": 3, "cb": object(), "exec_me": "rm -rf /", "output_dim": {"a": [1]}}
    args = factory_arguments(annotated, from_file=evil)
    assert args.kwargs == {"act": "tanh", "input_dim": 3, "output_dim": {"a": [1]}}
    assert "not a plain JSON value" in args.ignored["cb"]
    assert "takes no argument 'exec_me'" in args.ignored["exec_me"]
    # open **kwargs factories (timm, torchvision) take plain values from files unless strict
    assert "exec_me" in factory_arguments(open_kwargs, from_file=evil, strict_file_names=False).kwargs
    assert "exec_me" not in factory_arguments(open_kwargs, from_file=evil).kwargs
    # names bayescli passes itself never come from a file
    assert factory_arguments(annotated, from_file={"input_dim": 3}, reserved=("input_dim",)).kwargs == {}


def test_plain_json():
    assert is_plain_json({"a": [1, 2.0, None, True, "x", {"b": []}]})
    assert not is_plain_json({"a": print}) and not is_plain_json({1: 2}) and not is_plain_json(b"x")


def test_py_specs_from_files_need_the_user():
    assert check_file_spec("builtin:mlp", None, False, "p") == "builtin:mlp"
    assert check_file_spec("timm:resnet18", None, False, "p") == "timm:resnet18"
    with pytest.raises(BayescliError, match=r"will not import.*pass --model py:subprocess:run"):
        check_file_spec("py:subprocess:run", None, False, "post.safetensors")
    assert check_file_spec("py:m:f", "py:m:f", False, "p") == "py:m:f"
    assert check_file_spec("py:m:f", None, True, "p") == "py:m:f"
    with pytest.raises(BayescliError, match="fitted on the model py:m:f, not py:m:g"):
        check_file_spec("py:m:f", "py:m:g", False, "p")
