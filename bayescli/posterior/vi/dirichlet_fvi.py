"""Dirichlet function-space VI (VI-SPEC A; seed ``function-space-vi-dirichlet-prior``, "[000]").

A stochastic classifier — an ensemble, MC dropout, a mean-field Gaussian or a point estimate —
gives ``M`` function samples ``f⁽ᵐ⁾(x) = softmax(logits⁽ᵐ⁾(x))`` per input. Training minimises, per
minibatch (eqs. 1, 2, 4 with VI-SPEC A6.4's reading of the KL scaling),

    ℓ = (1/B) Σ_b (1/M) Σ_m −ln f⁽ᵐ⁾_{y_b}(x_b) + (τ/N) Σ_{s∈S} KL_s,

over the index set ``S`` = the batch (plus, optionally, ``index_data`` points), with eq. 6's Monte
Carlo KL between the posterior Dirichlet estimated from the samples and the prior ``Dir(β)``:

    KL_s = (1/M) Σ_m [ln Dir(f̃_s⁽ᵐ⁾ | sg(α_s)) − ln Dir(f̃_s⁽ᵐ⁾ | β)],   f̃ = (1 − γ) f + γ/K, γ = 1e−4.

``α_s = z_s ᾱ_s``: ``ᾱ_s`` the mean of the ``f̃_s⁽ᵐ⁾``, ``z_s`` Minka's fixed-mean precision (eq. 5,
App. F; :func:`~bayescli.dirichlet.fit_precision_vectorised`) clamped to
``[K, N]``, ``z = N`` for ``M = 1``; ``α`` is held constant (stop-gradient), so gradients flow
through the samples only. The objective lives in :mod:`~bayescli.posterior.vi.dirichlet_fvi_objective`,
the families' samplers in :mod:`~bayescli.posterior.vi.dirichlet_fvi_samples`.

Families (:func:`fit`: the head over the backbone's features ``φ``; the from-scratch trainer
:func:`bayescli.training.dirichlet_fvi.train`: the whole network):

* ``ensemble`` (default) — ``M`` heads or networks trained jointly in one loss (the KL couples
  them through ``ᾱ`` and ``z``). Post-hoc heads start at ``W_MAP + N(0, (init_scale·rms W_MAP)²)``:
  identical members would get identical gradients. The ``M`` heads are one batched matmul.
* ``mfvi`` — a mean-field Gaussian. Post hoc: ``q(W) = N(W_MAP, diag σ²)`` with logit samples by
  local reparameterisation ``N(Wφ + b, diag(σ_W²φ² + σ_b²))`` (exact for a linear head); from
  scratch: one weight draw per sample, shared by the batch. ``σ₀ = init_scale·rms`` of each
  parameter tensor.
* ``map`` — ``M = 1``: the KL is then a uniform-target cross-entropy, i.e. label smoothing with
  ``ε = Kc/(1 + Kc)``, ``c = τB/N`` (VI-SPEC A1).
* ``dropout`` — Bernoulli masks (rate ``dropout``): post hoc on ``φ``; from scratch on the
  inputs of every linear layer but the first parametrised layer.

``τ = 0`` trains the weight-space counterpart (MAP, deep ensemble, MC dropout) in the same loop.

Choosing ``τ`` (:func:`fit`). The KL's weight per step is ``c = τB/N``; [000]'s ``τ`` =
:func:`default_tau` was tuned at ``N ≈ 60,000``, so without validation data ``τ`` is the seed's
effective weight at this ``N``: :func:`principled_tau` ``= default_tau(K)·N/60,000``. With
validation data (and ``tau`` unset), ``τ`` is chosen on it (:mod:`bayescli.posterior.selection`)
over decades from ``10·τ_p`` down to ``10⁻³·τ_p``, scored on the Dirichlet mean ``α/α₀``. The
MAP limit of this family is ``τ → 0`` with no refit: at ``τ = 0`` the heads are still refitted by
plain NLL from the MAP head (the weight-space counterpart), which on a well-trained net scores
0.005–0.009 worse validation NLL than MAP (digits MLP, measured: Adam's constant-rate refit
sharpens an annealed head). So the search also scores the MAP head itself (``map`` family,
``τ = 0``, no refit; its Dirichlet mean is MAP's softmax smoothed by ``γ``, within ``−ln(1 − γ)``
≈ 1e−4 NLL of MAP) and keeps it when no refit beats it (``selection.map_fallback``): the chosen
posterior is never worse than MAP on validation by more than that.

The posterior and its Dirichlet predictive (VI-SPEC A2: Minka's fit to the ``M`` test-time samples
and its Laplace-bridge logit Gaussian) live in :mod:`~bayescli.posterior.vi.dirichlet_fvi_posterior`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from bayescli.data import Data
from bayescli.data.shifts import SYNTHETIC_OOD, parse_angles, rotate, synthetic_ood
from bayescli.devices import generator
from bayescli.errors import BayescliError, require
from bayescli.fitting.fit_source import FitSource
from bayescli.models.features import Features
from bayescli.options import Subset
from bayescli.posterior.selection import Scored, log_grid, select_on_grid, unvalidated
from bayescli.posterior.vi.budget import head_epochs
from bayescli.posterior.vi.dirichlet_fvi_objective import optimise, parse_beta
from bayescli.posterior.vi.dirichlet_fvi_posterior import DirichletFVIPosterior
from bayescli.posterior.vi.dirichlet_fvi_samples import head_logits, head_stds, init_head
from bayescli.posterior.vi.dirichlet_fvi_settings import (
    DirichletFVIConfig,
    principled_tau,
)

# held-out search: τ_p·10^i for i = SELECT_LOW … SELECT_HIGH (10⁻³·τ_p … 10·τ_p; decades, as every
# other method's grid: each value is a fit of M heads). At 10⁻³·τ_p the
# KL's label-smoothing weight is ε ≈ K·default_tau·B/60,000·10⁻³ ≲ 5e−5 (B = 256): the refit is
# then within ~1e−4 validation NLL of τ = 0 (digits MLP: 0.0082 vs 0.0080 above MAP at 1e−5, 1e−4)
SELECT_STEP = 10.0
SELECT_LOW, SELECT_HIGH = -3, 1
TAU_GRID = (0.1, 0.3, 1.0, 3.0, 10.0)  # multiples of default_tau tried from scratch by select=True
INDEX_POOL_MAX = 10_000  # synthetic index pools are capped at this many inputs
PRINCIPLED_RULE = (
    "tau = default_tau(K)*N/60000, the seed's effective KL weight tau*B/N at this N "
    "(default_tau: 1 for K <= 10, 0.1 for K <= 100, 10/K beyond, tuned at N = 60000)"
)


def index_source(index_data: str | Data | None, train: Data, seed: int) -> list[float] | Data | None:
    """``index_data`` resolved: rotation angles, an unlabelled pool (synthetic or the caller's
    :class:`~bayescli.data.Data`, shaped like ``train``'s inputs), or ``None`` (the batch only)."""
    if not index_data:
        return None
    if isinstance(index_data, str):
        if index_data.startswith("rotate:"):
            require(len(train.input_shape) == 3, "index_data rotate: needs image inputs [C, H, W]")
            return parse_angles(index_data[len("rotate:") :])
        if index_data in SYNTHETIC_OOD:
            return synthetic_ood(index_data, train, min(len(train), INDEX_POOL_MAX), seed)
        raise BayescliError(
            f"index_data '{index_data}' is a data spec, which the fit does not load; load it and set "
            "index_data to the Data (DirichletFVIConfig.data_specs() lists the specs to load)"
        )
    require(
        index_data.input_shape == train.input_shape,
        f"index_data {index_data.spec} has inputs {list(index_data.input_shape)}, the training data "
        f"{list(train.input_shape)}; use data of the same shape",
    )
    return index_data


def dirichlet_predictive(alpha: torch.Tensor) -> Scored:
    """The Dirichlet mean ``α/α₀`` ``[N, K]`` (the predictive probabilities) of ``alpha [N, K]``
    with its float64 log ``log α − log α₀``, which no rounding of the mean to 0 touches."""
    a = alpha.double()
    return Scored(alpha / alpha.sum(-1, keepdim=True), a.log() - a.sum(-1, keepdim=True).log())


def dirichlet_nll(alpha: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean NLL of the Dirichlet mean ``α/α₀`` (the predictive probabilities) on ``labels``."""
    log_mean = alpha.log() - alpha.sum(-1, keepdim=True).log()
    return float(-log_mean.gather(1, labels[:, None].to(alpha.device)).mean())


# ---------------------------------------------------------------------------------------------
# post hoc: the head over the backbone's features
# ---------------------------------------------------------------------------------------------


def fit(source: FitSource, settings: DirichletFVIConfig) -> DirichletFVIPosterior:
    """Fit a last-layer Dirichlet fVI posterior to a pretrained classifier (VI-SPEC A4).

    The fitting set's features (``phi [N, D]``), the validation set's and the index set's come
    from ``source`` (computed once, shared with other methods fitted on it); the head is then
    trained over them at the ``tau`` of the module docs: the given one, the one chosen on
    ``source.val``, or :func:`principled_tau`. ``post.selection`` records which. The CLI adds
    the provenance keys to ``meta`` afterwards.
    """
    start_time = time.perf_counter()
    cfg = settings
    require(
        cfg.subset == Subset.LAST_LAYER.value,
        "the post-hoc Dirichlet fVI fit trains the last layer (subset last-layer); train whole "
        "networks from scratch with bayescli.training.dirichlet_fvi.train",
    )
    require(
        not cfg.select or source.val is not None,
        "select=True chooses tau on validation data; give validation data (`val`) or unset select",
    )
    pool = index_source(cfg.index_data, source.data, cfg.seed)
    device = source.device
    head = source.classifier.head
    feats = source.features()
    phi, labels = feats.phi.to(device), feats.labels.to(device)
    beta = parse_beta(cfg.beta, source.num_classes).to(device)
    if isinstance(pool, list):  # rotated copies of the fitting set, row-aligned with it
        rotated = [source.data.map_inputs(lambda x, a=a: rotate(x, a)) for a in pool]
        extra = [source.features(r).phi.to(device) for r in rotated]
    elif pool is not None:
        extra = [source.features(pool).phi.to(device)]
    else:
        extra = []
    n = len(labels)
    epochs = head_epochs(cfg.epochs, n, cfg.batch_size)

    def fit_at(tau: float) -> DirichletFVIPosterior:
        init_gen = torch.Generator().manual_seed(cfg.seed)
        raw = {
            name: value.to(device).requires_grad_()
            for name, value in init_head(cfg.family, head, cfg.members, cfg.init_scale, init_gen).items()
        }
        noise = generator(device, cfg.seed + 1)
        samples = cfg.step_samples

        def forward(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            params = head_stds(raw)
            idx = idx.to(device)
            logits = head_logits(cfg.family, params, phi[idx], samples, noise, cfg.dropout)
            if not extra:
                return logits, None
            if isinstance(pool, list):  # rotated copies of the same batch
                pts = torch.cat([e[idx] for e in extra])
            else:  # a batch-sized draw from the pool
                pts = extra[0][torch.randint(len(extra[0]), (len(idx),), generator=noise, device=device)]
            return logits, head_logits(cfg.family, params, pts, samples, noise, cfg.dropout)

        history = optimise(list(raw.values()), forward, labels, cfg, tau, beta, f"fVI head τ={tau:g}", epochs)
        params = {name: value.detach() for name, value in head_stds(raw).items()}
        post = DirichletFVIPosterior(
            cfg.family,
            Subset.LAST_LAYER,
            params,
            beta,
            cfg.num_samples,
            n,
            tau,
            cfg.dropout,
            cfg.seed,
            cfg.smoothing,
        )
        post.meta["history"] = history
        return post

    principled = principled_tau(source.num_classes, n)
    if cfg.tau is not None:
        post = fit_at(cfg.tau)
        post.selection = unvalidated("tau", cfg.tau, "given explicitly", fixed=True)
    elif source.val is None or cfg.select is False:
        post = fit_at(principled)
        post.selection = unvalidated("tau", principled, PRINCIPLED_RULE)
    else:
        post = _select_tau(fit_at, principled, source.val_features(), head, beta, n, cfg)
    settings_record = cfg.record()
    post.meta |= {
        "config": settings_record,
        "epochs": epochs,
        "index_data": settings_record["index_data"],
        "fit_seconds": time.perf_counter() - start_time,
        "feature_seconds": feats.seconds,
    }
    return post


def map_limit(
    head: nn.Linear, beta: torch.Tensor, n_data: int, cfg: DirichletFVIConfig
) -> DirichletFVIPosterior:
    """The family's MAP limit: the MAP head itself as a ``map`` posterior (``τ = 0``, no refit).

    Its Dirichlet mean is ``(1 − γ)·softmax(MAP logits) + γ/K``, so its NLL is within
    ``−ln(1 − γ)`` (≈ 1e−4) of MAP's on any data.
    """
    params = init_head("map", head, 1, 0.0, torch.Generator())
    post = DirichletFVIPosterior(
        "map", Subset.LAST_LAYER, params, beta, 1, n_data, 0.0, cfg.dropout, cfg.seed, cfg.smoothing
    )
    post.meta["history"] = []
    return post


def _select_tau(
    fit_at: Callable[[float], DirichletFVIPosterior],
    principled: float,
    val: Features,
    head: nn.Linear,
    beta: torch.Tensor,
    n_data: int,
    cfg: DirichletFVIConfig,
) -> DirichletFVIPosterior:
    """``τ`` on the validation features (module docs): the grid's best refit, or the MAP head
    when none beats it. Sets ``selection`` (with the MAP head's scores as ``map_limit``)."""
    val_phi, val_y = val.phi, val.labels

    def candidate(tau: float) -> tuple[DirichletFVIPosterior, Scored]:
        post = fit_at(tau)
        return post, dirichlet_predictive(post.alpha_features(val_phi))

    best, sel = select_on_grid(
        "tau",
        log_grid(principled, SELECT_LOW, SELECT_HIGH, SELECT_STEP),
        candidate,
        val_y,
        cfg.select_by,
        map_probs=torch.softmax(val.logits.double(), -1),
        map_logits=val.logits,
        principled=principled,
        map_side="low",
    )
    limit = map_limit(head, beta, n_data, cfg)
    limit_scores = dirichlet_predictive(limit.alpha_features(val_phi)).scores(val_y)
    by = cfg.select_by.value
    chosen_score = next(row[by] for row in sel.curve if row["tau"] == sel.chosen)
    sel.extra["map_limit"] = {"tau": 0.0, "refit": False, **limit_scores}
    if limit_scores[by] <= chosen_score:
        best = limit
        sel.chosen = 0.0
        sel.map_point = True
        sel.map_fallback = True  # no τ beat the MAP head, which is returned instead
        sel.warning = (
            f"no tau in {sel.curve[0]['tau']:.3g}–{sel.curve[-1]['tau']:.3g} improves on the MAP head's "
            f"validation {by} ({limit_scores[by]:.4g} vs {chosen_score:.4g} at best): the posterior is "
            "the MAP head (map family, tau = 0, no refit)"
        )
    elif sel.chosen == sel.curve[0]["tau"]:
        # the smallest τ searched is the weight-space refit (τ → 0) to ≲ 1e−5 NLL, and it beats the
        # MAP head: nothing lies beyond this edge, so selection's "reaches the MAP limit" does not apply
        sel.map_point = False
        sel.warning = (
            f"tau = {sel.chosen:.3g} is the smallest value searched: on this validation set the refit "
            f"without the KL term (weight-space limit) scores best ({by} {chosen_score:.4g}, MAP head "
            f"{limit_scores[by]:.4g})"
        )
    best.selection = sel
    return best
