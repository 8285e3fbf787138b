"""FSVI from scratch (VI-SPEC B1): mean-field VI over every parameter of a builtin network.

One feature sample per step (R = 1, [001:(14)]); the prior is the same network linearised about a
fixed random initialisation ``θ0`` (VI-SPEC B6.1), whose features and logits at the context
points give the prior's kernel and mean; the context is ``batch_context_points`` points of the
batch plus ``context_points`` draws from ``p_Xc``. The function-space KL and the expected
log-likelihood are the post-hoc fit's (:mod:`bayescli.posterior.vi.fsvi_objective`).

``prior_scale`` is chosen on validation data only with ``select=True`` (each grid value trains a
network); otherwise it is the given value or the from-scratch default ``c = 300``.
"""

from __future__ import annotations

import copy
import math
import time

import torch
from torch import nn

from bayescli.data import ArrayData
from bayescli.devices import generator
from bayescli.errors import BayescliError, require
from bayescli.models.specs import Classifier, ModelSpec, build_network, builtin_names, last_linear_name
from bayescli.options import Subset
from bayescli.posterior.gaussian import augment
from bayescli.posterior.selection import Scored, select_on_grid, unvalidated
from bayescli.posterior.vi.fsvi import PRIOR_SCALE_GRID, VAL_SAMPLES, FSVIConfig, FSVIPosterior
from bayescli.posterior.vi.fsvi_context import ContextSampler
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
from bayescli.training.classifier import channel_stats, checkpoint_metadata

PRIOR_NORM_ROWS = 2048  # training inputs that set mean ‖φ̃‖² from scratch


class _StopAtHead(Exception):
    """Raised by a hook once the head's input is known."""


