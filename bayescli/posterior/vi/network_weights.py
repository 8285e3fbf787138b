"""A network's weights as one flat vector ``[P]``, and the network run at such vectors.

Weight-space posteriors (GLM VI over all layers, GGP VI's Jacobian kernels, Bayes by Backprop)
store their means and draws in ``named_parameters`` order; these two functions are the bridge.
"""

from __future__ import annotations

import torch
from torch import nn

from bayescli.errors import require
from bayescli.models.specs import Classifier


def flat_parameters(net: nn.Module) -> torch.Tensor:
    """All parameters of ``net`` as one vector ``[P]`` (``named_parameters`` order)."""
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def network_logits(classifier: Classifier, x: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Logits ``[M, N, K]`` of the network at each flat weight vector of ``draws [M, P]``."""
    from torch.func import functional_call

    shapes = [(name, p.shape, p.numel()) for name, p in classifier.net.named_parameters()]
    require(
        draws.shape[1] == sum(size for _, _, size in shapes),
        f"the posterior has {draws.shape[1]:,} weights but the network {sum(s for _, _, s in shapes):,}; "
        "use the checkpoint it was fitted on",
    )
    xn = classifier.normalise(x)
    dtype = next(classifier.net.parameters()).dtype
    out = []
    for theta in draws.to(dtype):
        params, offset = {}, 0
        for name, shape, size in shapes:
            params[name] = theta[offset : offset + size].reshape(shape)
            offset += size
        with torch.no_grad():
            out.append(functional_call(classifier.net, params, (xn,)))
    return torch.stack(out)
