"""GLM mode refinement in weight space (seed 003 §2.3): maximise the convex linearised objective.

For a last-layer head the linearised model *is* the head, so the objective is the regularised
log-likelihood on fixed features ``φ̃ [N, D+1]``:

    L(W̃) = Σ_n log softmax(W̃ φ̃_n)[y_n] − (δ/2) ‖W̃‖²,

with gradient ``(Y − P)ᵀ Φ̃ − δ W̃`` and Hessian ``−(Σ_n Λ_n ⊗ φ̃_nφ̃_nᵀ + δI)`` (the GGN is exact
here). Heads with ≤ 20,000 parameters take damped Newton steps (backtracking line search, so L
never decreases); larger heads use L-BFGS with a strong-Wolfe line search.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_NEWTON_PARAMS = 20_000


def objective(w: torch.Tensor, phi_aug: torch.Tensor, labels: torch.Tensor, delta: float) -> float:
    """``L(W̃)`` for ``w [K, D+1]``."""
    logits = phi_aug @ w.T
    return float(-nn.functional.cross_entropy(logits, labels, reduction="sum") - 0.5 * delta * w.pow(2).sum())


def _gradient(w: torch.Tensor, phi_aug: torch.Tensor, labels: torch.Tensor, delta: float) -> torch.Tensor:
    probs = (phi_aug @ w.T).softmax(-1)
    resid = nn.functional.one_hot(labels, w.shape[0]).to(w) - probs
    return resid.T @ phi_aug - delta * w


def _newton(
    w: torch.Tensor, phi_aug: torch.Tensor, labels: torch.Tensor, delta: float, steps: int, tol: float
) -> tuple[torch.Tensor, list[float]]:
    k, d1 = w.shape
    history = [objective(w, phi_aug, labels, delta)]
    eye = torch.eye(k * d1, dtype=w.dtype, device=w.device)
    for _ in range(steps):
        grad = _gradient(w, phi_aug, labels, delta)
        if grad.abs().max() < tol:
            break
        probs = (phi_aug @ w.T).softmax(-1)
        block = torch.einsum("nk,nd,ne->kde", probs, phi_aug, phi_aug)
        outer = (probs[:, :, None] * phi_aug[:, None, :]).reshape(len(probs), -1)
        hess = torch.block_diag(*block) - outer.T @ outer + delta * eye
        step = torch.linalg.solve(hess, grad.reshape(-1)).reshape(k, d1)
        t, current = 1.0, history[-1]
        while t > 1e-10:
            candidate = w + t * step
            value = objective(candidate, phi_aug, labels, delta)
            if value >= current:
                w = candidate
                history.append(value)
                break
            t /= 2
        else:
            break
        if abs(history[-1] - current) <= 1e-12 * max(1.0, abs(current)):
            break
    return w, history


def _lbfgs(
    w: torch.Tensor, phi_aug: torch.Tensor, labels: torch.Tensor, delta: float, steps: int
) -> tuple[torch.Tensor, list[float]]:
    param = w.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([param], max_iter=steps, line_search_fn="strong_wolfe", history_size=20)
    history = [objective(w, phi_aug, labels, delta)]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (
            nn.functional.cross_entropy(phi_aug @ param.T, labels, reduction="sum")
            + 0.5 * delta * param.pow(2).sum()
        )
        loss.backward()
        return loss

    opt.step(closure)
    refined = param.detach()
    history.append(objective(refined, phi_aug, labels, delta))
    if history[-1] < history[0]:  # L-BFGS gives no monotonicity guarantee: never return a worse mode
        return w, history[:1]
    return refined, history


def refine_mode(
    w0: torch.Tensor, phi_aug: torch.Tensor, labels: torch.Tensor, delta: float, steps: int, tol: float = 1e-9
) -> tuple[torch.Tensor, list[float]]:
    """Refined head ``W̃ [K, D+1]`` and the objective after each accepted step (non-decreasing)."""
    w = w0.double()
    x = phi_aug.double()
    if w.numel() <= MAX_NEWTON_PARAMS:
        out, hist = _newton(w, x, labels, delta, steps, tol)
    else:
        out, hist = _lbfgs(w, x, labels, delta, steps)
    return out.to(w0.dtype), hist
