"""Shared fixtures: a small trained checkpoint, a CLI runner, tiny heads.

``BAYESCLI_REAL_GPU=1`` (``make gpu-check``) runs the device-residency harness
(``tests/device_harness.py``) on the machine's real CUDA device instead of the emulated one, with
TF32 off (see ``pytest_configure``).

``BAYESCLI_EMULATE_GPU=1`` (``make test-gpu``) runs the whole session as on a GPU machine: from
configuration on, everything — collection, session and module fixtures, every test — runs inside
one :func:`emulated_cuda.emulated_cuda` block, so ``torch.cuda.is_available()`` is true and
``--device auto`` picks the emulated CUDA. Session-wide rather than per test, so that session
fixtures such as ``digits_ckpt`` and module fixtures that run the CLI see the GPU too, as they
would on a real one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from bayescli import progress
from bayescli.cli.app import main
from bayescli.data import load_data
from bayescli.fitting.laplace import LaplaceSettings
from bayescli.fitting.pipeline import ModelOptions, fit_from_specs
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

# OMP_NUM_THREADS, when set, is honoured: the suite is checked under 1 and 2 threads.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
progress.set_enabled(False)
# Property tests explore the same examples on every run, so CI results are reproducible.
settings.register_profile("bayescli", derandomize=True, deadline=None)
settings.load_profile("bayescli")

EMULATE_GPU = os.environ.get("BAYESCLI_EMULATE_GPU", "") not in ("", "0")
REAL_GPU = os.environ.get("BAYESCLI_REAL_GPU", "") not in ("", "0")
_session = contextlib.ExitStack()
_STATS_KEY = pytest.StashKey()


def pytest_configure(config: pytest.Config) -> None:
    if REAL_GPU:
        if EMULATE_GPU:
            pytest.exit("BAYESCLI_REAL_GPU and BAYESCLI_EMULATE_GPU exclude each other", returncode=2)
        if not torch.cuda.is_available():
            pytest.exit("BAYESCLI_REAL_GPU=1 needs a CUDA device: torch.cuda.is_available() is False", 2)
        # cuDNN convolutions default to TF32 (10-bit mantissa, relative error ~1e-3), which would
        # swamp the float32 reordering tolerance the harness compares the CPU run to; the harness
        # checks where tensors live and that the maths is the same, not TF32's accuracy.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if EMULATE_GPU:
        from emulated_cuda import emulated_cuda

        stats = _session.enter_context(emulated_cuda())
        config.stash[_STATS_KEY] = stats


def pytest_unconfigure(config: pytest.Config) -> None:
    _session.close()


def pytest_report_header(config: pytest.Config) -> str | None:
    if REAL_GPU:
        return f"bayescli: device harness on the real GPU ({torch.cuda.get_device_name()}), TF32 off"
    return "bayescli: emulated GPU for the whole session (BAYESCLI_EMULATE_GPU)" if EMULATE_GPU else None


@pytest.fixture(autouse=True)
def _fresh_transfer_log(request):
    """In an emulated-GPU session, forget the previous test's transfer events (the log would
    otherwise grow for the whole session)."""
    stats = request.config.stash.get(_STATS_KEY, None)
    if stats is not None:
        stats.reset()
    yield


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
