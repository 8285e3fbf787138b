"""FGSM against an explicit ``clip(x + ε·sign(∇ₓ CE), 0, 1)`` computed with autograd in pixel space.

The classifier normalises with ``std ≠ 1``, so a step taken in normalised space (or scaled by
the std) lands elsewhere. Net and inputs are float64, so a gradient sign cannot flip between
thread counts unless a component is within ~1e-16 of zero; a pixel after one step carries one
rounding of ``x + ε·s`` (≤ 1.1e-16 for values ≤ 1), so 1e-12 absolute leaves a margin above 1000×.
"""

import torch
from tolerance import assert_close

from bayescli.evaluation.attacks import fgsm
from bayescli.models.specs import Classifier

STEP = 1e-12  # one float64 rounding of a value ≤ 1 is ≤ 1.1e-16; see the module docstring


def normalised_net(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )
    return Classifier(net, "3", mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.5]).double()


def explicit_fgsm(clf: Classifier, x: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition, one input at a time: the gradient of the *summed* CE w.r.t. pixels."""
    out = []
    for xi, yi in zip(x, y, strict=True):
        xi = xi[None].clone().requires_grad_(True)
        mean, std = clf.mean.view(1, -1, 1, 1), clf.std.view(1, -1, 1, 1)
        loss = torch.nn.functional.cross_entropy(clf.net((xi - mean) / std), yi[None])
        (grad,) = torch.autograd.grad(loss, xi)
        out.append((xi.detach() + eps * grad.sign()).clamp(0, 1)[0])
    return torch.stack(out)


def test_fgsm_equals_explicit_signed_gradient_step_in_pixel_space():
    clf = normalised_net()
    gen = torch.Generator().manual_seed(0)
    # pixels in [0.2, 0.8]: no clipping for ε ≤ 0.1
    x = 0.2 + 0.6 * torch.rand(40, 3, 2, 2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=gen)
    for eps in (0.01, 0.1):
        ours = fgsm(clf, x, y, eps, batch_size=16)
        assert_close(ours, explicit_fgsm(clf, x, y, eps), atol=STEP, what=f"fgsm eps={eps}")
        # every pixel moved by exactly ε (no pixel has a zero gradient here)
        assert_close((ours - x).abs(), eps, atol=STEP, what=f"fgsm step size eps={eps}")


def test_fgsm_clips_to_pixel_range():
    clf = normalised_net(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(20, 3, 2, 2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (20,), generator=gen)
    ours = fgsm(clf, x, y, 0.5)
    assert_close(ours, explicit_fgsm(clf, x, y, 0.5), atol=STEP, what="fgsm with clipping")
    assert ((ours == 0) | (ours == 1)).float().mean() > 0.3  # a step of 0.5 pushes many pixels to the edge
