"""Cost of the dense last-layer Laplace per image, against the head's forward and a flop count.

A synthetic segmentation net (average pooling by ``--stride`` + a 1×1 conv + ReLU as the backbone,
then the ``C → K`` 1×1 head and bilinear upsampling by ``--stride``: torchvision's layout) on
``--size``² images. Timed per batch of ``--batch`` images: the head alone at the feature resolution,
the whole network, the carried features ``T(φ̃)``, the kron fit (curvature over every pixel), and the
kron GLM + probit predictive carried (``T(φ̃)`` then ``[W̃ᵀ | Q_A]`` at every pixel) and projected
(``[W̃ᵀ | Q_A]`` at the head's resolution, then ``T``).

Multiply-adds per image (P = H·W pixels, p = h·w positions, D = C + 1):
head forward ``p·D·K``; kron curvature ``P·D²`` (``A``) + ``P·K²`` (``G``); kron predictive carried
``P·D·(2K + D)``, projected ``p·D·(K + D) + P·D·K`` (+ the upsampling of ``K + D`` channels).

Run: ``python benchmarks/dense_cost.py [--size 128] [--stride 8] [--channels 256] [--classes 21]
[--batch 2] [--device cpu|cuda]``; prints one JSON object (seconds, ratios to the head's forward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, peak_rss_gib, setup_threads  # noqa: E402

from bayescli.models.dense import DenseClassifier  # noqa: E402
from bayescli.posterior.dense_laplace import fit_dense_last_layer_stream  # noqa: E402
from bayescli.predictive.dense import dense_predict, projection  # noqa: E402


class Synthetic(nn.Module):
    def __init__(self, channels: int, classes: int, stride: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.AvgPool2d(stride), nn.Conv2d(3, channels, 1), nn.ReLU())
        self.classifier = nn.Conv2d(channels, classes, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.classifier(self.backbone(x))
        return {"out": nn.functional.interpolate(z, size=x.shape[-2:], mode="bilinear", align_corners=False)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--classes", type=int, default=21)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    threads = setup_threads()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    net = Synthetic(args.channels, args.classes, args.stride).to(dev).eval()
    clf = DenseClassifier(net, output="out")
    x = torch.rand(args.batch, 3, args.size, args.size, device=dev)
    mask = torch.randint(0, args.classes, (args.batch, args.size, args.size))
    clf.check_split(x[:1])
    with torch.no_grad():
        phi = clf.features(x)
        head = clf.head
        carried = clf.dense_features(x)
    post = fit_dense_last_layer_stream([(carried, mask)], clf.weight_aug(), "kron", batch_size=65536)
    post.set_prior_precision(1.0)
    proj = projection(post)

    def head_forward() -> None:
        with torch.no_grad():
            head(phi.permute(0, 2, 3, 1))

    def network() -> None:
        with torch.no_grad():
            clf(x)

    def carry() -> None:
        with torch.no_grad():
            clf.dense_features(x)

    def fit() -> None:
        fit_dense_last_layer_stream([(carried, mask)], clf.weight_aug(), "kron", batch_size=65536)

    def predict_carried() -> None:
        with torch.no_grad():
            dense_predict(post, clf.dense_features(x), "probit")

    def predict_projected() -> None:
        with torch.no_grad():
            dense_predict(post, clf.dense_features(x, proj), "probit", projected=True)

    times = {
        name: best_of(fn, repeat=3, device=dev)
        for name, fn in [
            ("head_forward", head_forward),
            ("network_forward", network),
            ("carried_features", carry),
            ("kron_fit", fit),
            ("kron_probit_carried", predict_carried),
            ("kron_probit_projected", predict_projected),
        ]
    }
    d, k, big, small = args.channels + 1, args.classes, args.size**2, (args.size // args.stride) ** 2
    macs = {
        "head_forward": small * d * k,
        "kron_fit": big * (d * d + k * k),
        "kron_probit_carried": big * d * (2 * k + d),
        "kron_probit_projected": small * d * (k + d) + big * d * k,
    }
    out = {
        "config": vars(args) | {"threads": threads, "device": str(dev)},
        "seconds_per_batch": times,
        "ratio_to_head_forward": {n: t / times["head_forward"] for n, t in times.items()},
        "gmac_per_image": {n: m / 1e9 for n, m in macs.items()},
        "peak_rss_gib": peak_rss_gib(),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
