"""Function samples of a Dirichlet fVI posterior's families (VI-SPEC A3): logit samples
``[M, N, K]`` of a last-layer head over features (post hoc) or of a whole network over inputs
(from scratch), and the post-hoc heads' starting point at the MAP head."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from bayescli.models.specs import Classifier


def head_logits(
    family: str,
    params: dict[str, torch.Tensor],
    phi: torch.Tensor,
    num: int,
    generator: torch.Generator,
    dropout: float,
) -> torch.Tensor:
    """Logit samples ``[M, N, K]`` of a head over ``phi [N, D]``.

    ``params``: ``weight [M, K, D]``, ``bias [M, K]`` (ensemble/map: ``M`` members, one GEMM;
    mfvi/dropout: ``M = 1``, plus ``weight_std [K, D]``, ``bias_std [K]`` for mfvi). ``num``
    samples for mfvi and dropout; ensembles and map return their members.
    """
    w, b = params["weight"], params["bias"]
    m, k, d = w.shape
    if family in ("ensemble", "map"):
        return F.linear(phi, w.reshape(m * k, d), b.reshape(-1)).reshape(-1, m, k).transpose(0, 1)
    if family == "mfvi":
        mu = F.linear(phi, w[0], b[0])
        var = F.linear(phi.square(), params["weight_std"].square(), params["bias_std"].square())
        eps = torch.randn(num, *mu.shape, generator=generator, device=phi.device, dtype=phi.dtype)
        return mu + var.sqrt() * eps
    keep = torch.full((num, *phi.shape), 1 - dropout, device=phi.device, dtype=phi.dtype)
    masks = torch.bernoulli(keep, generator=generator) / (1 - dropout)
    return F.linear(phi * masks, w[0], b[0])


def ensemble_member_logits(
    params: dict[str, torch.Tensor], phi: torch.Tensor, buffer: torch.Tensor
) -> torch.Tensor:
    """:func:`head_logits` of an ensemble (or map) as ``[M, N, K]`` written into ``buffer`` (``[M, ≥ N,
    K]``), one head-sized GEMM per member (to rounding the same numbers as the stacked ``[N, M·K]``
    GEMM, whose ``M``-fold weights would not stay in cache)."""
    w, b = params["weight"], params["bias"]
    out = buffer[:, : phi.shape[0]]
    for member in range(w.shape[0]):
        torch.addmm(b[member], phi, w[member].t(), out=out[member])
    return out


def init_head(family: str, head: nn.Linear, members: int, scale: float, gen: torch.Generator) -> dict:
    """Trainable head parameters started from the MAP head (module docs), on the head's device.
    ``gen`` is a host generator: the members' spread is drawn on the host and moved, so the seeded
    start is the same on every device."""
    w = head.weight.detach().float()
    b = head.bias.detach().float() if head.bias is not None else w.new_zeros(w.shape[0])
    rms = w.square().mean().sqrt()
    if family == "ensemble":
        noise = torch.randn(members, *w.shape, generator=gen).to(w.device) * (scale * rms)
        return {"weight": w + noise, "bias": b.expand(members, -1).clone()}
    params = {"weight": w[None].clone(), "bias": b[None].clone()}
    if family == "mfvi":
        # σ = softplus(ρ) keeps σ > 0; ρ₀ = softplus⁻¹(init_scale·rms) per tensor.
        for name, value in (("weight", w), ("bias", b)):
            sigma = max(scale * float(value.square().mean().sqrt()), 1e-6)
            params[f"{name}_rho"] = torch.full_like(value, sigma + math.log(-math.expm1(-sigma)))
    return params


def head_stds(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace mfvi's ``*_rho`` by ``*_std = softplus(ρ)`` (other families unchanged)."""
    out = {k: v for k, v in params.items() if not k.endswith("_rho")}
    for name in ("weight", "bias"):
        if f"{name}_rho" in params:
            out[f"{name}_std"] = F.softplus(params[f"{name}_rho"])
    return out


def _first_parametrised(net: nn.Module) -> nn.Module | None:
    for module in net.modules():
        if any(True for _ in module.parameters(recurse=False)):
            return module
    return None


@contextmanager
def dropout_masks(net: nn.Module, p: float, generator: torch.Generator) -> Iterator[None]:
    """MC dropout: inputs of every ``nn.Linear`` but the first parametrised layer get Bernoulli
    masks (rate ``p``, rescaled by ``1/(1 − p)``) drawn from ``generator`` while active."""
    first = _first_parametrised(net)

    def mask(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        keep = torch.full_like(x, 1 - p)
        return (x * torch.bernoulli(keep, generator=generator) / (1 - p), *args[1:])

    handles = [
        m.register_forward_pre_hook(mask)
        for m in net.modules()
        if isinstance(m, nn.Linear) and m is not first
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def network_logits(
    family: str,
    classifier: Classifier,
    x: torch.Tensor,
    num: int,
    generator: torch.Generator,
    dropout: float,
    members: list[dict[str, torch.Tensor]] | None = None,
    stds: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logit samples ``[M, N, K]`` of a whole network for pixel-space ``x``.

    ensemble: one pass per member state (``members``); mfvi: ``num`` weight draws around the
    classifier's weights with ``stds`` (one draw per sample, shared by the batch); dropout:
    ``num`` masked passes (one batched pass over ``num`` copies); map: the classifier itself.
    """
    net, xn = classifier.net, classifier.normalise(x)
    if family == "ensemble":
        return torch.stack([functional_call(net, state, (xn,)) for state in members])
    if family == "mfvi":
        means = dict(net.named_parameters())
        draws = []
        for _ in range(num):
            params = {
                n: mu + stds[n] * torch.randn(mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
                for n, mu in means.items()
            }
            draws.append(functional_call(net, params, (xn,)))
        return torch.stack(draws)
    if family == "dropout":
        with dropout_masks(net, dropout, generator):
            out = net(xn.repeat(num, *([1] * (xn.dim() - 1))))
        return out.reshape(num, xn.shape[0], -1)
    return net(xn)[None]
