"""The VI-SPEC C-1 check network, shared by tests/test_mnvi.py and benchmarks/mnvi_layers.py."""

from __future__ import annotations

import torch
from torch import nn


def c1_net(seed: int = 6) -> nn.Sequential:
    """conv(1→4,3×3) → ReLU → maxpool2 → BN(eval, random stats) → flatten → 16 → ReLU → 5 (float64,
    inputs ``[B, 1, 8, 8]``); seed 6 is the test's net."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.BatchNorm2d(4), nn.Flatten(),
        nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 5),
    ).double()  # fmt: skip
    with torch.no_grad():
        net[3].running_mean.uniform_(0, 0.5)
        net[3].running_var.uniform_(0.2, 1.0)
        net[3].weight.uniform_(0.5, 1.5)
        net[3].bias.uniform_(-0.5, 0.5)
    return net.eval()
