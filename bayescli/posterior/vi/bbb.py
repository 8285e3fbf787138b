"""Bayes by Backprop (Blundell et al. 2015): mean-field VI on the network itself — seed 003's BBB row.

``q(θ) = Π_i N(μ_i, σ_i²)`` over every weight of the network, ``σ = softplus(ρ)``, prior
``N(0, δ⁻¹ I)``; Adam on the minibatch objective ``mean NLL + KL(q ‖ p)/N`` (VI-SPEC §0) with one
draw per step: the local reparameterisation trick (Kingma et al. 2015) for ``nn.Linear`` (sample
the pre-activations ``N(a μ_Wᵀ + μ_b, a² σ_W²ᵀ + σ_b²)`` per input) and plain reparameterisation
for ``nn.Conv2d`` (one weight draw per minibatch). Layers without parameters pass through; other
parameterised layers (e.g. BatchNorm) are refused.

:func:`bayescli.training.bbb.train` trains from scratch (the seed's BBB); :func:`fit` starts at a
checkpoint's weights (``μ = θ*``, ``σ = init_std``). Prior precision ``δ``
(:mod:`~bayescli.posterior.vi.prior_precision`): given, else chosen on validation data over a grid
around the all-layer (diagonal) Laplace marginal-likelihood optimum at ``θ*``, else that optimum
(from scratch: 1.0, or the seed's grid with ``select=True``). No ``δ`` recovers MAP: the prior is
centred at zero, so as ``δ → ∞`` every weight is pulled to zero.

Predictive: the BNN's — ``sample_logits`` runs the network at draws from ``q``;
:meth:`BBBPosterior.logit_gaussian_inputs` is the moment-matched Gaussian of ``samples`` such logit
draws (an approximation: ``exact = False``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from bayescli import devices
from bayescli.data import Data
from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.laplace import fit_laplace
from bayescli.posterior.selection import Criterion, Scored
from bayescli.posterior.vi.network_weights import network_logits
from bayescli.posterior.vi.prior_precision import (
    MARGLIK_RULE,
    Default,
    Grid,
    Validation,
    choose_prior_precision,
    require_validation,
    select_criterion,
    selects,
)
from bayescli.posterior.vi.setting_values import as_float
from bayescli.posterior.vi.softmax_expectations import log_mean_softmax
from bayescli.progress import track


@dataclass
class BBBConfig:
    """Settings of Bayes by Backprop (``bbb``).

    * ``subset``: ``all`` (BBB places a posterior on every weight).
    * ``prior_precision``: δ of the prior ``N(0, δ⁻¹ I)``; ``None`` = chosen on validation data if
      any (see ``select``), else the all-layer diagonal Laplace marginal-likelihood optimum at the
      checkpoint (from scratch: :data:`SCRATCH_PRIOR_PRECISION`).
    * ``epochs``, ``lr``, ``batch_size``: Adam on the minibatch objective.
    * ``init_std``: σ of every weight at the start (the means start at the checkpoint or a fresh init).
    * ``samples``: weight draws behind the moment-matched logit Gaussian and the validation predictive.
    * ``seed``: seeds the initialisation, minibatches and draws.
    * ``select``: choose δ on validation data (one BBB run per candidate) — ``None`` (default):
      whenever validation data is given and δ is not; ``True``: required (an error without
      validation data); ``False``: never. A given ``prior_precision`` is always used as is. The
      from-scratch trainer selects only with ``True``.
    * ``select_by``: the validation criterion (``nll``, ``ece`` or ``brier``).
    """

    subset: Subset = Subset.ALL
    prior_precision: float | None = None
    epochs: int = 100
    lr: float = 1e-3
    batch_size: int = 128
    init_std: float = 1e-3
    samples: int = 100
    seed: int = 0
    select: bool | None = None
    select_by: Criterion = Criterion.NLL

    def __post_init__(self) -> None:
        try:
            self.subset = Subset(self.subset)
        except ValueError:
            raise BayescliError(f"subset must be 'last-layer' or 'all', got '{self.subset}'") from None
        require(self.subset == Subset.ALL.value, "bbb places a posterior on every weight; use subset 'all'")
        self.prior_precision = as_float(self.prior_precision, "prior_precision")
        require(
            self.prior_precision is None or self.prior_precision > 0,
            f"prior_precision must be positive, got {self.prior_precision}",
        )
        require(self.lr > 0 and self.init_std > 0, "lr and init_std must be positive")
        require(
            min(self.epochs, self.batch_size, self.samples) >= 1, "epochs, batch_size and samples must be ≥ 1"
        )
        self.select_by = select_criterion(self.select_by)


# From scratch there is no trained network to take a marginal likelihood at: the former default.
SCRATCH_PRIOR_PRECISION = 1.0


# ---------------------------------------------------------------------------------------------
# Bayesian layers
# ---------------------------------------------------------------------------------------------


def _rho(std: float) -> float:
    """``ρ`` with ``softplus(ρ) = std``."""
    return math.log(math.expm1(std))


class _Bayes(nn.Module):
    """Mean and ``ρ`` of a layer's weight and bias, initialised from the layer (``σ = init_std``)."""

    def __init__(self, layer: nn.Module, init_std: float) -> None:
        super().__init__()
        self.layer = layer  # keeps stride, padding, … ; its own tensors are not trained
        self.weight_mu = nn.Parameter(layer.weight.detach().clone())
        self.weight_rho = nn.Parameter(torch.full_like(layer.weight, _rho(init_std)))
        if layer.bias is not None:
            self.bias_mu = nn.Parameter(layer.bias.detach().clone())
            self.bias_rho = nn.Parameter(torch.full_like(layer.bias, _rho(init_std)))
        else:
            self.bias_mu = self.bias_rho = None

    def named_moments(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, μ, σ)`` per parameter of the original layer."""
        out = [("weight", self.weight_mu, F.softplus(self.weight_rho))]
        if self.bias_mu is not None:
            out.append(("bias", self.bias_mu, F.softplus(self.bias_rho)))
        return out


class BayesLinear(_Bayes):
    """``nn.Linear`` under mean-field ``q``; local reparameterisation of the outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sw = F.softplus(self.weight_rho)
        sb = None if self.bias_rho is None else F.softplus(self.bias_rho).square()
        mean = F.linear(x, self.weight_mu, self.bias_mu)
        var = F.linear(x.square(), sw.square(), sb)
        return mean + var.clamp_min(1e-30).sqrt() * torch.randn_like(mean)