def _features(clf: Classifier, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Head input ``φ(x; params)`` ``[N, D]`` for pixel-space ``x`` under substituted parameters."""
    from torch.func import functional_call

    captured: list[torch.Tensor] = []

    def grab(_module: nn.Module, args: tuple) -> None:
        captured.append(args[0])
        raise _StopAtHead

    handle = clf.head.register_forward_pre_hook(grab)
    try:
        functional_call(clf.net, params, (clf.normalise(x),))
    except _StopAtHead:
        pass
    finally:
        handle.remove()
    return captured[0]


class WholeNetQ:
    """``q = N(μ, diag exp(logvar))`` over every parameter of ``clf`` (``μ`` = its parameters), the
    prior net ``prior`` (``θ0``, the linearisation point of p) and the head prior ``σ_p²``."""

    def __init__(self, clf: Classifier, prior: Classifier, logvar: dict[str, torch.Tensor], prior_var: float):
        self.clf, self.prior, self.logvar, self.prior_var = clf, prior, logvar, prior_var
        self.checks = FactorisationChecks(next(clf.parameters()).device)
        self.params = dict(clf.net.named_parameters())
        self.bias = clf.head.bias is not None
        head = clf.head_name
        self.head_names = [f"{head}.weight"] + ([f"{head}.bias"] if self.bias else [])

    def head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Head mean and variance ``([K, D'], [K, D'])`` (bias column last)."""
        mean = [self.params[n].reshape(self.params[n].shape[0], -1) for n in self.head_names]
        var = [self.logvar[n].exp().reshape(self.params[n].shape[0], -1) for n in self.head_names]
        return torch.cat(mean, 1), torch.cat(var, 1)

    def features(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Features ``[N, D]`` of ``x`` under one draw of the feature parameters (R = 1)."""
        sampled = {
            name: p if name in self.head_names
            else p + (0.5 * self.logvar[name]).exp() * torch.randn(p.shape, generator=generator).to(p)
            for name, p in self.params.items()
        }  # fmt: skip
        return _features(self.clf, sampled, x)

    def kl(self, h_q: torch.Tensor, x_c: torch.Tensor) -> torch.Tensor:
        """Function-space KL at context inputs ``x_c`` whose sampled features are ``h_q [C, D]``:
        q's head Gaussian on ``h_q`` vs the prior net's features and logits (float64)."""
        with torch.no_grad():
            h_p = self.prior.features(x_c)
            m_p = self.prior.head(h_p)
        m_head, v_head = self.head()
        f_q = (augment(h_q) if self.bias else h_q).double()
        f_p = (augment(h_p) if self.bias else h_p).double()
        return function_kl(f_q, f_q @ m_head.double().T, v_head, self.prior_var, f_p, m_p, checks=self.checks)

    def terms(
        self,
        xb: torch.Tensor,
        yb: torch.Tensor,
        x_ctx: torch.Tensor,
        batch_context: int,
        samples: int,
        generator: torch.Generator,
        noise: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expected NLL of the batch and the KL on ``[xb[:batch_context]; x_ctx]``, both from one
        feature sample (a joint forward pass)."""
        nb, b = min(batch_context, len(xb)), len(xb)
        x_all = torch.cat([xb, x_ctx])
        h_all = self.features(x_all, generator)
        m_head, v_head = self.head()
        mu_b, v_b = head_moments(h_all[:b], m_head, v_head, self.bias)
        nll = expected_nll(mu_b, v_b, yb, samples, noise)
        kl = self.kl(torch.cat([h_all[:nb], h_all[b:]]), torch.cat([x_all[:nb], x_all[b:]]))
        return nll, kl


def _train_all(
    spec: ModelSpec,
    train: ArrayData,
    cfg: FSVIConfig,
    prior_scale: float,
    device: torch.device,
) -> tuple[Classifier, torch.Tensor, float, list[dict]]:
    """One from-scratch FSVI run; returns the classifier (means), flat variances, σ_p², curve."""
    began = time.perf_counter()
    torch.manual_seed(cfg.seed)
    k, n = train.num_classes, len(train)
    net = build_network(spec, k, train.input_shape, {})
    mean, std = channel_stats(train)
    clf = Classifier(net, last_linear_name(net), mean, std).to(device)
    prior = copy.deepcopy(clf).eval().requires_grad_(False)  # θ0: the linearisation point of p
    bias = clf.head.bias is not None
    with torch.no_grad():
        h0 = prior.features(train.inputs(slice(0, PRIOR_NORM_ROWS)).to(device))
        prior_var = prior_scale / float((h0.double().square().sum(1) + int(bias)).mean())
    logvar = {
        name: torch.full_like(p, cfg.feature_logvar_init).requires_grad_(True)
        for name, p in clf.net.named_parameters()
    }
    q = WholeNetQ(clf, prior, logvar, prior_var)
    with torch.no_grad():
        head_logvar = math.log(cfg.head_var_init * prior_var)
        for name in q.head_names:
            logvar[name].fill_(head_logvar)
    opt = torch.optim.Adam([*q.params.values(), *logvar.values()], lr=cfg.lr)
    steps = math.ceil(n / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps, pct_start=0.15
    )
    gen = torch.Generator().manual_seed(cfg.seed)  # batches, context draws, weight noise
    noise = generator(device, cfg.seed)  # logit draws
    sampler = ContextSampler(cfg.context, train, gen, cfg.context_pool, cfg.seed)
    curve = []
    for epoch in track(range(cfg.epochs), cfg.epochs, f"training {spec} (FSVI)"):
        clf.train()
        perm = torch.randperm(n, generator=gen)  # host indices: the inputs live on the host
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # read once per epoch
        for start in range(0, n, cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            xb, yb = train.inputs(idx).to(device), train.y[idx].to(device)
            x_ctx = sampler(cfg.context_points).to(device)
            nll, kl = q.terms(xb, yb, x_ctx, cfg.batch_context_points, cfg.samples, gen, noise)
            loss = nll + kl.to(nll.dtype) / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            sums += epoch_parts(loss, nll, kl) * len(idx) / n
        q.checks.check()
        curve.append(curve_row(epoch, sums, began))
    clf.eval()
    var = torch.cat([logvar[name].detach().exp().reshape(-1) for name in q.params])
    return clf, var, prior_var, curve


def train(
    model_spec: str,
    train: ArrayData,
    val: ArrayData | None,
    settings: FSVIConfig,
    device: torch.device,
) -> tuple[Classifier, dict, FSVIPosterior]:
    """FSVI from scratch on a builtin net: mean-field over all parameters, one feature sample per
    step, prior = the net linearised about a fixed random initialisation, context = batch points
    plus ``p_Xc`` draws (a data ``context`` as :class:`~bayescli.data.Data` in ``train``'s pixel
    space). Returns the classifier (means as weights), checkpoint metadata in
    :func:`bayescli.training.classifier.train_classifier`'s format, and the ``all`` posterior,
    whose ``selection`` records how ``prior_scale`` was set."""
    cfg = settings.with_defaults(Subset.ALL)  # always all layers
    spec = ModelSpec.parse(model_spec)
    if spec.kind != "builtin":
        raise BayescliError(f"FSVI trains builtin models only ({', '.join(builtin_names())}); got {spec}")
    if train.y is None:
        raise BayescliError(f"{train.spec} has no labels; training needs labelled data")
    require(
        not cfg.select or (val is not None and val.y is not None),
        "select=True chooses prior_scale on validation data: give labelled validation data (`val`)",
    )
    device = torch.device(device)
    start = time.perf_counter()
    if cfg.select:

        def candidate(c: float) -> tuple[tuple, Scored]:
            run = _train_all(spec, train, cfg, c, device)
            clf, var, prior_var, _ = run
            head = _all_posterior(clf, var, prior_var, c, cfg).head_marginal(clf)
            with torch.no_grad():
                phi = torch.cat([clf.features(xb.to(device)) for xb, _ in val.batches(512)])
            mu, v = head_moments(phi, head.mean.to(phi), head.var.to(phi), head.head_bias)
            return (c, *run), mc_predictive(mu, v, VAL_SAMPLES, cfg.seed)

        grid = list(PRIOR_SCALE_GRID[Subset.ALL])
        best, sel = select_on_grid(
            "prior_scale", grid, candidate, val.y.to(device), cfg.select_by,
            principled=cfg.default_prior_scale, extensions=0,
        )  # fmt: skip
        c, clf, var, prior_var, curve = best
    else:
        c = cfg.default_prior_scale if cfg.prior_scale is None else cfg.prior_scale
        clf, var, prior_var, curve = _train_all(spec, train, cfg, c, device)
        rule = "given explicitly" if cfg.prior_scale is not None else f"the from-scratch default c = {c:g}"
        sel = unvalidated("prior_scale", c, rule, fixed=cfg.prior_scale is not None)
    post = _all_posterior(clf, var, prior_var, c, cfg)
    post.selection = sel
    post.meta |= {
        "fit_seconds": time.perf_counter() - start,
        "n_data": len(train),
        "training_curve": curve,
    }
    normalisation = (clf.mean.tolist(), clf.std.tolist())
    training = {"method": "fsvi", **post.hyperparameters}
    loss = [row["objective"] for row in curve]
    meta = checkpoint_metadata(spec, clf, train, val, device, normalisation, training, loss)
    return clf, meta, post


def _all_posterior(
    clf: Classifier, var: torch.Tensor, prior_var: float, prior_scale: float, cfg: FSVIConfig
) -> FSVIPosterior:
    mean = torch.cat([p.detach().reshape(-1) for p in clf.net.parameters()])
    shapes = [[n, list(p.shape)] for n, p in clf.net.named_parameters()]
    used = cfg.hyperparameters(prior_scale)
    return FSVIPosterior(
        mean, var, Subset.ALL, clf.head.bias is not None, prior_var, prior_scale, used, shapes
    )
