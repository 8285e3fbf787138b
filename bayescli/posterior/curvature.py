"""Curvature of the softmax cross-entropy loss, summed over the data.

Quantities (``p = softmax(f)``, ``Λ = diag(p) − ppᵀ``, ``φ̃ = [φ; 1]``, ``e = p − onehot(y)``):

=============  ============================  =====================================
curvature      per-input block of ``H``       BackPACK extension (head / all layers)
=============  ============================  =====================================
``ggn``        ``Λ ⊗ φ̃φ̃ᵀ`` (exact GGN)        ``DiagGGNExact``, ``KFLR``
``ggn-mc``     ``e ê ᵀ⊗ φ̃φ̃ᵀ``, ``ŷ ~ p``       ``DiagGGNMC``, ``KFAC`` (1 MC label)
``ef``         ``e eᵀ ⊗ φ̃φ̃ᵀ`` (empirical)     ``SumGradSquared``
=============  ============================  =====================================

Structures for a last-layer head ``[K, D+1]``: ``diag`` → ``h [K, D+1]``; ``kron`` →
``G [K,K] = Σ_n B_n`` and ``A [D+1,D+1] = (1/N) Σ_n φ̃φ̃ᵀ`` (the expectation approximation
``Σ_n B_n ⊗ φ̃_nφ̃_nᵀ ≈ G ⊗ A``, exact when ``B_n`` is constant); ``full`` → ``[P, P]``.

Two backends give the same numbers for the last layer:

* ``backpack`` runs BackPACK on a bias-free ``Linear(D+1 → K)`` fed ``φ̃`` (so its KFLR factors
  are exactly ``G`` and ``A`` above) with ``reduction="sum"`` and accumulates over batches
  (BackPACK overwrites its fields on every backward pass);
* ``closed-form`` evaluates the formulas above directly. Exact BackPACK extensions propagate
  a ``K``-column square root of ``Λ`` (cost ``O(N K³)`` for KFLR): 7.5 s per batch of 256 for a
  512→1000 head here, against milliseconds for ``diag(Σp) − PᵀP``.

``auto`` (default) uses the closed form for ``ggn`` and ``ef`` and BackPACK for ``ggn-mc``.
All-layer curvature (either likelihood) is in :mod:`bayescli.posterior.network_curvature`; the
per-input Jacobians it and the all-layer predictives use come from :func:`network_jacobian`.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from bayescli import devices, parallel
from bayescli.errors import BayescliError
from bayescli.options import Backend, CurvatureType, HessianStructure
from bayescli.posterior.gaussian import MAX_FULL_PARAMS


@dataclass
class Curvature:
    """Summed curvature; exactly one of ``diag``, ``kron`` (``(G, A)``) or ``full`` is set."""

    structure: HessianStructure
    n_data: int
    diag: torch.Tensor | None = None
    kron: tuple[torch.Tensor, torch.Tensor] | None = None
    full: torch.Tensor | None = None


def _residual(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return probs - nn.functional.one_hot(labels, probs.shape[-1]).to(probs.dtype)


def _closed_form_batch(
    structure: HessianStructure,
    curvature: CurvatureType,
    phi_aug: torch.Tensor,
    probs: torch.Tensor,
    labels: torch.Tensor | None,
    gen: torch.Generator,
) -> tuple:
    """This batch's contribution (sums over the batch)."""
    if curvature is CurvatureType.GGN:
        if structure is HessianStructure.DIAG:
            return ((probs - probs.pow(2)).T @ phi_aug.pow(2),)
        if structure is HessianStructure.KRON:
            return (torch.diag(probs.sum(0)) - probs.T @ probs, phi_aug.T @ phi_aug)
        k, d1 = probs.shape[1], phi_aug.shape[1]
        block = torch.einsum("nk,nd,ne->kde", probs, phi_aug, phi_aug)
        outer = (probs[:, :, None] * phi_aug[:, None, :]).reshape(len(probs), -1)
        full = torch.block_diag(*block) - outer.T @ outer
        return (full.reshape(k * d1, k * d1),)
    if curvature is CurvatureType.EF:
        err = _residual(probs, labels)
    else:  # one sampled label per input: E[e eᵀ] = Λ
        sampled = torch.multinomial(probs.double(), 1, generator=gen).squeeze(1)
        err = _residual(probs, sampled)
    return outer_product_factors(structure, err, phi_aug)


