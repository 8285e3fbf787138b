"""The MNVI objective and its optimisation (VI-SPEC C1, [002:(16)-(18)]).

The per-datapoint objective ``ℓ = mean_batch E_{h~N(μ, diag v)}[−ln p(y | h)] + (κ/N)·KL``
with the KL of [002:(17)] against ``N(0, σ²)``, the MC predictive [002:(20)], and the two
optimisation loops every MNVI fit runs: :func:`fit_head_once` on cached last-layer features and
:func:`fit_network_once` through moment propagation (post hoc from a checkpoint, or from scratch
by :mod:`bayescli.training.mnvi`). AMSGrad without weight decay, gradients rescaled to ∞-norm
``clip`` (VI-SPEC C6.6), learning rate ×0.1 after half the epochs ([002:Table 4] MNIST).

The likelihood is the classifier's: ``categorical`` (``−ln softmax(h)_y``, labels ``[B]``; its
expectation by ``samples`` reparameterised draws, [002:(16)]) or ``bernoulli`` (a sigmoid per
label, labels ``[B, K]``: ``Σ_k E[BCE(h_k, y_k)]``, one 1-D integral per label, computed by
quadrature in :mod:`bayescli.posterior.vi.bernoulli_expectations` — exact and differentiable, so
``samples`` is unused). Its predictive is ``E[σ(h_k)]`` per label, by the same quadrature.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from bayescli.data import Data
from bayescli.devices import generator
from bayescli.models.specs import Classifier
from bayescli.posterior.selection import Scored
from bayescli.posterior.vi.bernoulli_expectations import expected_log_likelihood, sigmoid_predictive
from bayescli.posterior.vi.mnvi_settings import MNVIConfig
from bayescli.posterior.vi.moments import MomentPropagator
from bayescli.posterior.vi.softmax_expectations import log_mean_softmax
from bayescli.progress import track

KL_EPS = 1e-10  # inside the KL's logarithm [002:App A]
_VAR_FLOOR = 1e-20  # keeps √v differentiable where a logit variance is exactly 0


def expand_noise(a: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Per-input-unit ``a [in]`` broadcast to ``weight [out, in/groups, *kernel]``."""
    out, per_group = weight.shape[:2]
    if groups == 1:
        full = a.view(1, per_group)
    else:
        full = a.view(groups, 1, per_group).expand(groups, out // groups, per_group).reshape(out, per_group)
    return full.view(*full.shape, *([1] * (weight.dim() - 2)))


def kl_divergence(
    weight: torch.Tensor, a: torch.Tensor, prior_var: float, groups: int = 1, eps: float = KL_EPS
) -> torch.Tensor:
    """``KL(q ‖ N(0, σ²))`` of one layer [002:(17)] (scalar, summed in float64).

    ``weight [out, in/groups, *kernel]`` are the means ``m``, ``a [in]`` the noise variances.
    Written as ``½[P(ln σ² − 1) − Σ ln(a m² + ε) + Σ_j (1+a_j) c_j / σ²]`` with the column sums
    ``c_j = Σ_i m_ij²``: three passes over the weights instead of a dozen (it runs every step).
    """
    m2 = weight.square()
    log_term = torch.log(torch.addcmul(m2.new_full((), eps), expand_noise(a, weight, groups), m2))
    out, per_group = weight.shape[:2]
    col = m2.reshape(groups, out // groups, per_group, -1).sum((1, 3)).reshape(-1)  # c_j [in]
    quad = torch.dot(1 + a, col) / prior_var
    const = weight.numel() * (math.log(prior_var) - 1)
    return 0.5 * (const - log_term.sum(dtype=torch.float64) + quad.double())


def expected_nll(
    mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor, samples: int, generator: torch.Generator
) -> torch.Tensor:
    """``mean_b (1/S) Σ_s −ln softmax(μ_b + √v_b ⊙ ε_s)_{y_b}`` for logits ``[B, K]`` [002:(16)]."""
    eps = torch.randn((samples, *mean.shape), generator=generator, dtype=mean.dtype, device=mean.device)
    h = torch.addcmul(mean, var.clamp_min(_VAR_FLOOR).sqrt(), eps)
    return F.cross_entropy(h.reshape(-1, mean.shape[-1]), labels.repeat(samples))


def expected_bce(mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``mean_b Σ_k E_{h~N(μ_bk, v_bk)}[BCE(h, y_bk)]`` for logits ``mean, var [B, K]`` and
    multi-label ``labels [B, K]`` in ``{0, 1}`` (quadrature: exact, differentiable)."""
    return -expected_log_likelihood(mean, var, labels).mean().to(mean.dtype)


def batch_nll(
    mean: torch.Tensor,
    var: torch.Tensor,
    labels: torch.Tensor,
    samples: int,
    generator: torch.Generator,
    likelihood: str,
) -> torch.Tensor:
    """The expected NLL per datapoint of ``likelihood`` (module docs) for logits ``[B, K]``."""
    if likelihood == "bernoulli":
        return expected_bce(mean, var, labels)
    return expected_nll(mean, var, labels, samples, generator)


def _rescale(params: list[torch.Tensor], clip: float) -> None:
    torch.nn.utils.clip_grad_norm_(params, clip, norm_type=math.inf)


def _optimiser(groups: list[dict], cfg: MNVIConfig, steps_per_epoch: int) -> tuple:
    opt = torch.optim.Adam([g for g in groups if g["params"]], amsgrad=True, weight_decay=0.0)
    milestone = max(1, cfg.epochs // 2) * steps_per_epoch
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [milestone], gamma=0.1) if cfg.epochs > 1 else None
    return opt, sched


def _batches(
    n: int, batch_size: int, generator: torch.Generator, device: torch.device | None = None
) -> Iterator[torch.Tensor]:
    """Index batches of a seeded permutation, drawn on the host (the same batches on every
    device) and moved to ``device`` once per epoch."""
    perm = torch.randperm(n, generator=generator).to(device)
    for start in range(0, n, batch_size):
        yield perm[start : start + batch_size]


def validation_predictive(
    mean: torch.Tensor,
    var: torch.Tensor,
    samples: int,
    generator: torch.Generator,
    likelihood: str = "categorical",
) -> Scored:
    """The MC predictive ``p = (1/S) Σ_s softmax(μ + √v ⊙ ε_s)`` [002:(20)] of Gaussian logits
    ``mean, var [N, K]`` → ``[N, K]`` with its log-probabilities (:func:`log_mean_softmax`), chunked
    over inputs; for ``likelihood="bernoulli"`` the per-label ``E[σ(h_k)]`` and its log-odds by
    quadrature (the limit of the ``mc`` link; no draws)."""
    if likelihood == "bernoulli":
        return sigmoid_predictive(mean, var)
    k = mean.shape[-1]
    chunk = max(1, 2**22 // (samples * k))
    probs, log_probs = [], []
    for start in range(0, len(mean), chunk):
        sl = slice(start, start + chunk)
        eps = torch.randn(
            (samples, *mean[sl].shape), generator=generator, dtype=mean.dtype, device=mean.device
        )
        draws = mean[sl] + var[sl].clamp_min(0).sqrt() * eps
        probs.append(torch.softmax(draws, -1).mean(0))
        log_probs.append(log_mean_softmax(draws))
    return Scored(torch.cat(probs), torch.cat(log_probs))


def _parts(loss: torch.Tensor, nll: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
    """``[objective, NLL, KL]`` of a step as float64 ``[3]`` on their device (no host read)."""
    return torch.stack([loss.detach().double(), nll.detach().double(), kl.detach().double()])


def _curve(sums: torch.Tensor, n: int) -> list[dict]:
    """Per-epoch means from the summed ``[epochs, 3]`` parts (one host read for the whole fit)."""
    return [{"objective": o, "nll": m, "kl": k} for o, m, k in (sums / n).tolist()]


def fit_head_once(
    phi: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: MNVIConfig,
    likelihood: str = "categorical",
) -> tuple[dict, dict, list[dict]]:
    """One last-layer MNVI fit on ``phi [N, D]`` and ``labels [N]`` (``[N, K]`` for
    ``likelihood="bernoulli"``); returns ``(rho, means, curve)`` (``cfg`` resolved)."""
    device, n = phi.device, len(phi)
    gen = torch.Generator().manual_seed(cfg.seed)
    sample_gen = generator(device, cfg.seed)
    rho = torch.full((phi.shape[1],), cfg.rho0, dtype=phi.dtype, device=device, requires_grad=True)
    learn_means = cfg.variant == "mean-and-noise"
    w = weight.detach().clone().requires_grad_(learn_means)
    b = None if bias is None else bias.detach().clone().requires_grad_(learn_means)
    means = [t for t in (w, b) if t is not None and learn_means]
    groups = [{"params": [rho], "lr": cfg.lr}, {"params": means, "lr": cfg.mean_lr}]
    steps = math.ceil(n / cfg.batch_size)
    opt, sched = _optimiser(groups, cfg, steps)
    if not learn_means:
        # Fixed means: the mean logits and M∘M are computed once, not per step.
        with torch.no_grad():
            mu_all = torch.cat([F.linear(phi[i : i + 4096], w, b) for i in range(0, n, 4096)])
            w2_fixed = w.square()
    # (objective, NLL, KL) summed per epoch on the device: read once at the end, not per batch
    sums = torch.zeros(cfg.epochs, 3, dtype=torch.float64, device=device)
    for epoch in track(range(cfg.epochs), total=cfg.epochs, description="fitting MNVI head"):
        for idx in _batches(n, cfg.batch_size, gen, device):
            pb, yb = phi[idx], labels[idx]
            a = F.softplus(rho)
            if learn_means:
                mu, w2 = F.linear(pb, w, b), w.square()
            else:
                mu, w2 = mu_all[idx], w2_fixed
            var = (pb.square() * a) @ w2.T
            nll = batch_nll(mu, var, yb, cfg.samples, sample_gen, likelihood)
            kl = kl_divergence(w, a, cfg.prior_var).to(phi.dtype)
            loss = nll + cfg.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            _rescale([rho, *means], cfg.clip)
            opt.step()
            if sched is not None:
                sched.step()
            sums[epoch] += _parts(loss, nll, kl) * len(idx)
    out_means = {"weight": w.detach()}
    if b is not None:
        out_means["bias"] = b.detach()
    return {"head": rho.detach()}, out_means, _curve(sums, n)


def noisy_weights(
    prop: MomentPropagator, params: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor, int]]:
    """``(layer, weight mean, groups)`` for every noisy layer (overrides from ``params``)."""
    out = []
    for name in prop.layers:
        mod = prop.layer(name)
        out.append((name, params.get(f"{name}.weight", mod.weight), getattr(mod, "groups", 1)))
    return out


def network_kl(prop: MomentPropagator, params: dict, noise: dict, prior_var: float) -> torch.Tensor:
    """The KL [002:(17)] summed over every noisy layer (means from ``params`` where overridden)."""
    return sum(kl_divergence(w, noise[name], prior_var, g) for name, w, g in noisy_weights(prop, params))


def fit_network_once(
    clf: Classifier,
    prop: MomentPropagator,
    train: Data,
    cfg: MNVIConfig,
    device: torch.device,
    means: dict[str, torch.Tensor],
    net_params: list[torch.Tensor],
    train_mode: bool,
    likelihood: str = "categorical",
) -> tuple[dict, list[dict]]:
    """Optimise ρ (and the trainable ``means`` overrides / ``net_params``) of a whole network
    (labels ``train.y [N]``, or ``[N, K]`` for ``likelihood="bernoulli"``)."""
    n = len(train)
    gen = torch.Generator().manual_seed(cfg.seed)
    sample_gen = generator(device, cfg.seed)
    rho = {
        name: torch.full((units,), cfg.rho0, device=device, requires_grad=True)
        for name, units in prop.layers.items()
    }
    mean_params = [v for v in means.values() if v.requires_grad] + net_params
    groups = [{"params": list(rho.values()), "lr": cfg.lr}, {"params": mean_params, "lr": cfg.mean_lr}]
    opt, sched = _optimiser(groups, cfg, math.ceil(n / cfg.batch_size))
    everything = list(rho.values()) + mean_params
    sums = torch.zeros(cfg.epochs, 3, dtype=torch.float64, device=device)
    for epoch in track(range(cfg.epochs), total=cfg.epochs, description="fitting MNVI network"):
        clf.train(train_mode)
        for idx in _batches(n, cfg.batch_size, gen):  # host indices: the inputs live on the host
            xb, yb = train.inputs(idx).to(device), train.y[idx].to(device)
            noise = {k: F.softplus(v) for k, v in rho.items()}
            out = prop(clf.normalise(xb), noise, means)
            nll = batch_nll(out.mean, out.variance(), yb, cfg.samples, sample_gen, likelihood)
            kl = network_kl(prop, means, noise, cfg.prior_var).to(out.mean.dtype)
            loss = nll + cfg.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            _rescale(everything, cfg.clip)
            opt.step()
            if sched is not None:
                sched.step()
            sums[epoch] += _parts(loss, nll, kl) * len(idx)
    clf.eval()
    return {k: v.detach() for k, v in rho.items()}, _curve(sums, n)


def mean_square(prop: MomentPropagator) -> float:
    """``mean(W²)`` over every noisy layer's weights: the post-hoc default σ²."""
    ws = [w.detach() for _, w, _ in noisy_weights(prop, {})]
    return float(sum(w.double().square().sum() for w in ws) / sum(w.numel() for w in ws))
