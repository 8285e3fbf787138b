"""MNVI's settings (VI-SPEC C3/C4): what :func:`bayescli.posterior.vi.mnvi.fit` and the
from-scratch trainer read, validated on construction. A module of its own so that the objective
(:mod:`~bayescli.posterior.vi.mnvi_objective`) can take the settings without importing the fit."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bayescli.errors import BayescliError, require
from bayescli.options import Subset
from bayescli.posterior.selection import Criterion
from bayescli.posterior.vi.budget import head_epochs

VARIANTS = ("noise-only", "mean-and-noise")


@dataclass
class MNVIConfig:
    """MNVI hyperparameters (VI-SPEC C3/C4). ``None`` means "the default for this kind of fit":

    ============  =========================================  ================================
    field         post hoc (:func:`fit`)                     from scratch (training.mnvi)
    ============  =========================================  ================================
    kl_weight     chosen on validation data (module doc);    2e-7 ([002] LeNet/MNIST)
                  without: κ/N = 1/N (κ = 1: the plain ELBO)
    prior_var     σ² = mean(W_MAP²) of the noisy layers      1e-3 ([002] LeNet/MNIST)
    epochs        10 last-layer (fewer at large N: about     20 ([002])
                  128 steps, ≥ 2 epochs), 2 all layers
    lr            1e-2 (ρ moves by ~lr per step)             1e-3 (AMSGrad, [002])
    mean_lr       lr / 10 (keeps the MAP means close)        lr
    batch_size    256 last-layer, 64 all layers              64 ([002])
    ============  =========================================  ================================

    Fields:
      subset: ``last-layer`` (head only, exact logit Gaussian) or ``all`` (every linear/conv
        layer, moment propagation).
      variant: ``noise-only`` (learn ρ, keep the checkpoint's means) or ``mean-and-noise``
        (learn means and ρ); from scratch always learns both.
      kl_weight: κ/N, the weight of the KL per datapoint (given: used as is).
      prior_var: σ², the prior variance of every weight.
      rho0: initial ρ (a = softplus(−3) = 0.049; VI-SPEC C6.1).
      samples: S, reparameterised logit samples per input in the expected log-likelihood.
      epochs, lr, mean_lr, batch_size: optimisation (AMSGrad; lr ×0.1 after half the epochs).
      clip: gradients are rescaled to this ∞-norm (``clip_grad_norm_(…, norm_type=inf)``).
      seed: shuffling, logit samples and initialisation.
      select: ``None``: post hoc, choose ``kl_weight`` on validation data when there is some;
        ``True``: require that (from scratch: train the [002] grid κ/N ∈ {2e-7, 5e-8, 2e-8} ×
        σ² ∈ {1e-2, 1e-3, 1e-4}, a given σ² kept); ``False``: never select.
      select_by: the validation criterion of the selection (nll, ece or brier).
    """

    subset: Subset = Subset.LAST_LAYER
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
    select: bool | None = None
    select_by: Criterion = Criterion.NLL

    def __post_init__(self) -> None:
        try:
            self.subset = Subset(self.subset)
        except ValueError:
            raise BayescliError(f"subset must be 'last-layer' or 'all', got '{self.subset}'") from None
        require(self.variant in VARIANTS, f"variant must be {' or '.join(VARIANTS)}, got '{self.variant}'")
        for name in ("kl_weight", "prior_var", "lr", "mean_lr"):
            value = getattr(self, name)
            require(value is None or value > 0, f"{name} must be positive, got {value}")
        for name in ("epochs", "batch_size", "samples"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"{name} must be at least 1, got {value}")
        require(self.clip > 0, f"clip must be positive, got {self.clip}")
        require(math.isfinite(self.rho0), f"rho0 must be finite, got {self.rho0}")
        try:
            self.select_by = Criterion(self.select_by)
        except ValueError:
            names = ", ".join(c.value for c in Criterion)
            raise BayescliError(f"select_by must be one of {names}, got '{self.select_by}'") from None

    def resolved(self, scratch: bool, n: int, mean_sq: float) -> MNVIConfig:
        """A copy with every ``None`` replaced by the default for this fit (table above)."""
        last = self.subset == "last-layer" and not scratch
        lr = self.lr if self.lr is not None else (1e-3 if scratch else 1e-2)
        batch_size = self.batch_size or (256 if last else 64)
        defaults = {
            "kl_weight": 2e-7 if scratch else 1.0 / n,
            "prior_var": 1e-3 if scratch else mean_sq,
            "epochs": 20 if scratch else (head_epochs(None, n, batch_size) if last else 2),
            "lr": lr,
            "mean_lr": lr if scratch else lr / 10,
            "batch_size": batch_size,
        }
        return replace(
            self, **{k: v if getattr(self, k) is None else getattr(self, k) for k, v in defaults.items()}
        )
