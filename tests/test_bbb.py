"""Bayes by Backprop (seed 003's BBB row): layers, KL, and agreement with mean-field GLM VI on a GLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_glm_vi import linear_model, logistic_data
from tolerance import assert_below, assert_close
from torch import nn
from vi_oracles import glm_elbo, last_layer_design, maximise_elbo

from bayescli.data import load_data
from bayescli.errors import BayescliError
from bayescli.fitting.fit_source import FitSource
from bayescli.models.specs import Classifier, LoadedModel, ModelSpec
from bayescli.posterior.base import load_posterior
from bayescli.posterior.vi.bbb import (
    BayesConv2d,
    BayesLinear,
    BBBConfig,
    BBBPosterior,
    bayesian_copy,
    fit,
    gaussian_kl,
)
from bayescli.training import bbb as bbb_training

CPU = torch.device("cpu")


def test_local_reparameterisation_moments():
    """BayesLinear draws pre-activations N(xμᵀ + μ_b, x²σ²ᵀ + σ_b²) per input: the moments of 400,000
    such draws vs those of x Wᵀ + b over 400,000 weight draws (independent Monte Carlo). The
    difference of two sample variances has SE ≈ var·√(2·2/4e5) = 0.3%, of two means ≈ sd/450;
    tolerances 3% relative and sd/45 (10 SE)."""
    torch.manual_seed(0)
    layer = BayesLinear(nn.Linear(3, 2), init_std=0.3)
    x = torch.tensor([[1.0, -2.0, 0.5]])
    with torch.no_grad():
        out = layer(x.expand(400_000, 3))  # one independent draw per row
        sw, sb = nn.functional.softplus(layer.weight_rho), nn.functional.softplus(layer.bias_rho)
        w = layer.weight_mu + sw * torch.randn(400_000, 2, 3)
        b = layer.bias_mu + sb * torch.randn(400_000, 2)
        ref = torch.einsum("mkd,d->mk", w, x[0]) + b
    sd = ref.std(0)
    assert_close(out.mean(0), ref.mean(0), atol=float(sd.max()) / 45, what="local reparam mean")
    assert_close(out.var(0), ref.var(0), rtol=0.03, what="local reparam variance")


def test_conv_reparameterisation_moments():
    """BayesConv2d: per-output mean conv(x, μ) + μ_b and variance conv(x², σ²) + σ_b² (the marginal
    of one weight draw), vs 20,000 forward passes. SE of the variance ≈ 1% of it, of the mean
    ≈ sd/140; tolerances 6% and sd/20 (6–7 SE; measured 1.5% and sd/140)."""
    torch.manual_seed(1)
    layer = BayesConv2d(nn.Conv2d(1, 2, 2), init_std=0.2)
    x = torch.randn(1, 1, 3, 3)
    with torch.no_grad():
        out = torch.cat([layer(x) for _ in range(20_000)])
        sw, sb = nn.functional.softplus(layer.weight_rho), nn.functional.softplus(layer.bias_rho)
        mean = nn.functional.conv2d(x, layer.weight_mu, layer.bias_mu)[0]
        var = nn.functional.conv2d(x.square(), sw.square(), sb.square())[0]
    assert_close(out.mean(0), mean, atol=float(var.max().sqrt()) / 20, what="conv mean")
    assert_close(out.var(0), var, rtol=0.06, what="conv variance")


def test_gaussian_kl_matches_torch():
    gen = torch.Generator().manual_seed(0)
    mu, std = torch.randn(5, generator=gen, dtype=torch.float64), torch.rand(5, generator=gen).double() + 0.1
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(mu, std), torch.distributions.Normal(0.0, 0.5**-0.5)
    ).sum()
    assert_close(gaussian_kl(mu, std, 0.5), ref, rtol=1e-9, what="KL")  # float64; measured 4e-11


def test_bbb_on_a_linear_model_reaches_the_mean_field_glm_optimum():
    """A single Linear layer is a GLM, so BBB's objective is the mean-field GLM ELBO. Full-batch
    Adam (lr 1e-2, 2000 steps) with one draw per step jitters around the optimum: over two seeds the
    largest parameter error was 0.04 (scale 0.75) and the ELBO gap 0.05 nats; tolerances 0.4 and 0.5."""
    data, delta = logistic_data(), 0.7
    cfg = BBBConfig(prior_precision=delta, epochs=2000, lr=1e-2, batch_size=40, init_std=0.1)
    post = fit(FitSource(linear_model(), data), cfg)
    # BBB stores weight [2, 2] then bias [2]; the GLM's order is row-major [K, D+1]
    mean = torch.cat([post.mean[:4].reshape(2, 2), post.mean[4:, None]], 1).reshape(-1).double()
    std = torch.cat([post.std[:4].reshape(2, 2), post.std[4:, None]], 1).reshape(-1).double()
    jac, offset = last_layer_design(data.x, 2), torch.zeros(40, 2, dtype=torch.float64)
    mu, sigma, best = maximise_elbo(jac, offset, data.y, delta, torch.eye(6, dtype=torch.bool))
    assert_close(mean, mu, atol=0.4, what="BBB mean vs mean-field optimum")
    assert_close(std, sigma.diagonal().sqrt(), atol=0.4, what="BBB std vs mean-field optimum")
    gap = best - float(glm_elbo(jac, offset, data.y, delta, mean, torch.diag(std)))
    assert_below(gap, 0.5, what="ELBO gap of the BBB solution")


def test_round_trip_and_predictive(tmp_path):
    data = logistic_data(30, k=3, seed=2)
    torch.manual_seed(0)
    model = LoadedModel(
        Classifier(nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)), "2"),
        ModelSpec.parse("builtin:mlp"),
        Path(),
        "",
        {},
    )
    post = fit(FitSource(model, data), BBBConfig(epochs=3, samples=50))
    assert post.meta["start"] == "checkpoint" and len(post.meta["vi"]["objective"]) == 3
    path = tmp_path / "bbb.safetensors"
    post.save(path)
    back = load_posterior(path)
    assert isinstance(back, BBBPosterior) and torch.equal(back.std, post.std)
    x = torch.randn(4, 2)
    lg = back.logit_gaussian_inputs(model.classifier, x)
    assert not lg.exact
    draws = post.sample_logits(50, model.classifier, x, None, torch.Generator().manual_seed(post.seed))
    assert_close(lg.mean, draws.mean(0), atol=1e-6, what="moment-matched mean")
    assert_close(lg.var, draws.var(0), atol=1e-6, what="moment-matched variance")


def test_train_from_scratch_and_conv_nets():
    train = load_data("digits:train[:200]")
    cfg = BBBConfig(epochs=1, batch_size=64)
    clf, meta, post = bbb_training.train("builtin:small-cnn", train, None, cfg, CPU)
    assert post.meta["start"] == "scratch" and meta["training"]["method"] == "bbb"
    theta = torch.cat([p.detach().reshape(-1) for p in clf.net.parameters()])
    assert torch.equal(theta, post.mean)  # the checkpoint carries the means
    assert (post.std > 0).all()


def test_refusals():
    with pytest.raises(BayescliError, match="use subset 'all'"):
        BBBConfig(subset="last-layer")
    with pytest.raises(BayescliError, match="BatchNorm"):
        bayesian_copy(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)), 0.1)


def test_cli_train_method_bbb(cli, tmp_path):
    out = tmp_path / "bbb.safetensors"
    res = cli("train", "--method", "bbb", "--model", "builtin:mlp", "--data", "digits:train[:200]",
              "--epochs", "1", "--out", out, "--json")  # fmt: skip
    assert res.code == 0, res.err
    post = load_posterior(tmp_path / "bbb-bbb.safetensors")
    assert isinstance(post, BBBPosterior) and post.meta["checkpoint_sha256"]
    res = cli("predict", "--posterior", tmp_path / "bbb-bbb.safetensors", "--data", "digits:test[:10]",
              "--predictive", "bnn", "--link", "mc", "--samples", "20", "--json")  # fmt: skip
    assert res.code == 0, res.err
