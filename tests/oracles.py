"""Independent reference computations: explicit Jacobians, dense matrices, direct formulas."""

from __future__ import annotations

import torch


def explicit_jacobian_head(phi_aug: torch.Tensor, k: int) -> torch.Tensor:
    """``J(x) = I_K ⊗ φ̃ᵀ`` built explicitly: ``[N, K, K·(D+1)]`` (row-major weights)."""
    eye = torch.eye(k, dtype=phi_aug.dtype)
    return torch.stack([torch.kron(eye, p[None, :]) for p in phi_aug])


def explicit_ggn(jac: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n``."""
    lam = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    return sum(j.T @ l @ j for j, l in zip(jac, lam, strict=True))


def autograd_jacobian(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per-input Jacobian of the logits w.r.t. all parameters by plain autograd loops."""
    params = list(net.parameters())
    rows = []
    for xi in x:
        out = net(xi[None])[0]
        per_class = []
        for k in range(out.shape[0]):
            grads = torch.autograd.grad(out[k], params, retain_graph=True)
            per_class.append(torch.cat([g.reshape(-1) for g in grads]))
        rows.append(torch.stack(per_class))
    return torch.stack(rows)


def eq7(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Direct transcription of the Laplace bridge, eq. 7 (float64, no log-space tricks)."""
    k = mu.shape[-1]
    return (1 / var) * (1 - 2 / k + torch.exp(mu) / k**2 * torch.exp(-mu).sum(-1, keepdim=True))