class BayesConv2d(_Bayes):
    """``nn.Conv2d`` under mean-field ``q``; one reparameterised weight draw per forward pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_mu + F.softplus(self.weight_rho) * torch.randn_like(self.weight_mu)
        b = None
        if self.bias_mu is not None:
            b = self.bias_mu + F.softplus(self.bias_rho) * torch.randn_like(self.bias_mu)
        return self.layer._conv_forward(x, w, b)


def bayesian_copy(net: nn.Module, init_std: float) -> nn.Module:
    """A copy of ``net`` with every ``Linear``/``Conv2d`` replaced by its Bayesian version."""
    bnet = copy.deepcopy(net)
    for name, module in list(bnet.named_modules()):
        if isinstance(module, nn.Linear | nn.Conv2d):
            parent_name, _, child = name.rpartition(".")
            parent = bnet.get_submodule(parent_name) if parent_name else bnet
            cls = BayesLinear if isinstance(module, nn.Linear) else BayesConv2d
            setattr(parent, child, cls(module, init_std))
        elif not isinstance(module, _Bayes) and any(True for _ in module.parameters(recurse=False)):
            raise BayescliError(
                f"bbb supports Linear and Conv2d weights; '{name}' is a {type(module).__name__} with "
                "parameters. Use glm-vi or laplace for this network"
            )
    bnet.requires_grad_(False)
    for module in bnet.modules():
        if isinstance(module, _Bayes):
            for p in (module.weight_mu, module.weight_rho, module.bias_mu, module.bias_rho):
                if p is not None:
                    p.requires_grad_(True)
    return bnet


def moments(bnet: nn.Module, net: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``μ`` and ``σ`` ``[P]`` in the order of ``net.named_parameters()``."""
    table = {}
    for name, module in bnet.named_modules():
        if isinstance(module, _Bayes):
            for pname, mu, std in module.named_moments():
                table[f"{name}.{pname}"] = (mu, std)
    means, stds = [], []
    for name, _ in net.named_parameters():
        mu, std = table[name]
        means.append(mu.detach().reshape(-1))
        stds.append(std.detach().reshape(-1))
    return torch.cat(means), torch.cat(stds)


def gaussian_kl(mean: torch.Tensor, std: torch.Tensor, delta: float) -> torch.Tensor:
    """``KL(N(μ, σ²) ‖ N(0, δ⁻¹))`` summed over entries."""
    var = std.square()
    return 0.5 * (delta * (var + mean.square()) - 1.0 - torch.log(delta * var)).sum()


