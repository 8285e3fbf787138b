"""Post-hoc OOD detectors: the baselines of OpenOOD / pytorch-ood, on features and logits.

Every score is oriented so that **higher means in-distribution**, like the Bayesian scores.
Statistics are fitted on in-distribution fitting data only (``phi [N, D]``, labels ``[N]``);
nothing here ever sees an OOD set before scoring it.

* ``max_logit``: ``max_k f_k`` (Hendrycks et al. 2022).
* ``energy``: ``T·logsumexp(f/T)`` (Liu et al. 2020; the negative free energy).
* Mahalanobis (Lee et al. 2018, feature version): class means ``μ_c`` and the shared
  within-class covariance ``Σ`` of ``φ``; score ``−min_c (φ−μ_c)ᵀ Σ⁻¹ (φ−μ_c)``.
* relative Mahalanobis (Ren et al. 2021): ``MD_0(φ) − min_c MD_c(φ)``, ``MD_0`` the distance to
  the mean of all fitting features under their (total) covariance.
* KNN (Sun et al. 2022): ``−‖z − z_(k)‖`` with ``z = φ/‖φ‖`` and ``z_(k)`` its k-th nearest
  normalised fitting feature.
* ViM (Wang et al. 2022): ``logsumexp(f) − a·‖P⊥(φ − o)‖`` with origin ``o = −W⁺b``, ``P⊥`` the
  projection on the non-principal eigenvectors of ``E[(φ−o)(φ−o)ᵀ]`` and ``a`` matching the
  residual's mean to the mean max-logit on the fitting data.
* ReAct (Sun et al. 2021): energy of ``W min(φ, c) + b`` with ``c`` a percentile of the fitting
  activations.
* ODIN (Liang et al. 2018): ``max softmax(f(x̃)/T)`` with ``x̃ = x + ε·sign ∇ₓ log max softmax(f(x)/T)``.

Covariances are formed in float64 (products of float32 features lose the small eigenvalues:
5,000 × 303 full-rank features gave a smallest eigenvalue of −6e-9 against a ridge of 3e-9) and
inverted through Cholesky solves (never an explicit inverse), with a ridge ``r·tr(Σ)/D`` that
keeps dead ReLU units from making ``Σ`` singular; Mahalanobis distances are solved in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bayescli import devices
from bayescli.errors import BayescliError

# Elements of a [queries, bank] similarity block (KNN) or [queries, classes] distance block on a
# CPU; 2^25 float32 values are 128 MiB (a float64 row counts twice: callers pass 2·D).
CHUNK_ELEMENTS = 1 << 25
# Bytes per such float32 element on CUDA (devices.chunk_elements): the block, its centred or
# whitened copy and the reduction's temporary.
CHUNK_BYTES = 3 * 4


def max_logit(logits: torch.Tensor) -> torch.Tensor:
    """``max_k f_k`` ``[N]`` for logits ``[N, K]``."""
    return logits.max(-1).values.double()


def energy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Negative free energy ``T·logsumexp(f/T)`` ``[N]`` (higher = in-distribution)."""
    return (temperature * torch.logsumexp(logits.double() / temperature, -1)).double()


def _rows(n_cols: int, device: torch.device) -> int:
    """Rows of ``n_cols`` float32 elements per chunk on ``device``."""
    return devices.chunk_rows(device, n_cols, CHUNK_ELEMENTS, CHUNK_BYTES)


def _ridged_cholesky(scatter: torch.Tensor, count: int, ridge: float) -> torch.Tensor:
    """Lower Cholesky factor of ``scatter/count + ridge·tr/D·I`` (float64)."""
    cov = scatter.double() / count
    d = cov.shape[0]
    cov = cov + (ridge * cov.diagonal().sum() / d) * torch.eye(d, dtype=torch.float64, device=cov.device)
    chol, info = torch.linalg.cholesky_ex(cov)
    if int(info) != 0 or not bool(torch.isfinite(chol).all()):
        raise BayescliError(
            "the fitting features' covariance is singular even with the ridge "
            f"(trace {float(cov.diagonal().sum()):.3g}: constant or non-finite features?)"
        )
    return chol


def _check_fit(phi: torch.Tensor, labels: torch.Tensor | None = None) -> None:
    if phi.dim() != 2 or len(phi) < 2:
        raise BayescliError(f"detectors need fitting features [N ≥ 2, D], got {list(phi.shape)}")
    if labels is not None and len(labels) != len(phi):
        raise BayescliError(f"{len(phi)} fitting features but {len(labels)} labels")


