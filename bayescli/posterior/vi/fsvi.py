"""Tractable function-space VI (FSVI, seed 001; ../shared/VI-SPEC.md B): settings, posterior, post-hoc fit.

``q(θ) = N(μ, diag σ²)`` over the head ``W̃ = [W, b] ∈ R^{K×(D+1)}`` (post hoc, ``last-layer``)
or over every parameter (from scratch, ``all``: :mod:`bayescli.training.fsvi`), trained on

    ℓ = (1/B) Σ_b E_q[−log softmax(f(x_b))_{y_b}] + KL(q_f(X_C) ‖ p_f(X_C)) / N

with the KL between the distributions over logits at ``C`` context points ``X_C`` drawn from
``p_Xc`` (:mod:`.fsvi_context`; τ = 1, FSVI-code scaling), in closed form
(:mod:`.fsvi_objective`). Post hoc the prior is ``W̃ ~ N(0, σ_p² I)`` on the frozen features
(nothing is linearised); from scratch it is the network linearised about a fixed random
initialisation ``θ0`` (VI-SPEC B6.1).

Prior scale: ``σ_p² = c / mean_x ‖φ̃(x)‖²`` over the training inputs, so the prior logit variance
at a typical input is ``c`` whatever the feature norms (VI-SPEC B6.7); ``c`` is ``prior_scale``.
Its principled default is the paper-style setting that VI-SPEC B3/B4 recommend, a prior logit
variance of one at a typical training input post hoc (``c = 1``; FSVI-code's ``prior_var`` 1 on
FMNIST) and ``c = 300`` from scratch (see ``MODE_DEFAULTS``).

Held-out selection (post hoc): with validation data and ``prior_scale`` unset, ``c`` is chosen on
the validation ``select_by`` score of the MC predictive over ``PRIOR_SCALE_GRID`` (decades
around ``c = 1``). Unlike Laplace's prior precision, ``c`` has no limit in which this posterior
becomes MAP: the prior is centred at zero, so ``c → 0`` pulls the logits at the context points to
zero (the uniform predictive) and ``c → ∞`` leaves only the flat-prior posterior, whose variances
grow without bound on a confidently fitted net (measured, digits small-cnn: validation NLL 0.22 at
``c = 10⁸`` vs MAP's 0.045). The MAP end of the candidate set is therefore the variance → 0 limit
of ``q`` about the MAP head — the point mass at MAP, which this module returns (``var = 0``,
``selection.map_fallback``) when no grid value scores better than MAP on validation, so a selected
posterior is never worse than MAP there (gap 0).

Predictives: last layer — the exact logit Gaussian ``N(M̃ φ̃, diag(s̃_k·φ̃²))`` (``exact``); all
layers — the GLM Gaussian ``N(f(x; μ), J diag(σ²) Jᵀ)`` (an approximation of the paper's BNN
predictive, which :meth:`FSVIPosterior.sample_logits` draws).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from bayescli.data import ArrayData, Data
from bayescli.devices import generator
from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.gaussian import LogitGaussian, augment
from bayescli.posterior.laplace import head_parameters
from bayescli.posterior.selection import Criterion, Scored, log_grid, select_on_grid, unvalidated
from bayescli.posterior.vi.budget import head_epochs
from bayescli.posterior.vi.fsvi_context import CONTEXT_KINDS, ContextSampler
from bayescli.posterior.vi.fsvi_objective import (
    FactorisationChecks,
    curve_row,
    epoch_parts,
    expected_nll,
    function_kl,
    head_moments,
    mc_predictive,
)
from bayescli.progress import track

# What 0 (unset, for prior_scale) means for these FSVIConfig fields, per mode.
# prior_scale: from scratch the context includes training points whose logits must reach ±10, so
#   the prior needs std ≳ 10 there: small-cnn on MNIST test[:5000], 10 epochs, c = 30 / 100 / 300 /
#   1000 gave accuracy .978 / .983 / .986 / .982 and ECE .127 / .074 / .054 / .052 on
#   test[5000:8000] (c = 10, 5 epochs: .954 / .221).
# batch_size, lr: post hoc the features are cached and the KL costs the same per step whatever the
#   batch, so large batches (the 2048 → 1000 benchmark: 0.48 s CPU per step at 512 vs 0.37 at 128);
#   MNIST post hoc, 10 epochs: B = 512 with lr 1e-2 matched B = 128 with lr 3e-3 (AUROC .832 / .838,
#   NLL .069 / .070). From scratch: the library trainer's lr, a CNN-sized batch.
# head_var_init: post hoc 0 = Laplace variances; from scratch the spec's 1e-3·σ_p² (Laplace
#   variances at θ0 are ≈ σ_p²: features at θ0 are tiny; measured: training collapses at c = 1000).
MODE_DEFAULTS = {
    Subset.LAST_LAYER: {"prior_scale": 1.0, "batch_size": 512, "lr": 1e-2},
    Subset.ALL: {"prior_scale": 300.0, "batch_size": 128, "lr": 3e-3, "head_var_init": 1e-3, "epochs": 10},
}
# Post hoc: decades over 0.1 … 1000 around c = 1 (digits small-cnn, 10 epochs: validation NLL
# .23 / .098 / .076 / .089 at c = 0.1 / 1 / 10 / 100, minimum near 10); an edge minimum extends it.
# Decades, as every other method's grid: each value is a fit, and half-decades cost 9 fits for
# differences of ~0.005 NLL between neighbours near the minimum.
# From scratch each value trains a network, so only the three values around 300 (no extension).
PRIOR_SCALE_GRID = {
    Subset.LAST_LAYER: tuple(log_grid(1.0, -1, 3)),
    Subset.ALL: (100.0, 300.0, 1000.0),
}
VAL_SAMPLES = 100  # MC draws of the logit Gaussian per validation input for selection
JACOBIAN_ELEMENTS = 2**25  # Jacobian entries per chunk of the GLM predictive (128 MiB float32)


@dataclass
class FSVIConfig:
    """FSVI hyperparameters (VI-SPEC B3/B4), validated on construction.

    * ``prior_scale``: ``c`` in ``σ_p² = c / mean‖φ̃‖²`` — the prior logit variance at a typical
      training input (post hoc: pretrained features; from scratch: the random-init features);
      ``None`` = chosen on validation data post hoc when it is given (see ``select``), otherwise
      the mode's default, 1 post hoc and 300 from scratch (``MODE_DEFAULTS``).
    * ``context``: context distribution ``p_Xc`` — ``monochrome`` (seed App. D.8: each channel
      filled with one pixel value drawn from that channel's pooled training pixels; flat inputs:
      uniform within the training range per dimension), ``augment`` (training images randomly
      flipped, shifted and rotated) or a :class:`~bayescli.data.Data` set in the fitting data's
      pixel space (post hoc: loaded with the model's preprocessing). A data spec string
      (e.g. ``kmnist:train``) is for the caller to load: :meth:`data_specs` lists it.
    * ``context_points``: ``C`` context draws per step (FSVI-code: 32).
    * ``batch_context_points``: points of the current batch added to the context set (from
      scratch only, VI-SPEC B1: ``C_b = 32``); post hoc the context is ``p_Xc`` alone.
    * ``context_pool``: inputs drawn once from ``p_Xc`` whose features serve as the post-hoc
      context pool; also the rows kept (seeded) of a larger data ``context``.
    * ``samples``: MC draws of the logits for the expected log-likelihood (local
      reparameterisation of the head, exact in distribution for a linear head).
    * ``head_var_init``: initial head variances — ``0``: post hoc the diagonal-GGN Laplace
      variances ``1/(Σ_n p(1−p)φ̃² + 1/σ_p²)`` at the MAP head (VI-SPEC B4's alternative; on
      MNIST it converges within 10 epochs where the spec's ``1e-3·σ_p²`` has barely moved), from
      scratch ``1e-3·σ_p²``; a positive value: that fraction of ``σ_p²``.
    * ``feature_logvar_init``: initial log-variance of feature parameters (FSVI-code: −20).
    * ``kl_classes``: classes whose log-determinant enters the KL per step (a random subset,
      scaled to be unbiased); ``0`` or ``≥ K`` = all classes (default 64: exact up to K = 64).
    * ``subset``: ``last-layer`` (post hoc) or ``all`` (from scratch, :mod:`bayescli.training.fsvi`).
    * ``epochs`` (``0``: 10 from scratch; post hoc 10, fewer at large ``N`` — about 128 steps, at
      least 2 epochs, :func:`~bayescli.posterior.vi.budget.head_epochs`); ``lr`` (Adam, cosine
      decay to 0 post hoc / one-cycle from scratch as in
      :func:`bayescli.training.classifier.train_classifier`; ``0``: 1e-2 post hoc, 3e-3 from scratch);
      ``batch_size`` (``0``: 512 post hoc, 128 from scratch); ``seed``.
    * ``select``: choose ``prior_scale`` on validation data. ``None``: post hoc whenever
      validation data is given and ``prior_scale`` is unset, from scratch never (each value
      trains a network); ``True``: always (validation data required); ``False``: never.
    * ``select_by``: the validation score selection minimises (``nll``, ``ece`` or ``brier``) of
      the MC predictive (``VAL_SAMPLES`` draws of the logit Gaussian; from scratch that of the
      head marginal).
    """

    prior_scale: float | None = None
    context: str | Data = "monochrome"
    context_points: int = 32
    batch_context_points: int = 32
    context_pool: int = 2048
    samples: int = 8
    head_var_init: float = 0.0
    feature_logvar_init: float = -20.0
    kl_classes: int = 64
    subset: Subset = Subset.LAST_LAYER
    epochs: int = 0
    lr: float = 0.0
    batch_size: int = 0
    seed: int = 0
    select: bool | None = None
    select_by: Criterion = Criterion.NLL

    def __post_init__(self) -> None:
        try:
            self.subset = Subset(self.subset)
        except ValueError:
            raise BayescliError(f"subset must be 'last-layer' or 'all', got '{self.subset}'") from None
        require(
            self.prior_scale is None or self.prior_scale > 0,
            f"prior_scale must be > 0 (None: choose it), got {self.prior_scale}",
        )
        require(
            not (self.select and self.prior_scale is not None),
            "select=True chooses prior_scale on validation data; leave prior_scale unset (None) "
            "or set select=False to use the value given",
        )
        require(self.context_points >= 1, f"context_points must be ≥ 1, got {self.context_points}")
        require(
            self.batch_context_points >= 0,
            f"batch_context_points must be ≥ 0, got {self.batch_context_points}",
        )
        require(self.context_pool >= 1, f"context_pool must be ≥ 1, got {self.context_pool}")
        require(self.samples >= 1, f"samples must be ≥ 1, got {self.samples}")
        require(self.head_var_init >= 0, f"head_var_init must be ≥ 0, got {self.head_var_init}")
        require(self.kl_classes >= 0, f"kl_classes must be ≥ 0, got {self.kl_classes}")
        require(self.epochs >= 0, f"epochs must be ≥ 0 (0 = default), got {self.epochs}")
        require(self.lr >= 0, f"lr must be ≥ 0 (0 = default), got {self.lr}")
        require(self.batch_size >= 0, f"batch_size must be ≥ 0 (0 = default), got {self.batch_size}")
        require(
            isinstance(self.context, Data | str),
            f"context must be monochrome, augment, a data spec or Data, got {type(self.context).__name__}",
        )
        criteria = [c.value for c in Criterion]
        require(
            self.select_by in criteria,
            f"select_by must be {', '.join(criteria[:-1])} or {criteria[-1]}, got '{self.select_by}'",
        )
        self.select_by = Criterion(self.select_by)

    def data_specs(self) -> dict[str, str]:
        """``{field: spec}`` for the fields holding a data spec the caller must load (``context``
        unless it is ``monochrome``, ``augment`` or already :class:`~bayescli.data.Data`)."""
        if isinstance(self.context, str) and self.context not in CONTEXT_KINDS:
            return {"context": self.context}
        return {}

    def with_defaults(self, subset: Subset) -> FSVIConfig:
        """A copy for ``subset`` with every ``0`` meaning "default" replaced by the mode's default
        (``prior_scale`` stays as given: ``None`` is resolved by the fit, see :meth:`default_prior_scale`)."""
        defaults = {
            k: v for k, v in MODE_DEFAULTS[subset].items() if k != "prior_scale" and not getattr(self, k)
        }
        return replace(self, subset=subset.value, **defaults)

    @property
    def default_prior_scale(self) -> float:
        """The principled ``c`` of this ``subset`` (used without validation data)."""
        return MODE_DEFAULTS[Subset(self.subset)]["prior_scale"]

    def hyperparameters(self, prior_scale: float) -> dict[str, Any]:
        """The values a fit used, for the posterior file (``context`` as its spec)."""
        used: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        context = self.context
        used |= {
            "prior_scale": prior_scale,
            "context": context if isinstance(context, str) else context.spec,
            "select_by": self.select_by.value,
        }
        return used


@dataclass
class FSVIPosterior(Posterior):
    """Mean-field Gaussian ``N(mean, diag var)`` trained by FSVI.

    ``last-layer``: ``mean``/``var`` ``[K, D(+1)]`` over ``W̃ = [W, b]`` (bias column last when
    ``head_bias``). ``all``: flat ``[P]`` over the network's parameters in ``named_parameters``
    order, ``parameters`` listing ``[name, shape]``. ``prior_var`` is the head prior ``σ_p²``,
    ``prior_scale`` its ``c``.
    """

    mean: torch.Tensor
    var: torch.Tensor
    subset: Subset
    head_bias: bool
    prior_var: float
    prior_scale: float
    hyperparameters: dict = field(default_factory=dict)
    parameters: list | None = None
    meta: dict = field(default_factory=dict)

    method: ClassVar[str] = "fsvi"

    @property
    def predictive(self) -> str:
        return "exact-last-layer" if self.subset is Subset.LAST_LAYER else "glm"

    # -- predictives --------------------------------------------------------------------------

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """Exact logits ``N(M̃ φ̃, diag(s̃ φ̃²))`` ``[N, K]`` for features ``phi [N, D]``."""
        if self.subset is not Subset.LAST_LAYER:
            raise BayescliError("this FSVI posterior covers all layers; predict from inputs")
        d = self.mean.shape[1] - int(self.head_bias)
        if phi.dim() != 2 or phi.shape[1] != d:
            raise BayescliError(f"features of shape {list(phi.shape)} do not fit a head with {d} inputs")
        mean, var = head_moments(phi.to(self.mean.dtype), self.mean, self.var, self.head_bias)
        return LogitGaussian(mean, var, exact=True)

    def _check_network(self, classifier: Classifier) -> None:
        shapes = [[n, list(p.shape)] for n, p in classifier.net.named_parameters()]
        if self.parameters is not None and shapes != self.parameters:
            raise BayescliError(
                "the network's parameters differ from the posterior's; load the checkpoint written with it"
            )

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """GLM logits ``N(f(x; μ), J diag(σ²) Jᵀ)`` for pixel-space ``x [N, ...]`` (``all`` only).

        ``classifier`` must carry the posterior means as its weights (the checkpoint that
        :func:`bayescli.training.fsvi.train` wrote); its Jacobians are taken in chunks of inputs.
        """
        if self.subset is Subset.LAST_LAYER:
            raise BayescliError("this FSVI posterior covers the last layer; predict from features")
        self._check_network(classifier)
        net, var = classifier.net, self.var
        xn = classifier.normalise(x.to(var.device))  # inputs arrive from the host
        chunk = max(1, JACOBIAN_ELEMENTS // (classifier.num_classes * var.numel()))
        means, covs = [], []
        for start in range(0, len(xn), chunk):
            f, jac = network_jacobian(net, xn[start : start + chunk])
            means.append(f)
            covs.append(torch.einsum("nkp,p,nlp->nkl", jac, var.to(jac.dtype), jac))
        cov = torch.cat(covs)
        return LogitGaussian(torch.cat(means), cov.diagonal(dim1=1, dim2=2).clone(), cov, exact=False)

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """BNN predictive [001:(18)]: logits ``[M, N, K]`` of the network at ``M`` draws from ``q``
        (weights drawn in chunks of at most ``JACOBIAN_ELEMENTS`` numbers)."""
        std, chunk = self.var.sqrt(), max(1, JACOBIAN_ELEMENTS // self.mean.numel())

        def draws() -> Iterator[torch.Tensor]:
            for m in range(0, num, chunk):
                shape = (min(chunk, num - m), *self.mean.shape)
                eps = torch.randn(shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device)
                yield self.mean + std * eps

        if self.subset is Subset.LAST_LAYER:
            phi_aug = (augment(phi) if self.head_bias else phi).to(self.mean.dtype)
            return torch.cat([torch.einsum("nd,mkd->mnk", phi_aug, w) for w in draws()])
        from torch.func import functional_call

        self._check_network(classifier)
        xn = classifier.normalise(x.to(self.mean.device))  # inputs arrive from the host
        out = []
        for theta in (t for block in draws() for t in block):
            params, offset = {}, 0
            for name, shape in self.parameters:
                size = math.prod(shape)
                params[name] = theta[offset : offset + size].reshape(shape)
                offset += size
            with torch.no_grad():
                out.append(functional_call(classifier.net, params, (xn,)))
        return torch.stack(out)

    def head_marginal(self, classifier: Classifier) -> FSVIPosterior:
        """The head block of an ``all`` posterior as a ``last-layer`` one (features at the means).

        Exact for the network whose feature weights are fixed at their means; the feature
        variances (``exp(feature_logvar_init)`` ≈ 2e−9 and shrinking, VI-SPEC B6.2) are dropped.
        """
        if self.subset is Subset.LAST_LAYER:
            return self
        self._check_network(classifier)
        head = classifier.head_name
        blocks, offset = {}, 0
        for name, shape in self.parameters:
            size = math.prod(shape)
            blocks[name] = (offset, size, shape)
            offset += size

        def block(t: torch.Tensor, name: str) -> torch.Tensor:
            start, size, shape = blocks[name]
            return t[start : start + size].reshape(shape)

        parts = [f"{head}.weight"] + ([f"{head}.bias"] if self.head_bias else [])
        mean = torch.cat([block(self.mean, n).reshape(len(block(self.mean, parts[0])), -1) for n in parts], 1)
        var = torch.cat([block(self.var, n).reshape(len(block(self.var, parts[0])), -1) for n in parts], 1)
        meta = {**self.meta, "head_marginal_of": "all"}
        return FSVIPosterior(
            mean, var, Subset.LAST_LAYER, self.head_bias, self.prior_var, self.prior_scale,
            dict(self.hyperparameters), None, meta,
        )  # fmt: skip

    # -- files --------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "var": self.var}

    def own_metadata(self) -> dict:
        own = {
            "head_bias": self.head_bias,
            "prior_var": self.prior_var,
            "prior_scale": self.prior_scale,
            "predictive": self.predictive,
            "exact": self.subset is Subset.LAST_LAYER,
            "hyperparameters": self.hyperparameters,
        }
        if self.parameters is not None:
            own["parameters"] = self.parameters
        return own

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> FSVIPosterior:
        mean, var = tensors["mean"], tensors["var"]
        if mean.shape != var.shape:
            raise ValueError(f"mean {list(mean.shape)} and var {list(var.shape)} differ")
        return cls(
            mean,
            var,
            Subset(meta["subset"]),
            bool(meta["head_bias"]),
            float(meta["prior_var"]),
            float(meta["prior_scale"]),
            dict(meta.get("hyperparameters", {})),
            meta.get("parameters"),
            cls.provenance(meta, _OWN_KEYS),
        )


_OWN_KEYS = {"head_bias", "prior_var", "prior_scale", "predictive", "exact", "hyperparameters", "parameters"}


# ---------------------------------------------------------------------------------------------
# post hoc: the last layer on frozen features
# ---------------------------------------------------------------------------------------------


def _check_fit_data(phi: torch.Tensor, labels: torch.Tensor | None, k: int, what: str) -> None:
    if labels is None:
        raise BayescliError(f"FSVI needs labelled {what} data")
    if not torch.isfinite(phi).all():
        raise BayescliError(f"{what} features contain NaN or inf; check the inputs and the checkpoint")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= k):
        raise BayescliError(f"{what} labels must lie in 0..{k - 1} for a {k}-class head")


def laplace_diag_variance(
    phi: torch.Tensor, mean: torch.Tensor, prior_var: float, bias: bool
) -> torch.Tensor:
    """``1 / (Σ_n p_nk(1 − p_nk) φ̃_nd² + 1/σ_p²)`` ``[K, D']`` for features ``phi [N, D]``: the
    diagonal-GGN Laplace variances of the head at ``mean`` (VI-SPEC B4's alternative init)."""
    h = torch.zeros_like(mean)
    for start in range(0, len(phi), 4096):
        rows = phi[start : start + 4096]
        p = (torch.addmm(mean[:, -1], rows, mean[:, :-1].T) if bias else rows @ mean.T).softmax(-1)
        sq = augment(rows.square()) if bias else rows.square()  # φ̃² (the bias column is 1)
        h += (p * (1 - p)).T @ sq
    return 1.0 / (h + 1.0 / prior_var)


def _fit_head(
    phi: torch.Tensor,
    labels: torch.Tensor,
    init: torch.Tensor,
    context: torch.Tensor,
    prior_var: float,
    bias: bool,
    cfg: FSVIConfig,
) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """Adam on ``(M̃, log s̃)`` from ``init`` and the initial variances; returns mean, var, curve."""
    n, k = len(phi), init.shape[0]
    began = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)  # batches, context draws, classes
    noise = generator(phi.device, cfg.seed)  # logit draws
    mean = init.to(phi.dtype).clone().requires_grad_(True)
    if cfg.head_var_init > 0:
        init_var = torch.full_like(mean, cfg.head_var_init * prior_var)
    else:
        init_var = laplace_diag_variance(phi, mean.detach(), prior_var, bias)
    logvar = init_var.log().requires_grad_(True)
    opt = torch.optim.Adam([mean, logvar], lr=cfg.lr, fused=True)
    steps = math.ceil(n / cfg.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * steps)
    ctx = (augment(context) if bias else context).double()
    c = min(cfg.context_points, len(ctx))
    subsample = 0 < cfg.kl_classes < k
    checks = FactorisationChecks(phi.device)
    curve = []
    for epoch in track(range(cfg.epochs), cfg.epochs, "fitting FSVI head"):
        # drawn on the host (the same batches on every device), moved once per epoch
        perm = torch.randperm(n, generator=gen).to(phi.device)
        sums = torch.zeros(3, dtype=torch.float64, device=phi.device)  # read once per epoch
        for start in range(0, n, cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            var = logvar.exp()
            # φ̃ of the batch, not column slices of the parameters: slices cost [K, D]-sized
            # copies forward and zero-filled scatters backward.
            phi_b = augment(phi[idx]) if bias else phi[idx]
            mu_b, v_b = phi_b @ mean.T, phi_b.square() @ var.T
            nll = expected_nll(mu_b, v_b, labels[idx], cfg.samples, noise)
            feats = ctx[torch.randperm(len(ctx), generator=gen)[:c]]
            classes = torch.randperm(k, generator=gen)[: cfg.kl_classes] if subsample else None
            kl = function_kl(
                feats, feats.to(mean.dtype) @ mean.T, var, prior_var, classes=classes, checks=checks
            )
            loss = nll + kl.to(nll.dtype) / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            sums += epoch_parts(loss, nll, kl) * len(idx) / n
        checks.check()
        curve.append(curve_row(epoch, sums, began))
    return mean.detach(), logvar.detach().exp(), curve


def fit_last_layer(
    phi: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Linear,
    context_phi: torch.Tensor,
    cfg: FSVIConfig,
    val_phi: torch.Tensor | None = None,
    val_labels: torch.Tensor | None = None,
) -> FSVIPosterior:
    """Post-hoc FSVI on frozen features: ``phi [N, D]`` with ``labels [N]``, a context pool
    ``context_phi [M, D]``, the MAP ``head`` as the initial mean. With validation features
    ``val_phi [V, D]``, ``val_labels [V]`` and ``prior_scale`` unset (and ``select`` not False),
    ``prior_scale`` is chosen on them (see the module docstring); ``post.selection``
    records how it was set. Runs on ``phi``'s device and dtype."""
    cfg = cfg.with_defaults(Subset.LAST_LAYER)
    cfg = replace(cfg, epochs=head_epochs(cfg.epochs or None, len(phi), cfg.batch_size))
    start = time.perf_counter()
    k = head.out_features
    _check_fit_data(phi, labels, k, "fitting")
    if len(context_phi) == 0 or not torch.isfinite(context_phi).all():
        raise BayescliError("the context features are empty or not finite; check context")
    has_val = val_phi is not None and val_labels is not None
    require(
        has_val or not cfg.select,
        "select=True chooses prior_scale on validation data: give labelled validation data (`val`)",
    )
    bias = head.bias is not None
    init = head_parameters(head).to(phi.device)
    norm = float((augment(phi) if bias else phi).double().square().sum(1).mean())
    require(norm > 0, "the fitting features are all zero; check the checkpoint and the head")
    context = context_phi.to(phi)

    def fitted(c: float) -> FSVIPosterior:
        mean, var, curve = _fit_head(phi, labels, init, context, c / norm, bias, cfg)
        post = FSVIPosterior(mean, var, Subset.LAST_LAYER, bias, c / norm, c, cfg.hyperparameters(c))
        post.meta["training_curve"] = curve
        return post

    if has_val and cfg.prior_scale is None and cfg.select is not False:
        _check_fit_data(val_phi, val_labels, k, "validation")
        val_phi, val_labels = val_phi.to(phi), val_labels.to(phi.device)

        def candidate(c: float) -> tuple[FSVIPosterior, Scored]:
            post = fitted(c)
            mu, v = head_moments(val_phi, post.mean.to(phi), post.var.to(phi), bias)
            return post, mc_predictive(mu, v, VAL_SAMPLES, cfg.seed)

        map_logits = head(val_phi.to(head.weight.dtype)).detach()
        post, sel = select_on_grid(
            "prior_scale",
            list(PRIOR_SCALE_GRID[Subset.LAST_LAYER]),
            candidate,
            val_labels,
            cfg.select_by,
            map_probs=map_logits.softmax(-1),
            map_logits=map_logits,
            principled=cfg.default_prior_scale,
        )
        best = min(row[cfg.select_by.value] for row in sel.curve)
        if best > sel.map_scores[cfg.select_by.value]:
            # No fitted prior scale beats MAP: return MAP itself, the end of the candidate set.
            point = init.to(phi.dtype)
            post = FSVIPosterior(
                point, torch.zeros_like(point), Subset.LAST_LAYER, bias, post.prior_var, post.prior_scale,
                post.hyperparameters,
            )  # fmt: skip
            by, lo, hi = cfg.select_by.value, sel.curve[0]["prior_scale"], sel.curve[-1]["prior_scale"]
            fallback = (
                f"no prior_scale in {lo:.3g}–{hi:.3g} improves on MAP's validation {by} "
                f"({sel.map_scores[by]:.4g} vs best {best:.4g}): the posterior is the point mass at the "
                "MAP head (zero variances)"
            )
            sel.map_fallback = True
            sel.add_warning(fallback)
        post.selection = sel
    else:
        c = cfg.default_prior_scale if cfg.prior_scale is None else cfg.prior_scale
        post = fitted(c)
        if cfg.prior_scale is not None:
            post.selection = unvalidated("prior_scale", c, "given explicitly", fixed=True)
        else:
            why = "select=False" if cfg.select is False else "no validation data"
            post.selection = unvalidated(
                "prior_scale",
                c,
                f"the principled default ({why}): c = {c:g}, a prior logit variance of {c:g} at a "
                "typical training input (VI-SPEC B4, FSVI-code prior_var 1)",
            )
    post.meta |= {
        "fit_seconds": time.perf_counter() - start,
        "n_data": len(phi),
        "feature_norm_sq": norm,
        "context_pool": len(context_phi),
    }
    return post


def fit(source: FitSource, settings: FSVIConfig) -> FSVIPosterior:
    """Post-hoc last-layer FSVI on ``source``'s pretrained classifier (``subset == "last-layer"``).

    The fitting set's features, those of ``context_pool`` context inputs drawn once from
    ``settings.context`` and, for selection, the validation set's all come from ``source``
    (one backbone pass per set, shared with other methods fitted on it); then the head is fitted
    by :func:`fit_last_layer`. A data ``context`` must arrive as :class:`~bayescli.data.Data`
    (see :meth:`FSVIConfig.data_specs`).
    """
    if Subset(settings.subset) is not Subset.LAST_LAYER:
        raise BayescliError(
            "post-hoc FSVI fits the last layer (subset last-layer); train all layers from scratch "
            "with bayescli.training.fsvi.train"
        )
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(settings.seed)
    feats = source.features()
    sampler = ContextSampler(settings.context, source.data, gen, settings.context_pool, settings.seed)
    spec = settings.context if isinstance(settings.context, str) else settings.context.spec
    pool = ArrayData(
        sampler(settings.context_pool),
        None,
        source.data.class_names,
        {"spec": f"fsvi-context:{spec}", "n": settings.context_pool, "seed": settings.seed},
    )
    ctx = source.features(pool)
    validate = source.val is not None and settings.prior_scale is None and settings.select is not False
    val = source.val_features() if validate else None
    device = source.device
    post = fit_last_layer(
        feats.phi.to(device),
        feats.labels.to(device),
        source.classifier.head,
        ctx.phi.to(device),
        settings,
        None if val is None else val.phi.to(device),
        None if val is None else val.labels.to(device),
    )
    post.meta["fit_seconds"] = time.perf_counter() - start
    post.meta["feature_seconds"] = feats.seconds + ctx.seconds + (0.0 if val is None else val.seconds)
    return post
