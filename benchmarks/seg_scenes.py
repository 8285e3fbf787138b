"""Composed segmentation scenes from the genuine MNIST and notMNIST test files (issue 36 part 4).

Writes three ``.npz`` files (``x [N, 64, 64]`` uint8, ``mask [N, 64, 64]`` uint8 with 0 background
and digit + 1 on digit pixels, ``class_names``, ``placed``) into ``--out``:

* ``train.npz``: ``--train`` scenes (1–3 digits each) from MNIST test[:5000];
* ``test.npz``: ``--test`` scenes (1–3 digits) from MNIST test[5000:];
* ``anomaly.npz``: ``--anomaly`` scenes of 1–2 digits from MNIST test[5000:] with one notMNIST
  letter pasted in each (mask 255 on its pixels; ``anomaly`` 1 there, 0 elsewhere).

No image is shared between the training and the test or anomaly scenes. Run:
``python benchmarks/seg_scenes.py --out DIR [--shared ../shared] [--train 2000 --test 500
--anomaly 500] [--seed 0]`` (a few seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bayescli.data.scenes import compose_scenes, save_scenes
from bayescli.data.sources import idx_pair

HERE = Path(__file__).resolve().parent
SPLIT = 5000  # MNIST test[:5000] for training scenes, test[5000:] for test and anomaly scenes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--anomaly", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    mnist = idx_pair(args.shared / "data" / "mnist" / "MNIST" / "raw", "t10k")
    letters = idx_pair(args.shared / "data" / "notmnist" / "raw", "t10k")
    if mnist is None or mnist.y is None or letters is None:
        sys.exit(f"MNIST/notMNIST test IDX files not found under {args.shared / 'data'}; pass --shared DIR")
    digits, labels = mnist.x, mnist.y
    split = min(SPLIT, len(digits) // 2)
    start = time.perf_counter()
    sets = {
        "train": compose_scenes(digits[:split], labels[:split], args.train, args.seed),
        "test": compose_scenes(digits[split:], labels[split:], args.test, args.seed + 1),
        "anomaly": compose_scenes(
            digits[split:], labels[split:], args.anomaly, args.seed + 2, objects=(1, 2), anomalies=letters.x
        ),
    }
    for name, scenes in sets.items():
        save_scenes(scenes, args.out / f"{name}.npz")
        shown = scenes.placed[:, 1] == 0
        line = f"{name}: {len(scenes.x)} scenes {list(scenes.x.shape[1:])}, {int(shown.sum())} digits"
        if scenes.anomaly is not None:
            share = float(scenes.anomaly.double().mean())
            line += f", {int((~shown).sum())} letters, {share:.1%} anomalous pixels"
        fg = (scenes.mask > 0) & (scenes.mask != 255)
        print(f"{line}, {float(fg.double().mean()):.1%} digit pixels -> {args.out / (name + '.npz')}")
    print(f"composed in {time.perf_counter() - start:.1f} s (seed {args.seed})")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