def _class_scatter(
    phi: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means ``[C', D]`` of the ``C'`` classes present, their counts ``[C']`` and the within-class
    scatter ``Σ_i (φ_i − μ_{y_i})(φ_i − μ_{y_i})ᵀ`` ``[D, D]`` (float64), in chunks, each
    chunk centred in float64 against the float64 means and multiplied in float64."""
    _check_fit(phi, labels)
    labels = labels.to(phi.device)
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, phi.shape[1], dtype=torch.float64, device=phi.device)
    rows = _rows(phi.shape[1], phi.device)
    for start in range(0, len(phi), rows):
        sums.index_add_(0, labels[start : start + rows], phi[start : start + rows].double())
    present = counts > 0
    full_means = sums.new_zeros(num_classes, phi.shape[1])
    full_means[present] = sums[present] / counts[present, None]
    scatter = torch.zeros(phi.shape[1], phi.shape[1], dtype=torch.float64, device=phi.device)
    rows = _rows(2 * phi.shape[1], phi.device)  # float64 chunks
    for start in range(0, len(phi), rows):
        centred = phi[start : start + rows].double() - full_means[labels[start : start + rows]]
        scatter += centred.T @ centred
    return full_means[present], counts[present], scatter


@dataclass
class Mahalanobis:
    """Class means ``means [C, D]`` and the Cholesky factor ``chol [D, D]`` of the shared
    within-class covariance (``1/N Σ_c Σ_{i∈c} (φ_i−μ_c)(φ_i−μ_c)ᵀ`` plus the ridge)."""

    means: torch.Tensor
    chol: torch.Tensor
    ridge: float
    n_fit: int

    @classmethod
    def fit(
        cls, phi: torch.Tensor, labels: torch.Tensor, num_classes: int, ridge: float = 1e-6
    ) -> Mahalanobis:
        """Fit on in-distribution ``phi [N, D]`` with ``labels [N]``; classes absent from the
        fitting data get no mean (they cannot be the nearest class)."""
        means, counts, scatter = _class_scatter(phi, labels, num_classes)
        return cls(means, _ridged_cholesky(scatter, len(phi), ridge), ridge, len(phi))

    def distances(self, phi: torch.Tensor) -> torch.Tensor:
        """Squared Mahalanobis distance to every class mean ``[N, C]``.

        ``‖L⁻¹(φ − μ_c)‖² = ‖L⁻¹φ‖² − 2 (L⁻¹φ)·(L⁻¹μ_c) + ‖L⁻¹μ_c‖²``: one triangular solve per
        input and one GEMM against the whitened means, in float64 (``L`` may be ill-conditioned),
        chunk by chunk.
        """
        chol = self.chol.to(device=phi.device, dtype=torch.float64)
        white_means = torch.linalg.solve_triangular(chol, self.means.to(chol).T, upper=False).T
        mean_sq = white_means.square().sum(-1)
        parts = []
        rows = _rows(2 * phi.shape[1], phi.device)
        for start in range(0, len(phi), rows):
            z = torch.linalg.solve_triangular(chol, phi[start : start + rows].double().T, upper=False).T
            d2 = z.square().sum(-1, keepdim=True) - 2 * z @ white_means.T + mean_sq
            parts.append(d2.clamp_min(0))
        return torch.cat(parts)

    def score(self, phi: torch.Tensor) -> torch.Tensor:
        """``−min_c MD_c(φ)`` ``[N]``."""
        return -self.distances(phi).min(-1).values.double()

    def params(self) -> dict:
        return {"covariance": "shared within-class", "ridge": self.ridge, "fit_points": self.n_fit}


@dataclass
class RelativeMahalanobis:
    """Class-conditional Mahalanobis minus a background Gaussian's (one mean, total covariance)."""

    classes: Mahalanobis
    background: Mahalanobis

    @classmethod
    def fit(
        cls, phi: torch.Tensor, labels: torch.Tensor, num_classes: int, ridge: float = 1e-6
    ) -> RelativeMahalanobis:
        means, counts, within = _class_scatter(phi, labels, num_classes)
        # total scatter = within + between: Σ_c n_c (μ_c − μ)(μ_c − μ)ᵀ, no second pass over φ
        w = counts.double()
        mean = (w[:, None] * means.double()).sum(0) / w.sum()
        dev = means.double() - mean
        total = within + (dev.T * w) @ dev
        n = len(phi)
        classes = Mahalanobis(means, _ridged_cholesky(within, n, ridge), ridge, n)
        background = Mahalanobis(mean[None], _ridged_cholesky(total, n, ridge), ridge, n)
        return cls(classes, background)

    def score(self, phi: torch.Tensor) -> torch.Tensor:
        """``MD_0(φ) − min_c MD_c(φ)`` ``[N]`` (Ren et al.'s ``−min_c RMD_c``)."""
        return (self.background.distances(phi)[:, 0] - self.classes.distances(phi).min(-1).values).double()

    def params(self) -> dict:
        return {**self.classes.params(), "background": "mean and covariance of all fitting features"}


def _normalise(phi: torch.Tensor) -> torch.Tensor:
    return phi / phi.norm(dim=-1, keepdim=True).clamp_min(1e-12)


@dataclass
class KNN:
    """A bank ``[B, D]`` of L2-normalised fitting features and the neighbour rank ``k``."""

    bank: torch.Tensor
    k: int
    n_fit: int
    seed: int

    @classmethod
    def fit(cls, phi: torch.Tensor, k: int = 10, bank_size: int | None = None, seed: int = 0) -> KNN:
        """Keep all fitting features, or a seeded random ``bank_size`` of them (Sun et al.'s α)."""
        _check_fit(phi)
        if k < 1:
            raise BayescliError(f"KNN needs k ≥ 1, got {k}")
        bank = phi
        if bank_size is not None and bank_size < len(phi):
            # drawn on the host: the same bank on every device for a seed
            idx = torch.randperm(len(phi), generator=torch.Generator().manual_seed(seed))[:bank_size]
            bank = phi[idx.sort().values.to(phi.device)]
        if k > len(bank):
            raise BayescliError(f"KNN k = {k} exceeds the {len(bank)} fitting features; lower k")
        return cls(_normalise(bank), k, len(phi), seed)

    def kth_distance(self, phi: torch.Tensor) -> torch.Tensor:
        """Distance to the k-th nearest bank feature ``[N]``, in query chunks so that the
        similarity block stays under ``CHUNK_ELEMENTS`` whatever the bank's size."""
        bank = self.bank.to(phi.dtype)
        rows = _rows(len(bank), phi.device)
        out = []
        for start in range(0, len(phi), rows):
            sims = _normalise(phi[start : start + rows]) @ bank.T
            kth = sims.topk(self.k, dim=-1, sorted=False).values.min(-1).values
            # ‖a − b‖² = 2 − 2 a·b for unit vectors
            out.append((2 - 2 * kth.double()).clamp_min(0).sqrt())
        return torch.cat(out)

    def score(self, phi: torch.Tensor) -> torch.Tensor:
        """``−‖z − z_(k)‖`` ``[N]``."""
        return -self.kth_distance(phi)

    def params(self) -> dict:
        return {
            "k": self.k,
            "bank": len(self.bank),
            "fit_points": self.n_fit,
            "bank_seed": self.seed,
            "normalisation": "L2",
        }


def vim_dim(feature_dim: int) -> int:
    """Principal-subspace size, as in the authors' code: 1000 for D ≥ 2048, 512 for D ≥ 768,
    else D/2."""
    if feature_dim >= 2048:
        return 1000
    if feature_dim >= 768:
        return 512
    return feature_dim // 2


@dataclass
class ViM:
    """Origin ``o [D]``, null-space basis ``null [D, D−dim]``, scale ``alpha`` and the head."""

    origin: torch.Tensor
    null: torch.Tensor
    alpha: float
    weight: torch.Tensor
    bias: torch.Tensor
    dim: int

    @classmethod
    def fit(cls, phi: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dim: int | None = None) -> ViM:
        """``weight [K, D]``, ``bias [K]`` of the head; ``dim`` principal directions kept."""
        _check_fit(phi)
        d = phi.shape[1]
        dim = vim_dim(d) if dim is None else dim
        if not 0 < dim < d:
            raise BayescliError(f"ViM needs 0 < dim < D = {d}, got {dim}")
        w, b = weight.double(), bias.double()
        origin = -(torch.linalg.pinv(w) @ b)
        scatter = torch.zeros(d, d, dtype=torch.float64, device=phi.device)
        rows = _rows(2 * d, phi.device)  # float64 chunks
        for start in range(0, len(phi), rows):
            centred = phi[start : start + rows].double() - origin
            scatter += centred.T @ centred
        _, vecs = torch.linalg.eigh(scatter / len(phi))  # ascending eigenvalues
        vim = cls(origin, vecs[:, : d - dim], 0.0, w, b, dim)
        residual, logits = vim._parts(phi)
        vim.alpha = float(logits.max(-1).values.mean() / residual.mean())
        if not math.isfinite(vim.alpha):
            raise BayescliError("ViM's residual is zero on the fitting features (constant features?)")
        return vim

    def _parts(self, phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual norms ``‖(φ − o) P⊥‖`` ``[N]`` and logits ``[N, K]`` (float64), in chunks and in
        the features' dtype (no float64 copy of the features)."""
        dt = phi.dtype
        origin, null, w, b = (t.to(dt) for t in (self.origin, self.null, self.weight, self.bias))
        res, logits = [], []
        rows = _rows(phi.shape[1], phi.device)
        for start in range(0, len(phi), rows):
            x = phi[start : start + rows]
            res.append(((x - origin) @ null).norm(dim=-1).double())
            logits.append(torch.addmm(b, x, w.T).double())
        return torch.cat(res), torch.cat(logits)

    def score(self, phi: torch.Tensor) -> torch.Tensor:
        """``logsumexp(f) − alpha·‖(φ − o) P⊥‖`` ``[N]``."""
        residual, logits = self._parts(phi)
        return torch.logsumexp(logits, -1) - self.alpha * residual

    def params(self) -> dict:
        return {"dim": self.dim, "alpha": self.alpha, "origin": "-pinv(W) b"}


def percentile(values: torch.Tensor, q: float) -> float:
    """The ``q``-th percentile of all elements (linear interpolation, as ``numpy.percentile``)."""
    flat = values.reshape(-1)
    pos = (q / 100) * (flat.numel() - 1)
    lo = math.floor(pos)
    lo_val = flat.kthvalue(lo + 1).values
    if pos == lo:
        return lo_val.double().item()
    # the next order statistic: lo_val again if it repeats, else the smallest larger value
    # (two cheap passes instead of a second selection)
    if int((flat <= lo_val).sum()) >= lo + 2:
        hi_val = lo_val
    else:
        hi_val = flat.masked_fill(flat <= lo_val, math.inf).min()
    lo_f, hi_f = lo_val.double().item(), hi_val.double().item()
    return lo_f + (pos - lo) * (hi_f - lo_f)


@dataclass
class ReAct:
    """Clip threshold ``c`` (a percentile of the fitting activations) and the head."""

    threshold: float
    percentile: float
    weight: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def fit(cls, phi: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, q: float = 90.0) -> ReAct:
        _check_fit(phi)
        if not 0 < q <= 100:
            raise BayescliError(f"ReAct percentile must be in (0, 100], got {q}")
        return cls(percentile(phi, q), q, weight.detach(), bias.detach())

    def score(self, phi: torch.Tensor) -> torch.Tensor:
        """Energy of the head on clipped features ``[N]``."""
        clipped = phi.clamp(max=self.threshold)
        return energy(clipped @ self.weight.to(phi.dtype).T + self.bias.to(phi.dtype))

    def params(self) -> dict:
        return {"percentile": self.percentile, "threshold": self.threshold, "score": "energy, T = 1"}


def odin(
    classifier: torch.nn.Module,
    x: torch.Tensor,
    temperature: float = 1000.0,
    epsilon: float = 0.0014,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """ODIN scores ``[N]`` for pixel-space inputs ``x [N, ...]`` (batches run on ``device``).

    The perturbation is taken in pixel space, where the model's own normalisation ``(x−m)/s``
    sits inside ``classifier``: a pixel step ``ε`` is a step ``ε/s_c`` per channel in the
    normalised space, which is how the reference code scales its gradient sign by the input
    std. Inputs are not clipped back to [0, 1] (as in the reference code).
    """
    out = []
    for start in range(0, len(x), batch_size):
        xb = x[start : start + batch_size].to(device).detach().clone().requires_grad_(True)
        with torch.enable_grad():
            logp = torch.log_softmax(classifier(xb) / temperature, -1)
            (grad,) = torch.autograd.grad(logp.max(-1).values.sum(), xb)  # inputs only, not weights
        perturbed = xb.detach() + epsilon * grad.sign()
        with torch.no_grad():
            scores = torch.softmax(classifier(perturbed).double() / temperature, -1).max(-1).values
        out.append(scores)
    return torch.cat(out)
