"""The README's Python example: a plain torch model, trained in a few lines, then bayescli on loaders.

Run: ``.venv/bin/python examples/python_api.py`` (about a minute on 2 CPU cores).
"""

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayescli

# digits as tensors: 8×8 images in [0, 1], a seeded 70/10/20 split
x, y = load_digits(return_X_y=True)
x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
y = torch.tensor(y)
perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
train, val, test = (
    perm[: int(0.7 * len(x))],
    perm[int(0.7 * len(x)) : int(0.8 * len(x))],
    perm[int(0.8 * len(x)) :],
)


def loader(rows: torch.Tensor, shuffle: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=64, shuffle=shuffle)


torch.manual_seed(0)
net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
for _ in range(30):
    for xb, yb in loader(train, shuffle=True):
        opt.zero_grad()
        nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
net.eval()

laplace = bayescli.fit(net, loader(train), "laplace", val=loader(val))  # δ chosen on val
mnvi = bayescli.fit(net, loader(train), "mnvi", val=loader(val))  # κ chosen on val
for post in (laplace, mnvi):
    sel = post.selection
    print(f"{post.method}: {sel.setting} = {sel.chosen:.4g} by validation {sel.criterion.value}")

pred = laplace.predict(loader(test))  # GLM predictive, probit link
print("probs", tuple(pred.probs.shape), "logit variance", tuple(pred.logit_var.shape))
laplace.save("laplace.safetensors")
again = bayescli.load("laplace.safetensors", model=net)  # checked against net's layers and weights

report = bayescli.evaluate([laplace, mnvi], loader(test), ood=["noise:uniform"])
for method, row in report["results"]["in_distribution"].items():
    print(f"{method:22s} acc {row['accuracy']:.4f}  NLL {row['nll']:.4f}  ECE {row['ece']:.4f}")
