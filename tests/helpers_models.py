"""Factories for ``py:`` model specs used by the tests (on sys.path via pytest's rootdir)."""

from torch import nn


def tiny_mlp(num_classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, num_classes))


def wide_head(num_classes: int = 10) -> nn.Module:
    """A 64 → 2500 → K net: its head has 25,010 parameters (too many for a full covariance)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 2500), nn.ReLU(), nn.Linear(2500, num_classes))


class Scaled(nn.Module):
    """Logits are scaled after the last linear layer: the feature/head split must be refused."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, num_classes))

    def forward(self, x):
        return 2.0 * self.body(x)


def tiny_conv(num_classes: int = 3) -> nn.Module:
    """A convolution and global pooling: takes RGB images of any size."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes)
    )
