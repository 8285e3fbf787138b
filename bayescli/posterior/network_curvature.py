"""Curvature over all parameters of a (small) network, for softmax and multi-label likelihoods.

``H = Σ_n J_nᵀ B_n J_n`` with ``J_n [K, P]`` the Jacobian of the logits ``f_n`` w.r.t. every
parameter and ``B_n [K, K]`` per input:

===========  ======================================  =======================================
curvature    ``categorical`` (softmax, labels [N])   ``bernoulli`` (sigmoids, labels [N, K])
===========  ======================================  =======================================
``ggn``      ``Λ = diag(p) − ppᵀ``                   ``Λ = diag(p ⊙ (1 − p))``
``ggn-mc``   ``ê êᵀ``, ``ê = p − onehot(ŷ)``, ŷ ~ p    ``ê êᵀ``, ``ê = p − ŷ``, ŷ_k ~ Bern(p_k)
``ef``       ``e eᵀ``, ``e = p − onehot(y)``          ``e eᵀ``, ``e = p − y``
===========  ======================================  =======================================

``diag`` runs BackPACK (``DiagGGNExact``, ``DiagGGNMC``, ``SumGradSquared``) on
``extend(net, use_converter=True)``. BackPACK's ``BCEWithLogitsLoss`` takes one output per
input, so the multi-label loss is a subclass, :class:`MultiLabelBCELoss`, whose loss-Hessian
square root is ``diag(√λ_n)`` ``[K, N, K]`` (``λ = p(1 − p)``): BackPACK then propagates
``K`` columns per input exactly as for the softmax and returns ``Σ_n Σ_k λ_nk (∂f_nk/∂θ)²``.
Networks BackPACK cannot convert fall back to per-input Jacobians (chunked), which give the same
diagonal. ``full`` (≤ 20,000 parameters) sums ``J_nᵀ B_n J_n`` from per-input Jacobians.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from bayescli import devices
from bayescli.errors import BayescliError
from bayescli.metrics.classification import map_probabilities
from bayescli.models.specs import LIKELIHOODS
from bayescli.options import CurvatureType, HessianStructure
from bayescli.posterior.curvature import Curvature, network_jacobian


class MultiLabelBCELoss(nn.BCEWithLogitsLoss):
    """``BCEWithLogitsLoss(reduction="sum")`` over ``[N, K]`` logits, as its own class so BackPACK's
    second-order extensions take :func:`_bce_ggn_extension` for it (their own refuses ``K > 1``)."""

    def __init__(self) -> None:
        super().__init__(reduction="sum")


@functools.cache
def _bce_ggn_extension() -> object:
    """BackPACK's diagonal-GGN loss module for :class:`MultiLabelBCELoss` (built on first use, so
    importing this module does not import BackPACK)."""
    from backpack.core.derivatives.bcewithlogitsloss import BCELossWithLogitsDerivatives
    from backpack.extensions.secondorder.diag_ggn.losses import DiagGGNLoss

    class MultiLabelDerivatives(BCELossWithLogitsDerivatives):
        """Independent Bernoulli outputs: the per-input loss Hessian ``diag(p ⊙ (1 − p))``."""

        def _check_input_dims(self, module: nn.Module) -> None:
            if module.input0.dim() != 2:
                raise NotImplementedError("multi-label logits must be [N, K]")

        def _check_binary(self, module: nn.Module) -> None:
            # BackPACK's own check loops over the elements in Python
            target = module.input1
            if not bool(((target == 0) | (target == 1)).all()):
                raise NotImplementedError("multi-label targets must be 0 or 1")

        def _sqrt_hessian(
            self, module: nn.Module, g_inp: tuple, g_out: tuple, subsampling: list[int] | None
        ) -> torch.Tensor:
            """``S [K, N, K]`` with ``S[c, n, c'] = δ_cc' √λ_nc``, so ``Σ_c S[c,n] S[c,n]ᵀ = Λ_n``."""
            self._check_is_default(module)
            self._check_input_dims(module)
            logits = module.input0 if subsampling is None else module.input0[subsampling]
            p = logits.sigmoid()
            return torch.diag_embed((p * (1 - p)).sqrt()).transpose(0, 1)

    return DiagGGNLoss(derivatives=MultiLabelDerivatives())


def _loss_hessian(probs: torch.Tensor, likelihood: str) -> torch.Tensor:
    """Per-input ``Λ [N, K, K]`` (module docs)."""
    if likelihood == "bernoulli":
        return torch.diag_embed(probs * (1 - probs))
    return torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]


def _loss_hessian_root(probs: torch.Tensor, likelihood: str) -> torch.Tensor:
    """``S [N, K, K]`` with ``S Sᵀ = Λ``: ``diag(√(p(1 − p)))`` for ``bernoulli``; for the softmax
    ``diag(√p) − p √pᵀ`` (``S Sᵀ = diag(p) − 2ppᵀ + pᵀ1·ppᵀ``)."""
    if likelihood == "bernoulli":
        return torch.diag_embed((probs * (1 - probs)).sqrt())
    root = probs.sqrt()
    return torch.diag_embed(root) - probs[:, :, None] * root[:, None, :]


def _residual(probs: torch.Tensor, labels: torch.Tensor, likelihood: str) -> torch.Tensor:
    """``p − y`` ``[N, K]`` of labels ``[N]`` (one-hot) or multi-label ``[N, K]``."""
    if likelihood == "bernoulli":
        return probs - labels.to(probs.dtype)
    return probs - nn.functional.one_hot(labels, probs.shape[-1]).to(probs.dtype)


def _map_labels(logits: torch.Tensor, likelihood: str) -> torch.Tensor:
    """The MAP's labels where the data has none: the argmax class ``[N]``, or ``f > 0`` ``[N, K]``
    (the exact GGN does not depend on them)."""
    return (logits > 0).to(logits.dtype) if likelihood == "bernoulli" else logits.argmax(1)


def _sample_labels(probs: torch.Tensor, likelihood: str, gen: torch.Generator) -> torch.Tensor:
    """One label per input from the model: a class ``[N]``, or ``[N, K]`` Bernoulli draws."""
    if likelihood == "bernoulli":
        return torch.bernoulli(probs, generator=gen)
    return torch.multinomial(probs.double(), 1, generator=gen).squeeze(1)


def all_layer_curvature(
    net: nn.Module,
    inputs: Iterator[tuple[torch.Tensor, torch.Tensor | None]],
    structure: HessianStructure,
    curvature: CurvatureType = CurvatureType.GGN,
    seed: int = 0,
    likelihood: str = "categorical",
) -> Curvature:
    """Curvature over all parameters of ``net`` (``inputs`` already normalised, with labels ``[B]``,
    or ``[B, K]`` in ``{0, 1}`` for ``likelihood="bernoulli"``, or ``None``).

    ``diag`` → ``[P]``; ``full`` (≤ 20,000 parameters) → ``[P, P]`` (module docs).
    """
    structure, curvature = HessianStructure(structure), CurvatureType(curvature)
    if likelihood not in LIKELIHOODS:
        raise BayescliError(f"unknown likelihood '{likelihood}'; use 'categorical' or 'bernoulli'")
    if structure is HessianStructure.KRON:
        raise BayescliError("all-layer kron is not supported; use subset='last-layer' or hessian='diag'")
    n_params = sum(p.numel() for p in net.parameters())
    if structure is HessianStructure.FULL and n_params > 20_000:
        raise BayescliError(
            f"subset='all' with hessian='full' needs ≤ 20,000 parameters; this network has {n_params:,}. "
            "Use hessian='diag' or subset='last-layer'"
        )
    torch.manual_seed(seed)  # BackPACK's MC extensions draw from the global generator
    gen = devices.generator(next(net.parameters()).device, seed)
    if structure is HessianStructure.DIAG:
        return _all_layer_diag_backpack(net, inputs, curvature, gen, likelihood)
    return _all_layer_full(net, inputs, curvature, gen, likelihood)


def _all_layer_diag_backpack(
    net: nn.Module, inputs: Iterator, curvature: CurvatureType, gen: torch.Generator, likelihood: str
) -> Curvature:
    """BackPACK's diagonal extensions; networks BackPACK cannot convert or extend (a ``torch.cat``
    in SqueezeNet's Fire modules, hooks of output adapters) fall back to
    :func:`_all_layer_diag_jacobian`, which gives the same diagonal from per-input Jacobians."""
    from backpack import backpack, extend
    from backpack.extensions import DiagGGNExact, DiagGGNMC, SumGradSquared

    ext, field = {
        CurvatureType.GGN: (DiagGGNExact, "diag_ggn_exact"),
        CurvatureType.GGN_MC: (DiagGGNMC, "diag_ggn_mc"),
        CurvatureType.EF: (SumGradSquared, "sum_grad_squared"),
    }[curvature]
    model = copy.deepcopy(net).eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = extend(model, use_converter=True)
    except Exception:  # BackPACK/fx raise many types for graphs they cannot convert
        return _all_layer_diag_jacobian(net, inputs, curvature, gen, likelihood)
    extension = ext()
    if likelihood == "bernoulli":
        loss_fn = extend(MultiLabelBCELoss())
        if curvature is not CurvatureType.EF:  # first-order extensions need nothing of the loss
            extension.set_module_extension(MultiLabelBCELoss, _bce_ggn_extension())
    else:
        loss_fn = extend(nn.CrossEntropyLoss(reduction="sum"))
    total, n = None, 0
    for x, y in inputs:
        model.zero_grad()
        out = model(x)
        targets = _map_labels(out.detach(), likelihood) if y is None else y
        if likelihood == "bernoulli":
            targets = targets.to(out.dtype)  # BCEWithLogitsLoss takes float targets
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                with backpack(extension):
                    loss_fn(out, targets).backward()
            # BackPACK refuses unsupported modules with NotImplementedError and graphs its converter
            # could not rewrite (a torch.cat of branches) with an AssertionError on the first backward
            except (NotImplementedError, AssertionError):
                if n:  # whatever BackPACK cannot handle, it cannot handle on the first batch
                    raise
                chained = itertools.chain([(x, y)], inputs)
                return _all_layer_diag_jacobian(net, chained, curvature, gen, likelihood)
        part = torch.cat([getattr(p, field).detach().reshape(-1) for p in model.parameters()])
        total = part if total is None else total + part
        n += len(x)
    return Curvature(HessianStructure.DIAG, n, diag=total)


# Per-input Jacobians held at once by the fallback: chunk × K × P floats.
_JACOBIAN_FLOATS = 2**25


def _all_layer_diag_jacobian(
    net: nn.Module,
    inputs: Iterator,
    curvature: CurvatureType,
    gen: torch.Generator,
    likelihood: str = "categorical",
) -> Curvature:
    """Diagonal GGN / MC-GGN / empirical Fisher over all parameters from per-input Jacobians.

    ``diag(Jᵀ Λ J) = Σ_k (Jᵀ s_k)²`` over the columns of ``S`` (``S Sᵀ = Λ``,
    :func:`_loss_hessian_root`); MC-GGN and EF square ``Jᵀ(p − y)`` with a sampled or the true
    label. Exact like BackPACK's extensions, for any network ``torch.func`` can differentiate; the
    Jacobians ``[n, K, P]`` are formed for chunks of inputs only.
    """
    n_params = sum(p.numel() for p in net.parameters())
    total, n, chunk = None, 0, None
    for x, y in inputs:
        if chunk is None:
            with torch.no_grad():
                k = net(x[:1]).shape[1]
            chunk = max(1, _JACOBIAN_FLOATS // (k * n_params))
        for lo in range(0, len(x), chunk):
            logits, jac = network_jacobian(net, x[lo : lo + chunk])
            probs = map_probabilities(logits, likelihood)
            if curvature is CurvatureType.GGN:
                root = _loss_hessian_root(probs, likelihood)
                part = torch.einsum("nkp,nkl->nlp", jac, root).square().sum((0, 1))
            else:
                if curvature is CurvatureType.GGN_MC:
                    labels = _sample_labels(probs, likelihood, gen)
                else:
                    labels = _map_labels(logits, likelihood) if y is None else y[lo : lo + chunk]
                part = torch.einsum("nk,nkp->np", _residual(probs, labels, likelihood), jac).square().sum(0)
            total = part if total is None else total + part
        n += len(x)
    return Curvature(HessianStructure.DIAG, n, diag=total)


def _all_layer_full(
    net: nn.Module, inputs: Iterator, curvature: CurvatureType, gen: torch.Generator, likelihood: str
) -> Curvature:
    total, n = None, 0
    for x, y in inputs:
        logits, jac = network_jacobian(net, x)
        probs = map_probabilities(logits, likelihood)
        if curvature is CurvatureType.GGN:
            part = torch.einsum("nkp,nkl,nlq->pq", jac, _loss_hessian(probs, likelihood), jac)
        else:
            labels = y if curvature is CurvatureType.EF else _sample_labels(probs, likelihood, gen)
            if labels is None:
                raise BayescliError("curvature='ef' needs labelled fitting data")
            g = torch.einsum("nk,nkp->np", _residual(probs, labels, likelihood), jac)
            part = g.T @ g
        total = part if total is None else total + part
        n += len(x)
    return Curvature(HessianStructure.FULL, n, full=total)