def bbb_kl(bnet: nn.Module, delta: float) -> torch.Tensor:
    """The KL of all Bayesian layers of ``bnet``."""
    return sum(
        gaussian_kl(mu, std, delta)
        for m in bnet.modules()
        if isinstance(m, _Bayes)
        for _, mu, std in m.named_moments()
    )


# ---------------------------------------------------------------------------------------------
# the posterior
# ---------------------------------------------------------------------------------------------


@dataclass
class BBBPosterior(Posterior):
    """Mean-field ``q(θ)`` over all weights: ``mean [P]`` and ``std [P]`` (``named_parameters`` order)."""

    mean: torch.Tensor
    std: torch.Tensor
    prior_precision: float
    n_data: int
    samples: int
    seed: int
    subset: Subset = Subset.ALL
    meta: dict = field(default_factory=dict)

    method: ClassVar[str] = "bbb"

    def summary(self) -> dict:
        return {
            "prior_precision": self.prior_precision,
            "prior_method": self.meta.get("prior", {}).get("method"),
            "mean_std": float(self.std.mean()),
            "samples": self.samples,
            "n_data": self.n_data,
        }

    def draws(self, num: int, generator: torch.Generator) -> torch.Tensor:
        """``num`` weight vectors ``[M, P]`` from ``q``."""
        eps = torch.randn(
            num, self.mean.numel(), generator=generator, dtype=self.mean.dtype, device=self.mean.device
        )
        return self.mean + eps * self.std

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """BNN predictive: the network's logits ``[M, N, K]`` at ``M`` draws from ``q`` (on its device)."""
        return network_logits(classifier, x.to(self.mean.device), self.draws(num, generator))

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """Moment-matched Gaussian of ``samples`` BNN logit draws (the same draws for every batch)."""
        gen = devices.generator(self.mean.device, self.seed)
        logits = self.sample_logits(self.samples, classifier, x, None, gen)
        centred = logits - logits.mean(0)
        cov = torch.einsum("mnk,mnl->nkl", centred, centred) / max(1, self.samples - 1)
        return LogitGaussian(logits.mean(0), cov.diagonal(dim1=1, dim2=2).clone(), cov, exact=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "std": self.std}

    def own_metadata(self) -> dict:
        return {
            "prior_precision": self.prior_precision,
            "n_data": self.n_data,
            "samples": self.samples,
            "seed": self.seed,
            "predictive": "bnn (logit Gaussian: moments of the draws)",
            "exact": False,
        }

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> BBBPosterior:
        return cls(
            tensors["mean"],
            tensors["std"],
            float(meta["prior_precision"]),
            int(meta["n_data"]),
            int(meta["samples"]),
            int(meta["seed"]),
            Subset(meta["subset"]),
            cls.provenance(meta, _OWN_KEYS),
        )


_OWN_KEYS = {"prior_precision", "n_data", "samples", "seed", "predictive", "exact"}


# ---------------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------------


