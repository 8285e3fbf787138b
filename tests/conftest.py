"""Shared fixtures: a small trained checkpoint, a CLI runner, tiny heads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from bayescli import progress
from bayescli.cli.app import main
from bayescli.data import load_data
from bayescli.fitting import ModelOptions, fit_from_specs
from bayescli.laplace_fit import LaplaceSettings
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

# OMP_NUM_THREADS, when set, is honoured: the suite is checked under 1 and 2 threads.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
progress.set_enabled(False)
# Property tests explore the same examples on every run, so CI results are reproducible.
settings.register_profile("bayescli", derandomize=True, deadline=None)
settings.load_profile("bayescli")


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    """Run ``bayescli ARGS`` in-process; returns exit code, stdout and stderr."""

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="session")
def digits_ckpt(tmp_path_factory) -> Path:
    """A small CNN trained on digits (few epochs: enough for the pipeline tests)."""
    path = tmp_path_factory.mktemp("ckpt") / "cnn.safetensors"
    train = load_data("digits:train")
    val = load_data("digits:val")
    clf, meta = train_classifier("builtin:small-cnn", train, val, TrainConfig(epochs=8, seed=0))
    save_checkpoint(path, clf, meta)
    return path


@pytest.fixture(scope="session")
def digits_posterior(digits_ckpt, tmp_path_factory) -> Path:
    """A last-layer kron posterior with the marglik prior, fitted and written by the library call
    behind ``bayescli fit-laplace`` (the CLI's own path is covered by tests/test_api.py)."""
    path = tmp_path_factory.mktemp("post") / "post.safetensors"
    model = ModelOptions("builtin:small-cnn", digits_ckpt)
    marglik = LaplaceSettings(prior_precision="auto")
    fit_from_specs("laplace", model, "digits:train", settings=marglik, out=path)
    return path


def random_head(d: int, k: int, seed: int = 0, dtype=torch.float64) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, k).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(k, d, generator=gen, dtype=dtype))
        head.bias.copy_(torch.randn(k, generator=gen, dtype=dtype))
    return head
