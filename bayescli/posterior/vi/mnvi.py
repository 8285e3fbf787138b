"""MNVI: sampling-free VI with multiplicative Gaussian activation noise (VI-SPEC C, [002]).

Family [002:(5)]: every ``nn.Linear``/``nn.Conv*d`` weight ``w_ij ~ N(m_ij, a_j m_ij²)``
independently, ``a_j = softplus(ρ_j)`` one per input unit (conv: per input channel); biases and
BatchNorm are deterministic. Prior ``N(0, σ²)`` per weight, KL [002:(17)]
``Σ_ij ½[ln(σ²/(a_j m_ij² + 1e-10)) + (1+a_j) m_ij²/σ² − 1]``. Objective per datapoint
(VI-SPEC §0): ``ℓ = mean_batch E_{h~N(μ, diag v)}[−ln softmax(h)_y] + (κ/N)·KL`` with ``S``
reparameterised logit samples [002:(16)], AMSGrad, no weight decay, gradients rescaled to
∞-norm ``clip`` (VI-SPEC C6.6), learning rate ×0.1 after half the epochs ([002:Table 4] MNIST).

* ``subset="last-layer"`` (post hoc, on cached features φ): the logits are exactly Gaussian,
  ``N(Mφ + b, diag((M∘M)(a∘φ²)))`` with independent classes (``exact=True``). Variants
  ``noise-only`` (ρ only; the means stay the MAP head, so the mean logits are the MAP logits)
  and ``mean-and-noise`` (M, b and ρ from the MAP).
* ``subset="all"``: every linear/conv layer, logits by moment propagation through the real
  forward pass (:mod:`bayescli.posterior.vi.moments`), an approximation (``exact=False``).
  Post hoc from a checkpoint (BatchNorm in eval mode) or from scratch (:func:`train_mnvi`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from bayescli.data import ArrayData
from bayescli.errors import BayescliError, require
from bayescli.features import extract_features
from bayescli.models import Classifier, LoadedModel, ModelSpec, build_network, builtin_names, last_linear_name
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.vi.moments import MomentPropagator
from bayescli.progress import track
from bayescli.train import channel_stats, checkpoint_metadata

KL_EPS = 1e-10  # inside the KL's logarithm [002:App A]
VARIANTS = ("noise-only", "mean-and-noise")
# Logit samples of the validation predictive [002:(20)] used by ``select``: MC error of the
# mean NLL ≈ 1e-3 relative at this size, well below the grid's differences.
PREDICTIVE_SAMPLES = 256
_VAR_FLOOR = 1e-20  # keeps √v differentiable where a logit variance is exactly 0
# What all-layer moment propagation approximates, and how much (benchmarks/mnvi_layers.py on the
# five C-1 nets of tests/test_mnvi.py, 5·10⁴ per-weight MC draws): the linear/conv rules are exact
# given independent inputs (adding the dropped covariance term matches MC to 0.3%), so the logit
# variance error is [002] Assumption 3 (dropped covariances), mostly at the last linear layer,
# plus the max-pool rule of [002] §3.3.3 (pool-output variance +4–29%, mean biased low).
VARIANCE_APPROXIMATION = (
    "diagonal moment propagation drops covariances between units ([002] Assumption 3; conv "
    "weights shared across positions, hidden units sharing inputs) and uses the max-pool rule of "
    "[002] 3.3.3; on the C-1 check nets per-logit variance errors are -35%..+44% "
    "(total logit variance x0.85-1.29), mostly from the last linear layer's dropped covariances "
    "(benchmarks/mnvi_layers.py)"
)


@dataclass
class MNVIConfig:
    """MNVI hyperparameters (VI-SPEC C3/C4). ``None`` means "the default for this kind of fit":

    ============  =========================================  ================================
    field         post hoc (:func:`fit_mnvi`)                from scratch (:func:`train_mnvi`)
    ============  =========================================  ================================
    kl_weight     κ/N = 1/N (κ = 1: the plain ELBO)          2e-7 ([002] LeNet/MNIST)
    prior_var     σ² = mean(W_MAP²) of the noisy layers      1e-3 ([002] LeNet/MNIST)
    epochs        10 last-layer, 2 all layers                20 ([002])
    lr            1e-2 (ρ moves by ~lr per step)             1e-3 (AMSGrad, [002])
    mean_lr       lr / 10 (keeps the MAP means close)        lr
    batch_size    256 last-layer, 64 all layers              64 ([002])
    ============  =========================================  ================================

    Fields:
      subset: ``last-layer`` (head only, exact logit Gaussian) or ``all`` (every linear/conv
        layer, moment propagation).
      variant: ``noise-only`` (learn ρ, keep the checkpoint's means) or ``mean-and-noise``
        (learn means and ρ); from scratch always learns both.
      kl_weight: κ/N, the weight of the KL per datapoint.
      prior_var: σ², the prior variance of every weight.
      rho0: initial ρ (a = softplus(−3) = 0.049; VI-SPEC C6.1).
      samples: S, reparameterised logit samples per input in the expected log-likelihood.
      epochs, lr, mean_lr, batch_size: optimisation (AMSGrad; lr ×0.1 after half the epochs).
      clip: gradients are rescaled to this ∞-norm (``clip_grad_norm_(…, norm_type=inf)``).
      seed: shuffling, logit samples and initialisation.
      select: pick (kl_weight, prior_var) by validation NLL on a 3×3 grid — post hoc
        κ/N ∈ {1/N, 0.1/N, 2e-7} × σ² ∈ mean(W_MAP²)·{0.3, 1, 3} (VI-SPEC C4), from scratch
        κ/N ∈ {2e-7, 5e-8, 2e-8} × σ² ∈ {1e-2, 1e-3, 1e-4} (the [002] grid's range).
    """

    subset: str = "last-layer"
    variant: str = "noise-only"
    kl_weight: float | None = None
    prior_var: float | None = None
    rho0: float = -3.0
    samples: int = 16
    epochs: int | None = None
    lr: float | None = None
    mean_lr: float | None = None
    batch_size: int | None = None
    clip: float = 0.1
    seed: int = 0
    select: bool = False

    def check(self) -> None:
        """Raise :class:`BayescliError` for values no fit can use."""
        require(
            self.variant in VARIANTS, f"unknown MNVI variant '{self.variant}'; use {' or '.join(VARIANTS)}"
        )
        require(
            self.subset in ("last-layer", "all"),
            f"MNVI fits subset last-layer or all, not '{self.subset}'",
        )
        for name in ("kl_weight", "prior_var", "lr", "mean_lr"):
            value = getattr(self, name)
            require(value is None or value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
        for name in ("epochs", "batch_size", "samples"):
            value = getattr(self, name)
            require(
                value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}"
            )
        require(self.clip > 0, f"--clip must be positive, got {self.clip}")

    def resolved(self, scratch: bool, n: int, mean_sq: float) -> MNVIConfig:
        """A copy with every ``None`` replaced by the default for this fit (table above)."""
        last = self.subset == "last-layer" and not scratch
        lr = self.lr if self.lr is not None else (1e-3 if scratch else 1e-2)
        defaults = {
            "kl_weight": 2e-7 if scratch else 1.0 / n,
            "prior_var": 1e-3 if scratch else mean_sq,
            "epochs": 20 if scratch else (10 if last else 2),
            "lr": lr,
            "mean_lr": lr if scratch else lr / 10,
            "batch_size": 256 if last else 64,
        }
        return replace(
            self, **{k: v if getattr(self, k) is None else getattr(self, k) for k, v in defaults.items()}
        )

    def grid(self, scratch: bool, n: int, mean_sq: float) -> list[MNVIConfig]:
        """The (kl_weight, prior_var) grid of ``select`` around the resolved config."""
        base = self.resolved(scratch, n, mean_sq)
        if scratch:
            kls, vars_ = (2e-7, 5e-8, 2e-8), (1e-2, 1e-3, 1e-4)
        else:
            kls, vars_ = (1.0 / n, 0.1 / n, 2e-7), tuple(mean_sq * f for f in (0.3, 1.0, 3.0))
        return [replace(base, kl_weight=k, prior_var=v) for k in kls for v in vars_]


# ---------------------------------------------------------------------------------------------
# the formulas
# ---------------------------------------------------------------------------------------------


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


def predictive_nll(
    mean: torch.Tensor, var: torch.Tensor, labels: torch.Tensor, samples: int, generator: torch.Generator
) -> float:
    """NLL of the MC predictive ``p = (1/S) Σ_s softmax(h_s)`` [002:(20)], chunked over inputs."""
    total, k = 0.0, mean.shape[-1]
    chunk = max(1, 2**22 // (samples * k))
    for start in range(0, len(mean), chunk):
        sl = slice(start, start + chunk)
        eps = torch.randn(
            (samples, *mean[sl].shape), generator=generator, dtype=mean.dtype, device=mean.device
        )
        logp = torch.log_softmax(mean[sl] + var[sl].clamp_min(0).sqrt() * eps, -1)
        logp = torch.logsumexp(logp, 0) - math.log(samples)
        total -= logp.gather(1, labels[sl].view(-1, 1)).sum().item()
    return total / len(mean)


def _rescale(params: list[torch.Tensor], clip: float) -> None:
    torch.nn.utils.clip_grad_norm_(params, clip, norm_type=math.inf)


def _optimiser(groups: list[dict], cfg: MNVIConfig, steps_per_epoch: int) -> tuple:
    opt = torch.optim.Adam([g for g in groups if g["params"]], amsgrad=True, weight_decay=0.0)
    milestone = max(1, cfg.epochs // 2) * steps_per_epoch
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [milestone], gamma=0.1) if cfg.epochs > 1 else None
    return opt, sched


def _batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    perm = torch.randperm(n, generator=generator)
    for start in range(0, n, batch_size):
        yield perm[start : start + batch_size]


# ---------------------------------------------------------------------------------------------
# the posterior
# ---------------------------------------------------------------------------------------------


@dataclass
class MNVIPosterior(Posterior):
    """A fitted MNVI posterior.

    ``rho`` maps a layer name to ``ρ [units]`` (last layer: the single key ``"head"``);
    ``means`` holds the variational means where they are not the checkpoint's: last layer
    ``{"weight" [K, D], "bias" [K]}`` always; all layers ``{"<layer>.weight", "<layer>.bias"}``
    for ``mean-and-noise`` and nothing for ``noise-only``. ``config`` is the resolved
    :class:`MNVIConfig` as a dict.
    """

    subset: Subset
    variant: str
    rho: dict[str, torch.Tensor]
    means: dict[str, torch.Tensor]
    config: dict
    meta: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    method: ClassVar[str] = "mnvi"

    @property
    def label(self) -> str:
        return f"mnvi {self.subset.value} {self.variant}"

    @property
    def exact(self) -> bool:
        return self.subset is Subset.LAST_LAYER

    def noise(
        self, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """``a = softplus(ρ)`` per layer."""
        return {k: F.softplus(v).to(device=device, dtype=dtype) for k, v in self.rho.items()}

    # -- predictives --------------------------------------------------------------------------

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """Exact logit Gaussian of the last layer for features ``phi [N, D]`` → ``[N, K]``."""
        if self.subset is not Subset.LAST_LAYER:
            raise BayescliError("this MNVI posterior covers all layers; use logit_gaussian_inputs")
        w, b, scaled = self._head(phi.device, phi.dtype)
        return LogitGaussian(F.linear(phi, w, b), phi.square() @ scaled.T, exact=True)

    def _head(self, device: torch.device, dtype: torch.dtype) -> tuple:
        """``(M, b, a∘M∘M)`` on ``device`` (cached): the variance is one matmul with ``φ²``."""
        key = ("head", device, dtype)
        if key not in self._cache:
            w = self.means["weight"].to(device=device, dtype=dtype)
            b = self.means.get("bias")
            a = self.noise(device, dtype)["head"]
            self._cache[key] = (w, None if b is None else b.to(device=device, dtype=dtype), w.square() * a)
        return self._cache[key]

    def propagator(self, net: nn.Module) -> MomentPropagator:
        """The (cached) moment propagator of ``net``; checks the layers match the stored ρ."""
        key = ("prop", id(net))
        if key not in self._cache:
            prop = MomentPropagator(net)
            if set(prop.layers) != set(self.rho):
                missing = sorted(set(self.rho) - set(prop.layers))[:3]
                raise BayescliError(
                    f"the network's linear/conv layers do not match the MNVI posterior (e.g. {missing}); "
                    "use the checkpoint it was fitted on"
                )
            self._cache[key] = prop
        return self._cache[key]

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """Logit Gaussian for pixel-space ``x [N, ...]``: exact for the last layer, moment
        propagation (an approximation, ``exact=False``) for all layers."""
        if self.subset is Subset.LAST_LAYER:
            return self.logit_gaussian(classifier.features(x))
        xn = classifier.normalise(x)
        prop = self.propagator(classifier.net)
        means = {k: v.to(device=xn.device, dtype=xn.dtype) for k, v in self.means.items()}
        out = prop(xn, self.noise(xn.device, xn.dtype), means)
        return LogitGaussian(out.mean, out.variance(), exact=False)

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """BNN predictive logits ``[M, N, K]``.

        Last layer: the logits are exactly Gaussian per input, so the draws are the local
        reparameterisation ``μ + √v ⊙ ε`` (exact marginals; independent across inputs). All
        layers: ``M`` networks with per-weight noise ``w = m(1 + √a ε)`` (one draw shared by the
        batch, as the family defines it), i.e. the true predictive that moment propagation
        approximates.
        """
        if self.subset is Subset.LAST_LAYER:
            lg = self.logit_gaussian(phi if phi is not None else classifier.features(x))
            return lg.sample(num, generator)
        from torch.func import functional_call

        xn = classifier.normalise(x)
        net = classifier.net
        prop = self.propagator(net)
        noise = self.noise(xn.device, xn.dtype)
        out = []
        for _ in range(num):
            params = {}
            for name in prop.layers:
                mod = prop.layer(name)
                m = self.means.get(f"{name}.weight", mod.weight).to(xn.device, xn.dtype)
                eps = torch.randn(m.shape, generator=generator, dtype=m.dtype, device=m.device)
                params[f"{name}.weight"] = m * (
                    1 + expand_noise(noise[name], m, getattr(mod, "groups", 1)).sqrt() * eps
                )
                if f"{name}.bias" in self.means:
                    params[f"{name}.bias"] = self.means[f"{name}.bias"].to(xn.device, xn.dtype)
            with torch.no_grad():
                out.append(functional_call(net, params, (xn,), strict=False))
        return torch.stack(out)

    # -- files --------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.subset is Subset.LAST_LAYER:
            return {"rho": self.rho["head"], **self.means}
        return {
            **{f"rho/{k}": v for k, v in self.rho.items()},
            **{f"mean/{k}": v for k, v in self.means.items()},
        }

    def own_metadata(self) -> dict:
        a = torch.cat([F.softplus(r.detach().double()).reshape(-1) for r in self.rho.values()])
        return {
            "variant": self.variant,
            "exact": self.exact,
            "predictive": "closed-form" if self.exact else "moment-propagation",
            "variance_approximation": None if self.exact else VARIANCE_APPROXIMATION,
            "kl_weight": self.config.get("kl_weight"),
            "prior_var": self.config.get("prior_var"),
            "noise_mean": a.mean().item(),
            "noise_min": a.min().item(),
            "noise_max": a.max().item(),
            "noise_units": int(a.numel()),
            "noise_layers": list(self.rho),
            "config": self.config,
        }

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> MNVIPosterior:
        subset = Subset(meta["subset"])
        if subset is Subset.LAST_LAYER:
            rho = {"head": tensors["rho"]}
            means = {k: tensors[k] for k in ("weight", "bias") if k in tensors}
            if "weight" not in means:
                raise KeyError("weight")
        else:
            rho = {k[4:]: v for k, v in tensors.items() if k.startswith("rho/")}
            means = {k[5:]: v for k, v in tensors.items() if k.startswith("mean/")}
            order = meta.get("noise_layers", [])
            rho = {k: rho[k] for k in order} if set(order) == set(rho) else rho
        return cls(
            subset, str(meta["variant"]), rho, means, dict(meta["config"]), cls.provenance(meta, _OWN_KEYS)
        )


_OWN_KEYS = {
    "variant",
    "exact",
    "predictive",
    "variance_approximation",
    "kl_weight",
    "prior_var",
    "noise_mean",
    "noise_min",
    "noise_max",
    "noise_units",
    "noise_layers",
    "config",
}


# ---------------------------------------------------------------------------------------------
# last-layer fits (post hoc, on features)
# ---------------------------------------------------------------------------------------------


def _fit_head_once(
    phi: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: MNVIConfig
) -> tuple[dict, dict, list[dict]]:
    """One last-layer MNVI fit; returns ``(rho, means, curve)`` (``cfg`` resolved)."""
    device, n = phi.device, len(phi)
    gen = torch.Generator().manual_seed(cfg.seed)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed)
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
    curve = []
    for _ in track(range(cfg.epochs), total=cfg.epochs, description="fitting MNVI head"):
        sums = torch.zeros(3, dtype=torch.float64)
        for idx in _batches(n, cfg.batch_size, gen):
            idx = idx.to(device)
            pb, yb = phi[idx], labels[idx]
            a = F.softplus(rho)
            if learn_means:
                mu, w2 = F.linear(pb, w, b), w.square()
            else:
                mu, w2 = mu_all[idx], w2_fixed
            var = (pb.square() * a) @ w2.T
            nll = expected_nll(mu, var, yb, cfg.samples, sample_gen)
            kl = kl_divergence(w, a, cfg.prior_var).to(phi.dtype)
            loss = nll + cfg.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            _rescale([rho, *means], cfg.clip)
            opt.step()
            if sched is not None:
                sched.step()
            sums += torch.tensor([loss.item(), nll.item(), kl.item()], dtype=torch.float64) * len(idx)
        objective, nll_mean, kl_total = (sums / n).tolist()
        curve.append({"objective": objective, "nll": nll_mean, "kl": kl_total})
    out_means = {"weight": w.detach()}
    if b is not None:
        out_means["bias"] = b.detach()
    return {"head": rho.detach()}, out_means, curve


def fit_mnvi_features(
    phi: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Linear,
    cfg: MNVIConfig,
    phi_val: torch.Tensor | None = None,
    labels_val: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> MNVIPosterior:
    """Last-layer MNVI on features ``phi [N, D]`` with labels ``[N]`` and the MAP ``head``.

    ``select`` needs ``phi_val``/``labels_val`` and picks the grid point with the lowest
    validation NLL of the predictive [002:(20)].
    """
    cfg.check()
    require(
        cfg.subset == "last-layer", "fit_mnvi_features fits the last layer; use fit_mnvi for --subset all"
    )
    require(
        bool(torch.isfinite(phi).all()), "features contain NaN or inf; check the inputs and the checkpoint"
    )
    start = time.perf_counter()
    device = torch.device(device)
    phi, labels = phi.to(device=device, dtype=torch.float32), labels.to(device)
    weight = head.weight.detach().to(device=device, dtype=torch.float32)
    bias = None if head.bias is None else head.bias.detach().to(device=device, dtype=torch.float32)
    n, mean_sq = len(phi), weight.square().mean().item()

    def run(c: MNVIConfig) -> MNVIPosterior:
        rho, means, curve = _fit_head_once(phi, labels, weight, bias, c)
        post = MNVIPosterior(
            Subset.LAST_LAYER, c.variant, {k: v.cpu() for k, v in rho.items()},
            {k: v.cpu() for k, v in means.items()}, asdict(c),
        )  # fmt: skip
        post.meta.update({"curve": curve, "n_data": n})
        return post

    def val_nll(post: MNVIPosterior) -> float:
        lg = post.logit_gaussian(phi_val.to(device=device, dtype=torch.float32))
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        return predictive_nll(lg.mean, lg.var, labels_val.to(device), PREDICTIVE_SAMPLES, gen)

    post = _select(cfg, False, n, mean_sq, run, val_nll if phi_val is not None else None)
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def _select(
    cfg: MNVIConfig,
    scratch: bool,
    n: int,
    mean_sq: float,
    run: Callable[[MNVIConfig], MNVIPosterior],
    val_nll: Callable[[MNVIPosterior], float] | None,
) -> MNVIPosterior:
    """Fit the resolved config, or every grid point and keep the best on validation NLL."""
    if not cfg.select:
        post = run(cfg.resolved(scratch, n, mean_sq))
        if val_nll is not None:
            post.meta["val_nll"] = val_nll(post)
        return post
    require(val_nll is not None, "--select needs labelled validation data; pass --val-data")
    best, curve = None, []
    for c in cfg.grid(scratch, n, mean_sq):
        post = run(c)
        score = val_nll(post)
        curve.append({"kl_weight": c.kl_weight, "prior_var": c.prior_var, "val_nll": score})
        if best is None or score < best[0]:
            best = (score, post)
    score, post = best
    post.meta["val_nll"] = score
    post.meta["selection"] = {
        "criterion": "val_nll",
        "kl_weight": post.config["kl_weight"],
        "prior_var": post.config["prior_var"],
        "curve": curve,
    }
    return post


# ---------------------------------------------------------------------------------------------
# whole-network fits
# ---------------------------------------------------------------------------------------------


def _noisy_weights(
    prop: MomentPropagator, params: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor, int]]:
    """``(layer, weight mean, groups)`` for every noisy layer (overrides from ``params``)."""
    out = []
    for name in prop.layers:
        mod = prop.layer(name)
        out.append((name, params.get(f"{name}.weight", mod.weight), getattr(mod, "groups", 1)))
    return out


def _network_kl(prop: MomentPropagator, params: dict, noise: dict, prior_var: float) -> torch.Tensor:
    return sum(kl_divergence(w, noise[name], prior_var, g) for name, w, g in _noisy_weights(prop, params))


def _fit_network_once(
    clf: Classifier,
    prop: MomentPropagator,
    train: ArrayData,
    cfg: MNVIConfig,
    device: torch.device,
    means: dict[str, torch.Tensor],
    net_params: list[torch.Tensor],
    train_mode: bool,
) -> tuple[dict, list[dict]]:
    """Optimise ρ (and the trainable ``means`` overrides / ``net_params``) of a whole network."""
    n = len(train)
    gen = torch.Generator().manual_seed(cfg.seed)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    rho = {
        name: torch.full((units,), cfg.rho0, device=device, requires_grad=True)
        for name, units in prop.layers.items()
    }
    mean_params = [v for v in means.values() if v.requires_grad] + net_params
    groups = [{"params": list(rho.values()), "lr": cfg.lr}, {"params": mean_params, "lr": cfg.mean_lr}]
    opt, sched = _optimiser(groups, cfg, math.ceil(n / cfg.batch_size))
    everything = list(rho.values()) + mean_params
    curve = []
    for _ in track(range(cfg.epochs), total=cfg.epochs, description="fitting MNVI network"):
        clf.train(train_mode)
        sums = torch.zeros(3, dtype=torch.float64)
        for idx in _batches(n, cfg.batch_size, gen):
            xb, yb = train.inputs(idx).to(device), train.y[idx].to(device)
            noise = {k: F.softplus(v) for k, v in rho.items()}
            out = prop(clf.normalise(xb), noise, means)
            nll = expected_nll(out.mean, out.variance(), yb, cfg.samples, sample_gen)
            kl = _network_kl(prop, means, noise, cfg.prior_var).to(out.mean.dtype)
            loss = nll + cfg.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            _rescale(everything, cfg.clip)
            opt.step()
            if sched is not None:
                sched.step()
            sums += torch.tensor([loss.item(), nll.item(), kl.item()], dtype=torch.float64) * len(idx)
        objective, nll_mean, kl_total = (sums / n).tolist()
        curve.append({"objective": objective, "nll": nll_mean, "kl": kl_total})
    clf.eval()
    return {k: v.detach().cpu() for k, v in rho.items()}, curve


def _network_val_nll(
    post: MNVIPosterior, clf: Classifier, val: ArrayData, device: torch.device, seed: int
) -> float:
    gen = torch.Generator(device=device).manual_seed(seed)
    total = 0.0
    with torch.no_grad():
        for xb, yb in val.batches(256):
            lg = post.logit_gaussian_inputs(clf, xb.to(device))
            total += predictive_nll(lg.mean, lg.var, yb.to(device), PREDICTIVE_SAMPLES, gen) * len(yb)
    return total / len(val)


def _mean_square(prop: MomentPropagator) -> float:
    ws = [w.detach() for _, w, _ in _noisy_weights(prop, {})]
    return float(sum(w.double().square().sum() for w in ws) / sum(w.numel() for w in ws))


def fit_mnvi(
    model: LoadedModel,
    train: ArrayData,
    val: ArrayData | None,
    cfg: MNVIConfig,
    device: torch.device,
    batch_size: int = 256,
) -> MNVIPosterior:
    """Fit MNVI post hoc on a pretrained checkpoint (``model`` from ``load_classifier``).

    Last layer: features are extracted once (``batch_size`` per backbone pass). All layers: the
    means start at the checkpoint's weights, BatchNorm stays in eval mode, and each step runs
    moment propagation on a batch of ``cfg.batch_size`` inputs. The CLI adds the provenance.
    """
    cfg.check()
    require(train.y is not None, f"{train.spec} has no labels; MNVI needs labelled fitting data")
    require(
        val is None or val.y is not None, f"{val.spec if val else ''} has no labels; pass labelled --val-data"
    )
    device = torch.device(device)
    start = time.perf_counter()
    if cfg.subset == "last-layer":
        feats = extract_features(model, train, batch_size, device)
        vfeats = extract_features(model, val, batch_size, device) if val is not None else None
        post = fit_mnvi_features(
            feats.phi, feats.labels, model.classifier.head, cfg,
            None if vfeats is None else vfeats.phi, None if vfeats is None else vfeats.labels, device,
        )  # fmt: skip
        post.meta["fit_seconds"] = time.perf_counter() - start
        return post
    clf = model.classifier.to(device).eval()
    for p in clf.parameters():
        p.requires_grad_(False)
    prop = MomentPropagator(clf.net)
    require(bool(prop.layers), f"{model.spec} has no nn.Linear/nn.Conv layer to put noise on")
    n, mean_sq = len(train), _mean_square(prop)

    def run(c: MNVIConfig) -> MNVIPosterior:
        means: dict[str, torch.Tensor] = {}
        if c.variant == "mean-and-noise":
            for name in prop.layers:
                mod = prop.layer(name)
                means[f"{name}.weight"] = mod.weight.detach().clone().requires_grad_(True)
                if mod.bias is not None:
                    means[f"{name}.bias"] = mod.bias.detach().clone().requires_grad_(True)
        rho, curve = _fit_network_once(clf, prop, train, c, device, means, [], False)
        post = MNVIPosterior(
            Subset.ALL, c.variant, rho, {k: v.detach().cpu() for k, v in means.items()}, asdict(c)
        )
        post.meta.update({"curve": curve, "n_data": n})
        return post

    def val_nll(post: MNVIPosterior) -> float:
        return _network_val_nll(post, clf, val, device, cfg.seed)

    post = _select(cfg, False, n, mean_sq, run, val_nll if val is not None else None)
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post


def train_mnvi(
    model_spec: str, train: ArrayData, val: ArrayData | None, cfg: MNVIConfig, device: torch.device
) -> tuple[Classifier, dict, MNVIPosterior]:
    """Train a builtin network with MNVI from scratch ([002] setting; see :class:`MNVIConfig`).

    Returns the classifier (the variational means as its weights; BatchNorm statistics from the
    means), checkpoint metadata as :func:`bayescli.train.train_classifier` writes it, and the
    all-layer posterior (``mean-and-noise``).
    """
    cfg = replace(cfg, subset="all", variant="mean-and-noise")
    cfg.check()
    spec = ModelSpec.parse(model_spec)
    if spec.kind != "builtin":
        raise BayescliError(
            f"train --method mnvi trains builtin models only ({', '.join(builtin_names())}); got {spec}"
        )
    require(train.y is not None, f"{train.spec} has no labels; training needs labelled data")
    require(val is None or val.y is not None, "the validation data has no labels")
    device = torch.device(device)
    start = time.perf_counter()
    k = train.num_classes
    mean, std = channel_stats(train)

    def build(c: MNVIConfig) -> tuple[Classifier, MNVIPosterior]:
        torch.manual_seed(c.seed)
        net = build_network(spec, k, train.input_shape, {})
        clf = Classifier(net, last_linear_name(net), mean, std).to(device)
        prop = MomentPropagator(net)
        rho, curve = _fit_network_once(clf, prop, train, c, device, {}, list(net.parameters()), True)
        means = {}
        for name in prop.layers:
            mod = prop.layer(name)
            means[f"{name}.weight"] = mod.weight.detach().cpu().clone()
            if mod.bias is not None:
                means[f"{name}.bias"] = mod.bias.detach().cpu().clone()
        post = MNVIPosterior(Subset.ALL, "mean-and-noise", rho, means, asdict(c))
        post.meta.update({"curve": curve, "n_data": len(train)})
        post._cache["clf"] = clf
        return clf, post

    def run(c: MNVIConfig) -> MNVIPosterior:
        return build(c)[1]

    def val_nll(post: MNVIPosterior) -> float:
        return _network_val_nll(post, post._cache["clf"], val, device, cfg.seed)

    post = _select(cfg, True, len(train), 0.0, run, val_nll if val is not None else None)
    clf = post._cache.pop("clf")
    post.meta["fit_seconds"] = time.perf_counter() - start
    training = {"method": "mnvi", **post.config}
    loss = [c["objective"] for c in post.meta["curve"]]
    meta = checkpoint_metadata(spec, clf, train, val, device, (mean, std), training, loss)
    kept = ("curve", "fit_seconds", "val_nll", "selection")
    meta["mnvi"] = {k: post.meta[k] for k in kept if k in post.meta}
    return clf, meta, post
