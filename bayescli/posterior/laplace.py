"""Laplace approximations of a trained classifier: fit, tune the prior, save, load.

``q(θ) = N(θ*, (H + δI)⁻¹)`` with ``θ*`` the trained weights (the MAP), ``H`` the curvature
of the summed negative log-likelihood on the fitting data and ``δ`` an isotropic prior precision
(prior mean zero). The likelihood is the classifier's own (``LaplacePosterior.likelihood``):

* ``categorical``: softmax cross-entropy, labels ``[N]`` (:mod:`bayescli.posterior.curvature`);
* ``bernoulli``: a sigmoid per class with binary cross-entropy, multi-label ``[N, K]`` in
  ``{0, 1}`` (:mod:`bayescli.posterior.bernoulli_curvature` for the last layer).

Either way the fit yields the same weight Gaussians and ``log p(D | θ*)`` of that likelihood, so
the marginal likelihood, δ and the logit Gaussians ``N(f, J Σ Jᵀ)`` need no case of their own.

* ``subset="last-layer"``: ``θ`` are the head's weights and bias ``W̃ [K, D+1]``; fitted on
  detached features, so the backbone runs once. Structures ``diag``, ``kron``, ``full``.
* ``subset="all"``: every parameter of the network; ``diag`` (BackPACK ``DiagGGNExact``) or
  ``full`` (≤ 20,000 parameters), either likelihood (:mod:`bayescli.posterior.network_curvature`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from bayescli import parallel
from bayescli.errors import BayescliError
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.bernoulli_curvature import BernoulliCurvatureAccumulator, bernoulli_log_likelihood
from bayescli.posterior.curvature import (
    Backend,
    Curvature,
    CurvatureAccumulator,
    CurvatureType,
    HessianStructure,
    network_jacobian,
)
from bayescli.posterior.gaussian import (
    DiagGaussian,
    FullGaussian,
    KronGaussian,
    LogitGaussian,
    WeightGaussian,
    augment,
)
from bayescli.posterior.network_curvature import all_layer_curvature
from bayescli.posterior.prior import edge_warning, log_marglik, optimise_marglik
from bayescli.posterior.refine import refine_mode
from bayescli.posterior.selection import unvalidated


def head_parameters(head: nn.Linear) -> torch.Tensor:
    """``W̃ = [W, b]`` ``[K, D+1]`` (``W`` alone for a head without bias)."""
    w = head.weight.detach()
    return torch.cat([w, head.bias.detach()[:, None]], 1) if head.bias is not None else w.clone()


def _last_layer_accumulator(
    likelihood: str,
    mean: torch.Tensor,
    structure: HessianStructure | str,
    curvature: CurvatureType | str,
    backend: Backend | str,
    batch_size: int,
    seed: int,
) -> CurvatureAccumulator | BernoulliCurvatureAccumulator:
    """The last-layer curvature accumulator of ``likelihood`` for the head ``mean = W̃ [K, D+1]``."""
    if likelihood == "categorical":
        return CurvatureAccumulator(mean, structure, curvature, backend, batch_size, seed)
    if likelihood != "bernoulli":
        raise BayescliError(f"unknown likelihood '{likelihood}'; use 'categorical' or 'bernoulli'")
    if Backend(backend) is Backend.BACKPACK:
        raise BayescliError(
            "backend='backpack' has no multi-label (bernoulli) curvature; use backend='auto' (closed form)"
        )
    return BernoulliCurvatureAccumulator(mean, structure, curvature, batch_size, seed)


def _gaussian(curv: Curvature, mean: torch.Tensor, delta: float) -> WeightGaussian:
    if curv.structure is HessianStructure.DIAG:
        return DiagGaussian(mean, curv.diag.reshape(mean.shape), delta)
    if curv.structure is HessianStructure.KRON:
        return KronGaussian(mean, *curv.kron, delta)
    return FullGaussian(mean, curv.full, delta)


@dataclass
class LaplacePosterior(Posterior):
    """A fitted Laplace approximation plus what it was fitted on.

    ``gaussian`` holds ``θ*``, the curvature and ``δ``; ``meta`` the provenance written to the
    posterior file (model spec, checkpoint hash, data spec, prior choice, …); ``likelihood`` the
    classifier's (``categorical`` or ``bernoulli``; files that do not say are categorical).
    """

    gaussian: WeightGaussian
    subset: Subset
    curvature: CurvatureType
    head_bias: bool
    n_data: int
    log_likelihood: float | None
    meta: dict = field(default_factory=dict)
    likelihood: str = "categorical"

    method: ClassVar[str] = "laplace"

    @property
    def label(self) -> str:
        return f"laplace {self.subset.value} {self.structure}"

    def summary(self) -> dict:
        return {
            "hessian": self.structure,
            "curvature": self.curvature.value,
            "likelihood": self.likelihood,
            "prior_precision": self.prior_precision,
            "prior_method": self.prior_record.get("method"),
            "n_data": self.n_data,
        }

    @property
    def structure(self) -> str:
        return self.gaussian.structure

    @property
    def prior_precision(self) -> float:
        return self.gaussian.delta

    # -- fitting ------------------------------------------------------------------------------

    @classmethod
    def fit_last_layer(
        cls,
        phi: torch.Tensor,
        labels: torch.Tensor | None,
        head: nn.Linear,
        structure: HessianStructure | str = HessianStructure.KRON,
        curvature: CurvatureType | str = CurvatureType.GGN,
        backend: Backend | str = Backend.AUTO,
        batch_size: int = 1024,
        seed: int = 0,
        mean: torch.Tensor | None = None,
        likelihood: str = "categorical",
    ) -> LaplacePosterior:
        """Fit on features ``phi [N, D]`` of the fitting data (labels ``[N]``, or ``[N, K]`` for
        ``likelihood="bernoulli"``, for ``ef``/marglik).

        ``mean`` replaces the head's own ``W̃`` as the expansion point (a refined mode).
        """
        return cls.fit_last_layer_stream(
            [(phi, labels)], head, structure, curvature, backend, batch_size, seed, mean, likelihood
        )

    @classmethod
    def fit_last_layer_stream(
        cls,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
        head: nn.Linear,
        structure: HessianStructure | str = HessianStructure.KRON,
        curvature: CurvatureType | str = CurvatureType.GGN,
        backend: Backend | str = Backend.AUTO,
        batch_size: int = 1024,
        seed: int = 0,
        mean: torch.Tensor | None = None,
        likelihood: str = "categorical",
    ) -> LaplacePosterior:
        """Fit on a stream of ``(phi [B, D], labels [B], [B, K] or None)`` batches, never holding
        them all.

        Curvature factors and the log-likelihood are summed batch by batch
        (:class:`~bayescli.posterior.curvature.CurvatureAccumulator`, or
        :class:`~bayescli.posterior.bernoulli_curvature.BernoulliCurvatureAccumulator` for
        ``likelihood="bernoulli"``); the result equals
        :meth:`fit_last_layer` on the concatenated batches. The dtype of the first batch sets the
        dtype of the fit.
        """
        bias = head.bias is not None
        acc = finite = None
        # Under torchrun each process streams its shard; a failure on any ends every process
        # here, before the sums in ``finish`` (so none waits in a collective).
        with parallel.together():
            for phi, labels in batches:
                if acc is None:
                    # on the features' device and dtype: a GPU pass keeps the whole fit there
                    mean = (head_parameters(head) if mean is None else mean).to(phi)
                    acc = _last_layer_accumulator(
                        likelihood, mean, structure, curvature, backend, batch_size, seed
                    )
                    finite = torch.ones((), dtype=torch.bool, device=phi.device)
                finite &= torch.isfinite(phi).all()  # read once below, not per batch
                acc.update(augment(phi) if bias else phi, labels)
            if acc is None:
                raise BayescliError("no fitting data: the feature stream was empty")
            if not bool(finite):
                raise BayescliError("features contain NaN or inf; check the inputs and the checkpoint")
        curv = acc.finish()
        return cls(
            _gaussian(curv, mean, 1.0),
            Subset.LAST_LAYER,
            CurvatureType(curvature),
            bias,
            curv.n_data,
            acc.log_likelihood,
            likelihood=likelihood,
        )

    @classmethod
    def fit_all_layers(
        cls,
        classifier: Classifier,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
        structure: HessianStructure | str = HessianStructure.DIAG,
        curvature: CurvatureType | str = CurvatureType.GGN,
        seed: int = 0,
        likelihood: str = "categorical",
    ) -> LaplacePosterior:
        """Fit over all parameters of ``classifier.net`` on pixel-space ``batches`` (one pass) of
        inputs and labels ``[B]`` (``[B, K]`` in ``{0, 1}`` for ``likelihood="bernoulli"``) or ``None``.

        The batches are consumed as they come (the curvature is summed per batch); ``full``
        holds the ``[P, P]`` curvature its maths needs (P ≤ 20,000). No feature/head split is
        needed: the logits are those of ``classifier.net``.
        """
        dev = next(classifier.parameters()).device
        batches = iter(batches)
        first = next(batches, None)
        if first is not None:
            # which output element is the logits (and whether they are log-probabilities) decides
            # what ``classifier.net`` returns, so settle it before the curvature copies the network
            classifier.check_output(first[0][:2].to(dev))
            batches = itertools.chain([first], batches)
        net = classifier.net
        log_lik = {"sum": torch.zeros((), dtype=torch.float64, device=dev), "labelled": True}

        def normed() -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
            for x, y in batches:
                xn = classifier.normalise(x.to(dev))
                if y is None:
                    log_lik["labelled"] = False
                else:
                    y = y.to(dev)
                    with torch.no_grad():
                        logits = net(xn).double()
                    if likelihood == "bernoulli":
                        log_lik["sum"] += bernoulli_log_likelihood(logits, y)
                    else:
                        log_lik["sum"] -= nn.functional.cross_entropy(logits, y, reduction="sum")
                yield xn, y

        curv = all_layer_curvature(net, normed(), structure, curvature, seed, likelihood)
        mean = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        return cls(
            _gaussian(curv, mean, 1.0),
            Subset.ALL,
            CurvatureType(curvature),
            False,
            curv.n_data,
            float(log_lik["sum"]) if log_lik["labelled"] else None,
            likelihood=likelihood,
        )

    # -- prior --------------------------------------------------------------------------------

    def set_prior_precision(self, delta: float, method: str = "fixed", curve: list | None = None) -> None:
        """Use ``δ`` from now on and record how it was chosen (``meta["prior"]``; a posterior whose
        δ a fit had chosen records it as given instead: its ``selection`` becomes fixed at ``δ``)."""
        if not delta > 0:
            raise BayescliError(f"prior precision must be positive, got {delta}")
        self.gaussian.with_delta(delta)
        prior = {"value": float(delta), "method": method, "curve": curve or []}
        warning = edge_warning(delta, curve or [])
        if warning:
            prior["warning"] = warning
        if self.selection is None:
            self.meta["prior"] = prior
        else:
            rule = "given" if method == "fixed" else method
            self.selection = unvalidated("prior_precision", float(delta), rule, fixed=True)
            self.selection.prior = {k: v for k, v in prior.items() if k != "value"}

    def optimise_prior_marglik(self) -> float:
        """Set ``δ`` to the maximiser of the Laplace marginal likelihood; returns it."""
        if self.log_likelihood is None:
            raise BayescliError("prior_precision='auto' (marglik) needs labelled fitting data; give a number")
        delta, curve = optimise_marglik(self.gaussian, self.log_likelihood)
        self.set_prior_precision(delta, "marglik", curve)
        return delta

    def log_marglik(self, delta: float | None = None) -> float:
        """Laplace log marginal likelihood at ``δ`` (default: the current one)."""
        if self.log_likelihood is None:
            raise BayescliError("the marginal likelihood needs labelled fitting data")
        return float(log_marglik(self.gaussian, self.log_likelihood, delta or self.prior_precision))

    # -- prediction ---------------------------------------------------------------------------

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """GLM logit Gaussian for last-layer features ``phi [N, D]`` (no per-input Jacobian)."""
        if self.subset is not Subset.LAST_LAYER:
            raise BayescliError("this posterior covers all layers; use logit_gaussian_inputs")
        return self.gaussian.push_last_layer(phi.to(self.gaussian.mean.dtype), self.head_bias)

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """GLM logit Gaussian ``N(f(x), J Σ Jᵀ)`` for all-layer posteriors, ``x [N, ...]`` in pixel space."""
        dev = self.gaussian.mean.device
        f, jac = network_jacobian(classifier.net, classifier.normalise(x.to(dev)))
        return self.gaussian.push_jacobian(f, jac)

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """BNN predictive: logits ``[M, N, K]`` of the *network* at ``M`` posterior weight draws."""
        draws = self.gaussian.sample(num, generator)
        if self.subset is Subset.LAST_LAYER:
            phi_aug = augment(phi) if self.head_bias else phi
            w = draws.reshape(num, *self.gaussian.mean.shape)
            return torch.einsum("nd,mkd->mnk", phi_aug.to(w.dtype), w)
        from torch.func import functional_call

        shapes = [(name, p.shape, p.numel()) for name, p in classifier.net.named_parameters()]
        xn = classifier.normalise(x.to(draws.device))
        out = []
        for theta in draws:
            params, offset = {}, 0
            for name, shape, size in shapes:
                params[name] = theta[offset : offset + size].reshape(shape)
                offset += size
            with torch.no_grad():
                out.append(functional_call(classifier.net, params, (xn,)))
        return torch.stack(out)

    # -- files --------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.gaussian.tensors()

    def own_metadata(self) -> dict:
        return {
            "hessian": self.structure,
            "curvature": self.curvature.value,
            "likelihood": self.likelihood,
            "head_bias": self.head_bias,
            "n_data": self.n_data,
            "log_likelihood": self.log_likelihood,
            "prior_precision": self.prior_precision,
        }

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> LaplacePosterior:
        delta = float(meta["prior_precision"])
        mean = tensors["mean"]
        structure = meta["hessian"]
        if structure == "diag":
            gauss: WeightGaussian = DiagGaussian(mean, tensors["curvature_diag"], delta)
        elif structure == "kron":
            gauss = KronGaussian(mean, tensors["kron_G"], tensors["kron_A"], delta)
        else:
            gauss = FullGaussian(mean, tensors["curvature_full"], delta)
        return cls(
            gauss,
            Subset(meta["subset"]),
            CurvatureType(meta["curvature"]),
            bool(meta["head_bias"]),
            int(meta["n_data"]),
            meta.get("log_likelihood"),
            cls.provenance(meta, _OWN_KEYS),
            str(meta.get("likelihood", "categorical")),
        )


_OWN_KEYS = {
    "hessian",
    "curvature",
    "likelihood",
    "head_bias",
    "n_data",
    "log_likelihood",
    "prior_precision",
}


def fit_laplace(
    classifier: Classifier,
    phi: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    subset: Subset | str = Subset.LAST_LAYER,
    structure: HessianStructure | str = HessianStructure.KRON,
    curvature: CurvatureType | str = CurvatureType.GGN,
    backend: Backend | str = Backend.AUTO,
    prior_precision: float | str = "auto",
    batch_size: int = 1024,
    seed: int = 0,
    refine_steps: int = 0,
    features: Iterable[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    likelihood: str = "categorical",
) -> LaplacePosterior:
    """Fit a Laplace approximation and set its prior precision (a float, or ``"auto"`` = marglik).

    Last layer: pass ``phi [N, D]`` (and ``labels``), or ``features``, an iterable of
    ``(phi [B, D], labels [B])`` batches that is consumed once without being held (memory: one
    batch plus the curvature factors). All layers: pass pixel-space ``batches`` (consumed once).
    Choosing δ on validation data needs a predictive and lives in :mod:`bayescli.fitting.laplace`.

    ``refine_steps > 0`` (last layer only) first moves the mode to the optimum of the convex
    linearised objective (:mod:`bayescli.posterior.refine`) with the prior precision chosen at
    ``θ*``, then recomputes the curvature (and, for ``auto``, ``δ``) at the refined mode; both
    modes' objectives are recorded under ``meta["refinement"]``. Refinement optimises over all
    fitting points at once, so it holds every feature in memory (a stream is collected first).

    ``likelihood`` is the classifier's: ``categorical`` (labels ``[N]``) or ``bernoulli``
    (multi-label ``[N, K]``; without refinement).
    """
    start = time.perf_counter()
    last_layer = Subset(subset) is Subset.LAST_LAYER
    if likelihood == "bernoulli" and refine_steps > 0:
        # refine_mode's objective is the softmax GLM's
        raise BayescliError("refine_steps refines softmax posteriors only; use refine_steps=0")
    if last_layer and features is not None and refine_steps > 0:
        pairs = list(features)
        phi = torch.cat([p for p, _ in pairs])
        labels = None if any(y is None for _, y in pairs) else torch.cat([y for _, y in pairs])
        features = None

    def fit(mean: torch.Tensor | None = None) -> LaplacePosterior:
        if last_layer:
            stream = features if features is not None else [(phi, labels)]
            post = LaplacePosterior.fit_last_layer_stream(
                stream, classifier.head, structure, curvature, backend, batch_size, seed, mean, likelihood
            )
        else:
            post = LaplacePosterior.fit_all_layers(
                classifier, batches, structure, curvature, seed, likelihood
            )
        if prior_precision == "auto":
            post.optimise_prior_marglik()
        else:
            post.set_prior_precision(float(prior_precision))
        return post

    post = fit()
    if refine_steps > 0:
        if not last_layer:
            raise BayescliError("refine_steps applies to last-layer posteriors; use subset='last-layer'")
        if labels is None:
            raise BayescliError("refine_steps needs labelled fitting data")
        delta = post.prior_precision
        phi_aug = augment(phi) if post.head_bias else phi
        refined, history = refine_mode(post.gaussian.mean, phi_aug, labels, delta, refine_steps)
        post = fit(refined)
        post.meta["refinement"] = {
            "steps_taken": len(history) - 1,
            "max_steps": refine_steps,
            "prior_precision": delta,
            "objective_at_map": history[0],
            "objective_refined": history[-1],
            "objective_history": history,
        }
    post.meta["fit_seconds"] = time.perf_counter() - start
    return post
