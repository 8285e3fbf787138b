"""The MNVI posterior: per-unit noise ``a = softplus(ρ)`` on the means, its predictives and files.

Last layer: the logits are exactly Gaussian (``exact=True``). All layers: logits by moment
propagation (:mod:`bayescli.posterior.vi.moments`), an approximation whose size is recorded in
every file (:data:`VARIANCE_APPROXIMATION`). Fitted by :func:`bayescli.posterior.vi.mnvi.fit`
or trained from scratch by :func:`bayescli.training.mnvi.train`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from bayescli.errors import BayescliError
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.vi.mnvi_objective import expand_noise
from bayescli.posterior.vi.moments import MomentPropagator

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
class MNVIPosterior(Posterior):
    """A fitted MNVI posterior.

    ``rho`` maps a layer name to ``ρ [units]`` (last layer: the single key ``"head"``);
    ``means`` holds the variational means where they are not the checkpoint's: last layer
    ``{"weight" [K, D], "bias" [K]}`` always; all layers ``{"<layer>.weight", "<layer>.bias"}``
    for ``mean-and-noise`` and nothing for ``noise-only``. ``config`` is the resolved
    :class:`MNVIConfig` as a dict. ``likelihood`` is the classifier's: ``categorical`` (softmax) or
    ``bernoulli`` (a sigmoid per label; per-label predictives); files without it are categorical.
    """

    subset: Subset
    variant: str
    rho: dict[str, torch.Tensor]
    means: dict[str, torch.Tensor]
    config: dict
    meta: dict = field(default_factory=dict)
    likelihood: str = "categorical"
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
        x = x.to(next(classifier.parameters()).device)  # inputs arrive from the host
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
        if x is not None:
            x = x.to(next(classifier.parameters()).device)  # inputs arrive from the host
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
            "likelihood": self.likelihood,
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
            subset,
            str(meta["variant"]),
            rho,
            means,
            dict(meta["config"]),
            cls.provenance(meta, _OWN_KEYS),
            str(meta.get("likelihood", "categorical")),
        )


_OWN_KEYS = {
    "variant",
    "likelihood",
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
