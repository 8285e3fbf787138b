"""A model file of your own, for the checkpoint guide: factories bayescli imports with
``--model py:mynet:FACTORY`` (from the current directory), and, run as a script, a few checkpoints
saved the ways people save them (trained briefly on the training split of the digits data,
8×8 images in [0, 1])."""

import torch
from torch import nn

import bayescli


def mlp(input_dim: int, output_dim: int, hidden: int = 64) -> nn.Module:
    """An MLP on flattened images; ``input_dim`` and ``output_dim`` have no defaults, so
    ``--model-arg`` must give them."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, output_dim))


class WithFeatures(nn.Module):
    """A network whose forward returns ``(logits, features)``: ``--output 0`` picks the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU())
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        phi = self.body(x)
        return self.fc(phi), phi


def with_features() -> nn.Module:
    return WithFeatures()


def train(net: nn.Module, logits_of=lambda out: out) -> nn.Module:
    data = bayescli.load_data("digits:train")  # x [1258, 1, 8, 8], y [1258]
    x, y = data.x, data.y
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(60):  # full batch
        opt.zero_grad()
        nn.functional.cross_entropy(logits_of(net(x)), y).backward()
        opt.step()
    return net.eval()


if __name__ == "__main__":
    torch.manual_seed(0)
    net = train(mlp(64, 10))
    torch.save(net.state_dict(), "mlp.pt")  # a state dict
    torch.save(  # a training dict, keys prefixed as DataParallel leaves them
        {"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}, "epoch": 60},
        "training.pt",
    )
    torch.save(net, "module.pt")  # the whole pickled module
    torch.save(train(with_features(), lambda out: out[0]).state_dict(), "tuple.pt")
