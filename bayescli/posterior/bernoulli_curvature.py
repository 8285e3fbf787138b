"""Curvature of the summed binary cross-entropy of a multi-label (sigmoid-per-class) head.

The head ``f = W̃ φ̃`` (``W̃ [K, D+1]`` flattened row-major, ``φ̃ = [φ; 1]`` of shape ``[D+1]``)
models ``K`` independent labels ``y_k ∈ {0, 1}`` with ``p = sigmoid(f)`` and the loss
``L(W̃) = −Σ_n Σ_k [y_nk log p_nk + (1 − y_nk) log(1 − p_nk)]``. Per input the Hessian of the
loss w.r.t. the logits is ``Λ_n = diag(p_n ⊙ (1 − p_n))`` (the labels are independent, so it is
diagonal), and the Jacobian ``J_n = I_K ⊗ φ̃_nᵀ`` is linear in ``W̃``, so the GGN ``Σ_n J_nᵀ Λ_n J_n``
*is* the Hessian of ``L`` w.r.t. ``W̃``. With ``λ_nk = p_nk (1 − p_nk)`` and ``e = p − y``:

=============  ==================================  ==========================================
curvature      per-input block of ``H``             structures (last layer)
=============  ==================================  ==========================================
``ggn``        ``diag(λ_n) ⊗ φ̃_nφ̃_nᵀ`` (exact)       diag ``h[k,d] = Σ_n λ_nk φ̃_nd²``;
                                                   kron ``G = diag(Σ_n λ_n)``;
                                                   full: block-diagonal, block ``k`` is
                                                   ``Σ_n λ_nk φ̃_nφ̃_nᵀ``
``ggn-mc``     ``ê_n ê_nᵀ ⊗ φ̃_nφ̃_nᵀ``, ``ŷ ~ Bern(p)``  as ``ef`` with a sampled label
                                                   (``E[ê êᵀ] = diag(λ_n)``)
``ef``         ``e_n e_nᵀ ⊗ φ̃_nφ̃_nᵀ`` (empirical)     diag ``Σ_n e_nk² φ̃_nd²``;
                                                   kron ``G = Σ_n e_n e_nᵀ``; full ``Σ g gᵀ``
=============  ==================================  ==========================================

``kron`` follows :mod:`bayescli.posterior.curvature`: ``G [K, K] = Σ_n B_n`` and
``A [D+1, D+1] = (1/N) Σ_n φ̃_nφ̃_nᵀ`` (the expectation approximation
``Σ_n B_n ⊗ φ̃_nφ̃_nᵀ ≈ G ⊗ A``), so :class:`~bayescli.posterior.gaussian.KronGaussian` consumes it
unchanged. For the Bernoulli GGN ``G`` is diagonal. The *exact* GGN is block-diagonal over
classes (``K`` blocks ``Σ_n λ_nk φ̃_nφ̃_nᵀ`` of ``[D+1, D+1]``): ``full`` builds those blocks
(``O(N K D²)``, never a per-input Jacobian) and returns the dense ``[P, P]`` matrix,
``P = K(D+1) ≤ 20,000``, that :class:`~bayescli.posterior.gaussian.FullGaussian` expects.

Every quantity is a closed form of ``p``, ``y`` and ``φ̃``; there is no BackPACK backend (its
``BCEWithLogitsLoss`` support is limited to one output per input).
"""

from __future__ import annotations

import torch
from torch import nn

from bayescli.errors import BayescliError
from bayescli.options import CurvatureType, HessianStructure
from bayescli.posterior.curvature import ChunkedAccumulator, Curvature, outer_product_factors


def check_multilabel(labels: torch.Tensor, n: int, k: int) -> None:
    """Raise :class:`BayescliError` unless ``labels`` has shape ``[n, k]`` and entries in ``{0, 1}``."""
    if labels.shape != (n, k):
        raise BayescliError(
            f"multi-label targets must have shape [N, K] = [{n}, {k}], got {list(labels.shape)}"
        )
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise BayescliError("multi-label targets must be 0 or 1 (one binary label per class)")