def train_mean_field(
    classifier: Classifier,
    train: Data,
    cfg: BBBConfig,
    delta: float,
    device: torch.device,
) -> tuple[BBBPosterior, list[float]]:
    """Run BBB from ``classifier``'s weights (the means) and return the posterior and the per-epoch
    objective (``mean NLL + KL/N``). Runs on ``device``; the posterior's tensors stay there."""
    torch.manual_seed(cfg.seed)  # the layers draw their noise from the global generator (every device's)
    classifier.to(device)
    bnet = bayesian_copy(classifier.net, cfg.init_std).train()
    params = [p for p in bnet.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    gen = devices.generator("cpu", cfg.seed)  # the minibatch order indexes the data, which live on the host
    n = len(train)
    # the objective is summed on the device (float64, as Python floats would) and read once at the end
    totals = torch.zeros(cfg.epochs, dtype=torch.float64, device=device)
    for epoch in track(range(cfg.epochs), total=cfg.epochs, description="BBB"):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            xb, yb = train.inputs(idx).to(device), train.y[idx].to(device)
            loss = F.cross_entropy(bnet(classifier.normalise(xb)), yb) + bbb_kl(bnet, delta) / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            totals[epoch] += loss.detach().double() * len(idx)
    mean, std = moments(bnet, classifier.net)
    return BBBPosterior(mean, std, float(delta), n, cfg.samples, cfg.seed), (totals / n).tolist()


def validation(
    classifier: Classifier,
    val: Data,
    samples: int,
    criterion: Criterion,
    batch_size: int,
    map_logits: torch.Tensor | None,
) -> Validation:
    """The BNN predictive on ``val`` ``[N, K]`` with its log-probabilities: per batch, ``samples``
    network runs at draws from ``q`` seeded with the posterior's seed (``map_logits [N, K]``: the
    network's own, for MAP's scores)."""

    def predictive(post: BBBPosterior) -> Scored:
        parts = []
        for x, _ in val.batches(batch_size):
            gen = devices.generator(post.mean.device, post.seed)
            draws = post.sample_logits(post.samples, classifier, x, None, gen)
            parts.append(Scored(draws.softmax(-1).mean(0), log_mean_softmax(draws)))
        return Scored.cat(parts)

    objective = f"validation {criterion.value} (bnn predictive, {samples} draws)"
    map_probs = None if map_logits is None else map_logits.softmax(-1)
    return Validation(predictive, val.y, objective, map_probs, map_logits)


def fit_mean_field(
    classifier: Classifier,
    train: Data,
    settings: BBBConfig,
    device: torch.device,
    default: Callable[[], Default],
    val: Validation | None,
    grid: Grid | None = None,
    map_fallback: bool = False,
) -> BBBPosterior:
    """BBB from ``classifier``'s weights at the ``δ`` that
    :func:`~bayescli.posterior.vi.prior_precision.choose_prior_precision` picks (``default()`` the
    principled one, ``val`` the held-out scoring, ``grid`` the search grid). ``map_fallback`` (post
    hoc): when no ``δ`` beats MAP on validation, the point mass at the checkpoint's weights (zero
    ``std``) instead — the prior is centred at zero, so no ``δ`` reaches MAP by itself."""
    cfg = settings
    start = time.perf_counter()

    def run(delta: float) -> BBBPosterior:
        post, history = train_mean_field(classifier, train, cfg, delta, device)
        post.meta["vi"] = {
            "algorithm": "Bayes by Backprop, mean field (local reparameterisation for Linear, "
            "weight reparameterisation for Conv2d)",
            "epochs": cfg.epochs,
            "lr": cfg.lr,
            "batch_size": cfg.batch_size,
            "init_std": cfg.init_std,
            "objective": history,
        }
        return post

    def point_mass(best: BBBPosterior) -> BBBPosterior:
        theta = torch.cat([p.detach().reshape(-1) for p in classifier.net.parameters()])
        post = replace(best, mean=theta.to(best.mean), std=torch.zeros_like(best.std), meta={})
        post.meta["vi"] = {
            "algorithm": "none: the point mass at θ* (no prior_precision beat MAP on validation)"
        }
        return post

    post, selection = choose_prior_precision(
        cfg.prior_precision,
        cfg.select,
        cfg.select_by,
        default,
        run,
        val,
        grid,
        point_mass if map_fallback else None,
        "the MAP weights",
    )
    post.selection = selection
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def fit(source: FitSource, settings: BBBConfig) -> BBBPosterior:
    """BBB post hoc: the means start at the checkpoint's weights, ``σ`` at ``settings.init_std``.

    δ: ``settings.prior_precision`` if given; else, with validation data (``source.val``) and
    ``select`` not ``False``, the best of ``δ_0 · 10^i``, ``i = −2 … 2`` (extended past an edge
    minimum) by ``select_by`` on the validation BNN predictive, ``δ_0`` the all-layer diagonal
    Laplace marginal-likelihood optimum at the checkpoint; else ``δ_0``. ``post.selection``
    records which.
    """
    require_validation(settings.select, source.val is not None)
    clf = source.classifier
    val = None
    if selects(settings.prior_precision, settings.select, source.val is not None):
        map_logits = source.val_features().logits
        val = validation(clf, source.val, settings.samples, settings.select_by, source.batch_size, map_logits)

    def default() -> Default:
        clf.to(source.device).eval()
        batches = list(source.data.batches(source.batch_size))
        delta = fit_laplace(clf, batches=batches, subset=Subset.ALL, structure="diag").prior_precision
        return Default(delta, "laplace-marglik", MARGLIK_RULE)

    post = fit_mean_field(clf, source.data, settings, source.device, default, val, map_fallback=True)
    post.meta["start"] = "checkpoint"
    return post
