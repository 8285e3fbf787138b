"""FGSM (Goodfellow et al., 2015) against the MAP network, in pixel space.

``x' = clip(x + ε · sign(∇ₓ CE(f(x), y)), 0, 1)`` with ``f`` the classifier *including* its
input normalisation, so ``ε`` is measured in [0, 1] pixel units (``8/255`` = 8 grey levels).
A multi-label (``bernoulli``) classifier is attacked on its training loss, the binary
cross-entropy summed over labels ``Σ_k BCE(f_k(x), y_k)``.
"""

from __future__ import annotations

import torch
from torch import nn

from bayescli.errors import BayescliError
from bayescli.models.specs import Classifier
from bayescli.numbers import parse_number


def parse_epsilons(text: str) -> list[tuple[str, float]]:
    """``0,2/255,0.03`` → ``[("0", 0.0), ("2/255", 0.00784…), ("0.03", 0.03)]``."""
    out = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        value = parse_number(token, "--fgsm")
        if not 0 <= value <= 1:
            raise BayescliError(f"FGSM ε must be within [0, 1] (pixel units); got {token}")
        out.append((token, value))
    return out


def fgsm(
    classifier: Classifier,
    x: torch.Tensor,
    y: torch.Tensor,
    eps: float,
    batch_size: int = 256,
    likelihood: str = "categorical",
) -> torch.Tensor:
    """Adversarial inputs ``[N, ...]`` for labels ``y [N]`` (``[N, K]`` of 0/1 for a ``bernoulli``
    classifier), white-box on the MAP network."""
    if eps == 0:
        return x.clone()
    classifier.eval()
    if likelihood == "bernoulli":
        bce = nn.BCEWithLogitsLoss(reduction="sum")

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return bce(logits, labels.to(logits.dtype))
    else:
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
    out = []
    for start in range(0, len(x), batch_size):
        with torch.enable_grad():  # callers may be inside no_grad
            xb = x[start : start + batch_size].clone().requires_grad_(True)
            loss = loss_fn(classifier(xb), y[start : start + batch_size])
            (grad,) = torch.autograd.grad(loss, xb)
        out.append((xb.detach() + eps * grad.sign()).clamp(0, 1))
    return torch.cat(out)