def bernoulli_log_likelihood(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``Σ_nk [y log p + (1 − y) log(1 − p)]`` with ``p = sigmoid(logits)``, as a float64 scalar.

    ``logits [N, K]``, ``labels [N, K]`` in ``{0, 1}``. Evaluated as ``−Σ [softplus(f) − y f]``
    (PyTorch's ``binary_cross_entropy_with_logits``), which is exact for any logit magnitude
    where ``log sigmoid`` would round to ``log 0``.
    """
    check_multilabel(labels, *logits.shape)
    return -nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double(), reduction="sum")


def _closed_form_batch(
    structure: HessianStructure,
    curvature: CurvatureType,
    phi_aug: torch.Tensor,
    probs: torch.Tensor,
    labels: torch.Tensor | None,
    gen: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """This batch's contribution (sums over its rows): ``phi_aug [B, D+1]``, ``probs [B, K]``."""
    if curvature is CurvatureType.GGN:
        lam = probs * (1 - probs)  # [B, K]
        if structure is HessianStructure.DIAG:
            return (lam.T @ phi_aug.pow(2),)
        if structure is HessianStructure.KRON:
            return (torch.diag(lam.sum(0)), phi_aug.T @ phi_aug)
        k, d1 = probs.shape[1], phi_aug.shape[1]
        # block k = Σ_n λ_nk φ̃_nφ̃_nᵀ; the classes do not couple, so the rest of [P, P] is zero
        blocks = torch.einsum("nk,nd,ne->kde", lam, phi_aug, phi_aug)
        return (torch.block_diag(*blocks).reshape(k * d1, k * d1),)
    if curvature is CurvatureType.EF:
        err = probs - labels.to(probs.dtype)
    else:  # one sampled label vector per input: E[ê êᵀ] = diag(p(1 − p)) = Λ
        err = probs - torch.bernoulli(probs, generator=gen)
    return outer_product_factors(structure, err, phi_aug)


class BernoulliCurvatureAccumulator(ChunkedAccumulator):
    """Last-layer BCE curvature and Bernoulli log-likelihood of ``f = W̃ φ̃``, summed batch by batch.

    The multi-label counterpart of :class:`~bayescli.posterior.curvature.CurvatureAccumulator`,
    with the same contract (:class:`~bayescli.posterior.curvature.ChunkedAccumulator`):
    ``update(phi_aug [B, D+1], labels [B, K] or None)`` any number of times, then :meth:`finish`.
    Every chunk is computed in float64; everything stays on ``weight_aug``'s device.
    """

    def __init__(
        self,
        weight_aug: torch.Tensor,
        structure: HessianStructure = HessianStructure.KRON,
        curvature: CurvatureType = CurvatureType.GGN,
        batch_size: int = 1024,
        seed: int = 0,
    ) -> None:
        structure, curvature = HessianStructure(structure), CurvatureType(curvature)
        if weight_aug.dim() != 2:
            raise BayescliError(f"head weights must be [K, D+1], got shape {list(weight_aug.shape)}")
        super().__init__(weight_aug, structure, curvature, batch_size, seed)
        self.weight64 = weight_aug.detach().double()

    def update(self, phi_aug: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Add features ``phi_aug [B, D+1]`` (``φ̃``, or ``φ`` for a bias-free head) and their
        labels ``[B, K]`` in ``{0, 1}`` (``None``: unlabelled, allowed for ``ggn`` and ``ggn-mc``)."""
        k, d1 = self.weight64.shape
        if phi_aug.dim() != 2 or phi_aug.shape[1] != d1:
            raise BayescliError(f"features must be [B, {d1}] for this head, got {list(phi_aug.shape)}")
        if labels is not None:
            check_multilabel(labels, len(phi_aug), k)
        super().update(phi_aug, labels)

    def _chunk(self, phi: torch.Tensor, labels: torch.Tensor | None) -> None:
        # float64 per chunk: the factors are sums of terms rounded to 1e-16, so other batch or
        # process splits change them by ~1e-15 only (as in the softmax accumulator)
        xb = phi.to(self.weight64)
        logits = xb @ self.weight64.T
        part = _closed_form_batch(self.structure, self.curvature, xb, torch.sigmoid(logits), labels, self.gen)
        self._add(part, len(xb), None if labels is None else bernoulli_log_likelihood(logits, labels))


def bernoulli_last_layer_curvature(
    phi_aug: torch.Tensor,
    weight_aug: torch.Tensor,
    labels: torch.Tensor | None,
    structure: HessianStructure = HessianStructure.KRON,
    curvature: CurvatureType = CurvatureType.GGN,
    batch_size: int = 1024,
    seed: int = 0,
) -> Curvature:
    """BCE curvature of the head ``f = W̃ φ̃`` over ``phi_aug [N, D+1]`` (``W̃ [K, D+1]``).

    Returns sums over the ``N`` inputs (``A`` of ``kron`` is the mean, see module docs).
    ``labels [N, K]`` in ``{0, 1}`` are needed for ``ef``; ``ggn`` ignores them, ``ggn-mc``
    samples its own. The same as feeding :class:`BernoulliCurvatureAccumulator` the rows in any
    batches.
    """
    acc = BernoulliCurvatureAccumulator(weight_aug, structure, curvature, batch_size, seed)
    acc.update(phi_aug, labels)
    return acc.finish()
