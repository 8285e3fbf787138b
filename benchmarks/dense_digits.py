"""Dense last-layer Laplace end to end on composed digit scenes (nothing downloaded).

Scenes: two of scikit-learn's 8×8 digits pasted on a 24×24 canvas; the mask is the digit's class + 1
on its ink (value > 0.25), 0 on the background, and ``ignore_index`` 255 on faint ink (0 < value ≤
0.25), so the fit and the metrics run with ignored pixels. Train and test scenes use disjoint digits.
``builtin:small-segnet`` is trained with Adam, then MAP (link ``none``) is compared with the diag and
kron Laplace GLM predictives (probit, bridge), δ by the marginal likelihood over valid pixels.

Run: ``python benchmarks/dense_digits.py [--epochs 8] [--lr 0.01] [--train 600] [--test 200]``;
prints one JSON object (metrics per posterior and link, fit and evaluation seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).parent))
from common import setup_threads  # noqa: E402

from bayescli.data.segmentation import SegmentationData  # noqa: E402
from bayescli.evaluation.dense import evaluate_dense  # noqa: E402
from bayescli.models.dense import DenseClassifier  # noqa: E402
from bayescli.models.specs import small_segnet  # noqa: E402
from bayescli.posterior.dense_laplace import fit_dense_laplace  # noqa: E402

CANVAS, FAINT = 24, 0.25


def scenes(images: torch.Tensor, labels: torch.Tensor, count: int, gen: torch.Generator) -> SegmentationData:
    """``count`` canvases with two digits each (left and right halves, random offsets)."""
    x = torch.zeros(count, 1, CANVAS, CANVAS)
    mask = torch.zeros(count, CANVAS, CANVAS, dtype=torch.int64)
    for n in range(count):
        for half in (0, 1):
            i = int(torch.randint(len(images), (1,), generator=gen))
            top = int(torch.randint(CANVAS - 8 + 1, (1,), generator=gen))
            left = half * 12 + int(torch.randint(12 - 8 + 1, (1,), generator=gen))
            digit = images[i]
            x[n, 0, top : top + 8, left : left + 8] = digit
            region = mask[n, top : top + 8, left : left + 8]
            region[digit > FAINT] = int(labels[i]) + 1
            region[(digit > 0) & (digit <= FAINT)] = 255
    return SegmentationData(x, mask, ["background"] + [str(d) for d in range(10)])


def train(data: SegmentationData, epochs: int, lr: float, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = small_segnet(data.num_classes, data.input_shape)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(data))
        for start in range(0, len(data), 32):
            rows = order[start : start + 32]
            loss = torch.nn.functional.cross_entropy(net(data.x[rows]), data.mask[rows], ignore_index=255)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    setup_threads()
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    gen = torch.Generator().manual_seed(args.seed)
    fit_data = scenes(images[:1200], labels[:1200], args.train, gen)
    test_data = scenes(images[1200:], labels[1200:], args.test, gen)
    start = time.perf_counter()
    clf = DenseClassifier(train(fit_data, args.epochs, args.lr, args.seed))
    out: dict = {"train_seconds": time.perf_counter() - start, "fit_pixels": fit_data.valid_count()}
    out["test_pixels"] = test_data.valid_count()
    for structure in ("diag", "kron"):
        post = fit_dense_laplace(clf, fit_data.batches(64), structure=structure)
        report = evaluate_dense(post, clf, test_data.batches(64), links=("none", "probit", "bridge"))
        out[structure] = {
            "prior_precision": post.prior_precision,
            "fit_seconds": post.meta["fit_seconds"],
            "evaluate_seconds": report.pop("seconds"),
            **{
                link: {
                    k: round(v, 4) for k, v in r.items() if k in ("pixel_accuracy", "mean_iou", "nll", "ece")
                }
                for link, r in report.items()
            },
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