def outer_product_factors(
    structure: HessianStructure, err: torch.Tensor, phi_aug: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``Σ_b (e_b e_bᵀ) ⊗ (φ̃_bφ̃_bᵀ)`` of residuals ``err [B, K]`` (empirical and MC Fisher, any
    likelihood): its diagonal ``[K, D+1]``, its Kronecker factors, or the dense ``[P, P]``."""
    if structure is HessianStructure.DIAG:
        return (err.pow(2).T @ phi_aug.pow(2),)
    if structure is HessianStructure.KRON:
        return (err.T @ err, phi_aug.T @ phi_aug)
    grads = (err[:, :, None] * phi_aug[:, None, :]).reshape(len(err), -1)  # [B, P] per-input gradients
    return (grads.T @ grads,)


def _backpack_batch(
    structure: HessianStructure,
    curvature: CurvatureType,
    lin: nn.Module,
    loss_fn: nn.Module,
    phi_aug: torch.Tensor,
    targets: torch.Tensor,
) -> tuple:
    from backpack import backpack
    from backpack.extensions import KFAC, KFLR, DiagGGNExact, DiagGGNMC, SumGradSquared

    ext = {
        (HessianStructure.DIAG, CurvatureType.GGN): (DiagGGNExact, "diag_ggn_exact"),
        (HessianStructure.DIAG, CurvatureType.GGN_MC): (DiagGGNMC, "diag_ggn_mc"),
        (HessianStructure.DIAG, CurvatureType.EF): (SumGradSquared, "sum_grad_squared"),
        (HessianStructure.KRON, CurvatureType.GGN): (KFLR, "kflr"),
        (HessianStructure.KRON, CurvatureType.GGN_MC): (KFAC, "kfac"),
    }.get((structure, curvature))
    if ext is None:
        raise BayescliError(
            f"BackPACK has no {structure.value} {curvature.value} extension; use backend='closed-form'"
        )
    lin.zero_grad()
    loss = loss_fn(lin(phi_aug), targets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "full backward hook ... no inputs require grad"
        with backpack(ext[0]()):
            loss.backward()
    value = getattr(lin.weight, ext[1])
    if structure is HessianStructure.KRON:
        G, A = value
        return (G.detach().clone(), A.detach() * len(phi_aug))  # BackPACK's A is a batch mean
    return (value.detach().clone(),)


def curvature_row_bytes(k: int, d1: int, structure: HessianStructure) -> int:
    """Bytes a closed-form curvature chunk keeps live per row of a ``[K, D+1]`` head: float64
    ``φ̃`` and ``φ̃²`` or its products (``4(D+1)`` numbers), logits, probabilities, ``λ`` or the
    residual and their squares (``6K``), and for ``full`` the per-input ``[K, D+1]`` products
    (twice: the einsum's or the gradients' and their reshape)."""
    numbers = 4 * d1 + 6 * k + (2 * k * d1 if structure is HessianStructure.FULL else 0)
    return 8 * numbers


class ChunkedAccumulator(ABC):
    """What every last-layer curvature accumulator shares: rows regrouped into chunks of exactly
    ``batch_size`` rows on a CPU, on CUDA of the device's budget over :func:`curvature_row_bytes`
    (:func:`bayescli.devices.chunk_elements`; ``sized_by_device=False`` keeps ``batch_size``).
    Either way the chunk is fixed for the fit, so the result does not depend on how the stream
    was batched: a streamed fit equals the in-memory one to the last bit. Float64 sums of the
    chunks' factors and of the log-likelihood (while every batch has labels), the all-reduce of
    per-process sums under ``torchrun``, and the :class:`Curvature` they make; ``full`` is refused past
    :data:`~bayescli.posterior.gaussian.MAX_FULL_PARAMS` parameters. A subclass computes one chunk
    in :meth:`_chunk`, adding it with :meth:`_add`.
    """

    def __init__(
        self,
        weight_aug: torch.Tensor,
        structure: HessianStructure,
        curvature: CurvatureType,
        batch_size: int,
        seed: int,
        sized_by_device: bool = True,
    ) -> None:
        k, d1 = weight_aug.shape
        if structure is HessianStructure.FULL and k * d1 > MAX_FULL_PARAMS:
            raise BayescliError(
                f"hessian='full' on a {d1 - 1}→{k} head has {k * d1:,} parameters "
                f"(limit {MAX_FULL_PARAMS:,}); use hessian='kron' or 'diag'"
            )
        if sized_by_device:
            batch_size = devices.chunk_elements(
                weight_aug.device, batch_size, curvature_row_bytes(k, d1, structure)
            )
        self.structure, self.curvature, self.batch_size = structure, curvature, batch_size
        self.gen = devices.generator(weight_aug.device, seed)
        self.totals: list[torch.Tensor] | None = None
        self.n = 0
        self.log_lik = torch.zeros((), dtype=torch.float64, device=weight_aug.device)
        self.labelled = True
        self._phi: list[torch.Tensor] = []
        self._labels: list[torch.Tensor | None] = []
        self._buffered = 0

    def update(self, phi_aug: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Add a batch of features ``phi_aug [B, D+1]`` (``φ̃``, or ``φ`` for a bias-free head) and
        its labels (``None``: unlabelled, allowed for ``ggn`` and ``ggn-mc``)."""
        if labels is None:
            if self.curvature is CurvatureType.EF:
                raise BayescliError("curvature='ef' needs labelled fitting data")
            self.labelled = False
        self._phi.append(phi_aug)
        self._labels.append(labels)
        self._buffered += len(phi_aug)
        while self._buffered >= self.batch_size:
            self._drain(self.batch_size)

    def _drain(self, rows: int) -> None:
        phi = torch.cat(self._phi) if len(self._phi) > 1 else self._phi[0]
        labels = (
            None
            if not self.labelled
            else torch.cat(self._labels)
            if len(self._labels) > 1
            else self._labels[0]
        )
        self._chunk(phi[:rows], None if labels is None else labels[:rows])
        rest = len(phi) - rows
        self._phi = [phi[rows:]] if rest else []
        self._labels = [None if labels is None else labels[rows:]] if rest else []
        self._buffered = rest

    @abstractmethod
    def _chunk(self, phi: torch.Tensor, labels: torch.Tensor | None) -> None:
        """Compute one chunk's factors and log-likelihood and :meth:`_add` them."""

    def _add(self, part: tuple[torch.Tensor, ...], rows: int, log_lik: torch.Tensor | None) -> None:
        """Sum a chunk's factors (in float64 whatever the batch dtype) and its log-likelihood."""
        part = [p.double() for p in part]
        self.totals = part if self.totals is None else [t + p for t, p in zip(self.totals, part, strict=True)]
        self.n += rows
        if log_lik is not None:
            self.log_lik += log_lik

    def finish(self) -> Curvature:
        """The summed curvature of every row added (``A`` of ``kron`` is the mean, see module docs)."""
        if self._buffered:
            self._drain(self._buffered)
        if self.totals is None:
            raise BayescliError("no fitting data: the feature stream was empty")
        if parallel.world().distributed:
            # Each process summed its shard; the sums of all shards are the one-process sums.
            self.totals = [parallel.all_reduce_sum(t) for t in self.totals]
            self.n = int(parallel.all_reduce_sum(torch.tensor([float(self.n)])).item())
            self.log_lik = parallel.all_reduce_sum(self.log_lik.reshape(1))[0]
            self.labelled = parallel.all_reduce_max(0.0 if self.labelled else 1.0) == 0.0
        n, totals = self.n, self.totals
        if self.structure is HessianStructure.DIAG:
            return Curvature(self.structure, n, diag=totals[0])
        if self.structure is HessianStructure.KRON:
            return Curvature(self.structure, n, kron=(totals[0], totals[1] / n))
        return Curvature(self.structure, n, full=totals[0])

    @property
    def log_likelihood(self) -> float | None:
        """``Σ_n log p(y_n | x_n, W̃)`` over the rows added, or ``None`` if any batch had no labels."""
        return float(self.log_lik) if self.labelled and self.n else None


class CurvatureAccumulator(ChunkedAccumulator):
    """Last-layer softmax curvature and log-likelihood of the head ``f = W̃ φ̃`` summed batch by batch.

    ``update(phi_aug [B, D+1], labels [B] or None)`` any number of times, then :meth:`finish`
    (:class:`ChunkedAccumulator`). Memory: one chunk of ``φ̃`` plus the factors. Everything stays
    on ``weight_aug``'s device (the float64 sums included): no batch goes back to the host.
    The log-likelihood is ``Σ log softmax(W̃φ̃)_y`` (float64).
    """

    def __init__(
        self,
        weight_aug: torch.Tensor,
        structure: HessianStructure = HessianStructure.KRON,
        curvature: CurvatureType = CurvatureType.GGN,
        backend: Backend = Backend.AUTO,
        batch_size: int = 1024,
        seed: int = 0,
    ) -> None:
        structure, curvature, backend = (
            HessianStructure(structure),
            CurvatureType(curvature),
            Backend(backend),
        )
        if backend is Backend.AUTO:
            backend = Backend.BACKPACK if curvature is CurvatureType.GGN_MC else Backend.CLOSED_FORM
        if backend is Backend.BACKPACK and structure is HessianStructure.FULL:
            backend = Backend.CLOSED_FORM  # BackPACK has no dense-GGN extension for a layer
        # BackPACK's intermediates (per-input square roots of Λ, per-input gradients) are its
        # own, not curvature_row_bytes': its chunks stay at batch_size on every device
        sized = backend is Backend.CLOSED_FORM
        super().__init__(weight_aug, structure, curvature, batch_size, seed, sized_by_device=sized)
        k = weight_aug.shape[0]
        self.backend = backend
        weight_aug = weight_aug.detach()
        if structure is HessianStructure.FULL:
            weight_aug = weight_aug.double()  # its eigendecomposition needs the accuracy
        self.weight = weight_aug
        self.weight64 = weight_aug.double()
        if backend is Backend.BACKPACK:
            from backpack import extend

            torch.manual_seed(seed)  # BackPACK's MC extensions draw from the global generator
            self.lin = extend(nn.Linear(weight_aug.shape[1], k, bias=False).to(weight_aug))
            self.lin.weight.data.copy_(weight_aug)
            self.loss_fn = extend(nn.CrossEntropyLoss(reduction="sum"))

    def _chunk(self, phi: torch.Tensor, labels: torch.Tensor | None) -> None:
        xb = phi.to(self.weight)
        if self.backend is Backend.BACKPACK:
            with torch.no_grad():
                logits = xb @ self.weight.T
                targets = labels if labels is not None else logits.argmax(1)
            part = _backpack_batch(self.structure, self.curvature, self.lin, self.loss_fn, xb, targets)
        else:
            # float64 per batch: the factors are then sums of rounded-to-1e-16 terms, so a split
            # of the data into other batches or process shards changes them by ~1e-15 only.
            xb = xb.double()
            logits = xb @ self.weight64.T
            part = _closed_form_batch(
                self.structure, self.curvature, xb, logits.softmax(-1), labels, self.gen
            )
        log_lik = (
            None if labels is None else -nn.functional.cross_entropy(logits.double(), labels, reduction="sum")
        )
        self._add(part, len(xb), log_lik)


def last_layer_curvature(
    phi_aug: torch.Tensor,
    weight_aug: torch.Tensor,
    labels: torch.Tensor | None,
    structure: HessianStructure = HessianStructure.KRON,
    curvature: CurvatureType = CurvatureType.GGN,
    backend: Backend = Backend.AUTO,
    batch_size: int = 1024,
    seed: int = 0,
) -> Curvature:
    """Curvature of the head ``f = W̃ φ̃`` over features ``phi_aug [N, D+1]`` (``W̃ [K, D+1]``).

    ``phi_aug`` is ``φ̃ = [φ; 1]`` for heads with a bias and plain ``φ`` for heads without.

    Returns sums over the ``N`` inputs (``A`` of ``kron`` is the mean, see module docs).
    ``labels [N]`` are needed for ``ef``; ``ggn`` ignores them, ``ggn-mc`` samples its own.
    The same as feeding :class:`CurvatureAccumulator` the rows in any batches.
    """
    acc = CurvatureAccumulator(weight_aug, structure, curvature, backend, batch_size, seed)
    acc.update(phi_aug, labels)
    return acc.finish()


def network_jacobian(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N, K]`` and per-input Jacobians ``[N, K, P]`` w.r.t. all parameters of ``net``."""
    from torch.func import functional_call, jacrev, vmap

    params = {name: p.detach() for name, p in net.named_parameters()}

    def f(p: dict, xi: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xi.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    flat = torch.cat([j.reshape(x.shape[0], j.shape[1], -1) for j in jac.values()], dim=2)
    with torch.no_grad():
        logits = net(x)
    return logits, flat
