"""``bayescli select`` leaderboards on real data: MNIST LeNet and a CIFAR-sized ResNet-18.

Protocol (genuine MNIST/notMNIST test files under ``--shared``/data, through the CLI as a user runs it):

1. **MNIST LeNet** (the README's comparison-table net): ``bayescli train --model builtin:lenet`` on
   MNIST test[:5000] for 15 epochs, then ``bayescli select`` fitting every default method on the
   same 5,000 images, choosing each method's key hyperparameter and scoring it (and MAP) on
   MNIST test[5000:6000], with notMNIST (``idx:``, all 10,000 glyphs) as the OOD set.
2. **CIFAR-sized net**: no CIFAR data is available offline, so MNIST digits are padded to 32×32 and
   turned into 3-channel images with a per-image random foreground colour on a random dark
   background (seeded), written as ``npz`` files (``x`` uint8 ``[N, 3, 32, 32]``, ``y``): test[:5000]
   (fit), test[5000:6000] (val) and notMNIST (OOD, same recipe). A torchvision ``resnet18`` adapted
   to 32×32 inputs (3×3 stride-1 stem, no max-pool; ``--width`` scales its channels, 64 = stock) is
   trained here with plain torch (SGD + one-cycle, random 4-px shifts), saved as ``.safetensors``
   and passed to ``bayescli select`` as ``py:cifar_resnet:resnet18`` from a temporary folder that
   holds the factory module. Default width 32 (a quarter of stock ResNet-18's FLOPs) for 6 epochs:
   11 minutes measured on 2 CPU cores shared with other jobs (load ≈ 5), ~100 s an epoch; pass
   ``--epochs 4`` to stay under 8 minutes on such a machine.

Both leaderboards (validation accuracy, NLL, ECE, Brier, notMNIST AUROC of the max-probability
score, the chosen hyperparameter, fit seconds, best by NLL) are printed with the wall times, and
written to ``--out``/leaderboards.json; each ``select`` also leaves its own ``leaderboard.json`` and
posterior files under ``--out``/select-lenet and ``--out``/select-resnet18. Methods that score worse
than MAP on validation NLL without a selection warning are flagged.

Run: ``python benchmarks/select_real.py --out /tmp/select_real [--shared ../shared] [--only lenet|resnet]``
(18 minutes measured on 2 busy CPU cores: LeNet train 1.2 + select 2.4, ResNet train 10.9 + select 3.8;
``--reuse`` keeps checkpoints already in ``--out``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

FACTORY = '''"""torchvision resnet18 for 32x32 inputs: 3x3 stride-1 stem, no max-pool, width-scaled."""

from torch import nn
from torchvision.models.resnet import BasicBlock, resnet18 as _resnet18


def resnet18(num_classes: int = 10, width: int = 64) -> nn.Module:
    net = _resnet18(weights=None, num_classes=num_classes)
    net.inplanes = width
    net.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
    net.bn1 = nn.BatchNorm2d(width)
    net.maxpool = nn.Identity()
    net.layer1 = net._make_layer(BasicBlock, width, 2)
    net.layer2 = net._make_layer(BasicBlock, 2 * width, 2, stride=2)
    net.layer3 = net._make_layer(BasicBlock, 4 * width, 2, stride=2)
    net.layer4 = net._make_layer(BasicBlock, 8 * width, 2, stride=2)
    net.fc = nn.Linear(8 * width, num_classes)
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return net
'''


def bayescli(*args: object, cwd: Path | None = None, capture: bool = False) -> tuple[float, str]:
    """Run the CLI; returns (seconds, stdout when ``capture``). stderr (warnings) is echoed and kept."""
    exe = shutil.which("bayescli") or str(Path(sys.executable).with_name("bayescli"))
    start = time.perf_counter()
    proc = subprocess.run(
        [exe, *map(str, args)], cwd=cwd, text=True, stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.stderr:
        sys.stderr.write(proc.stderr)
    if proc.returncode:
        tail = proc.stderr.strip()[-2000:]
        raise RuntimeError(f"bayescli {args[0]} failed (exit {proc.returncode}): {tail}")
    return seconds, proc.stdout or ""


def read_idx(raw: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, 28, 28]`` uint8 and labels ``[N]`` from the t10k IDX files in ``raw``."""
    with gzip.open(raw / "t10k-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(raw / "t10k-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
    return x, y


def colourise(x: np.ndarray, seed: int) -> np.ndarray:
    """``[N, 28, 28]`` grey → ``[N, 3, 32, 32]`` uint8: padded, bright random ink on dark random ground."""
    rng = np.random.default_rng(seed)
    n = len(x)
    glyph = np.pad(x, ((0, 0), (2, 2), (2, 2))).astype(np.float32)[:, None] / 255.0
    ink = rng.uniform(0.35, 1.0, (n, 3, 1, 1)).astype(np.float32)
    ink[np.arange(n), rng.integers(0, 3, n)] = 1.0  # one channel at full brightness: never dim
    ground = rng.uniform(0.0, 0.3, (n, 3, 1, 1)).astype(np.float32)
    return np.round(255 * (ground * (1 - glyph) + ink * glyph)).astype(np.uint8)


def make_npz(shared: Path, out: Path) -> dict[str, Path]:
    mx, my = read_idx(shared / "data" / "mnist" / "MNIST" / "raw")
    nx, ny = read_idx(shared / "data" / "notmnist" / "raw")
    sets = {
        "fit": (colourise(mx[:5000], 1), my[:5000]),
        "val": (colourise(mx[5000:6000], 2), my[5000:6000]),
        "ood": (colourise(nx, 3), ny),
    }
    paths = {}
    for name, (x, y) in sets.items():
        paths[name] = out / f"mnist32rgb-{name}.npz"
        np.savez(paths[name], x=x, y=y)
    return paths


def train_resnet(
    fit_npz: Path, val_npz: Path, width: int, epochs: int, ckpt: Path, factory_dir: Path
) -> dict:
    """Plain-torch training of ``cifar_resnet.resnet18(width)``; returns timing and accuracies."""
    import torch
    import torch.nn.functional as F  # noqa: N812
    from safetensors.torch import save_file

    sys.path.insert(0, str(factory_dir))
    from cifar_resnet import resnet18  # ty: ignore[unresolved-import]

    torch.manual_seed(0)
    torch.set_num_threads(2)

    def load(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        with np.load(path) as f:
            return torch.from_numpy(f["x"]).float() / 255.0, torch.from_numpy(f["y"])

    x, y = load(fit_npz)
    xv, yv = load(val_npz)
    net = resnet18(num_classes=10, width=width)
    bs = 128
    steps = epochs * math.ceil(len(x) / bs)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps, pct_start=0.25)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for epoch in range(epochs):
        net.train()
        perm = torch.randperm(len(x), generator=gen)
        total, correct, loss_sum = 0, 0, 0.0
        for i in range(0, len(x), bs):
            idx = perm[i : i + bs]
            xb = F.pad(x[idx], (4, 4, 4, 4))
            dx, dy = torch.randint(0, 9, (2,), generator=gen).tolist()  # one random shift per batch
            xb, yb = xb[:, :, dy : dy + 32, dx : dx + 32], y[idx]
            logits = net(xb)
            loss = F.cross_entropy(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += len(yb)
            correct += int((logits.argmax(-1) == yb).sum())
            loss_sum += loss.item() * len(yb)
        print(
            f"  resnet18(w={width}) epoch {epoch + 1}/{epochs}: loss {loss_sum / total:.4f} "
            f"train acc {correct / total:.4f} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    train_s = time.perf_counter() - start
    net.eval()
    with torch.no_grad():
        val_acc = float((torch.cat([net(c).argmax(-1) for c in xv.split(256)]) == yv).float().mean())
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(ckpt))
    print(f"  val acc (MAP, plain torch) {val_acc:.4f}; trained in {train_s:.0f} s", flush=True)
    return {"train_seconds": train_s, "val_accuracy": val_acc, "width": width, "epochs": epochs}


def print_board(title: str, board: dict) -> list[str]:
    """Print a leaderboard; return the methods worse than MAP on validation NLL with no warning."""
    ood = next(iter(board["ood"]), None)
    print(f"\n{title}  (best by validation {board['criterion']}: {board['best']}; "
          f"beats MAP: {board['best_beats_map']})")  # fmt: skip
    head = f"{'method':<15} {'acc':>7} {'NLL':>7} {'ECE':>7} {'Brier':>7} {'AUROC':>7}  {'chosen':<34}"
    head += f" {'fit s':>7}"
    print(head)
    print("-" * len(head))

    def line(name: str, row: dict, chosen: str, secs: str) -> None:
        auroc = row["auroc"].get(ood, float("nan")) if ood else float("nan")
        print(
            f"{name:<15} {row['accuracy']:7.4f} {row['nll']:7.4f} {row['ece']:7.4f} {row['brier']:7.4f} "
            f"{auroc:7.4f}  {chosen:<34} {secs:>7}"
        )

    line("MAP", board["map"], "", "")
    suspicious = []
    for name, row in board["methods"].items():
        hyper = row["hyperparameters"]
        chosen = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in hyper.items()
            if k not in ("validated", "map_point")
        )
        if hyper.get("map_point"):
            chosen = f"MAP pt ({chosen})"
        if not hyper.get("validated"):
            chosen += " [not validated]"
        line(name + (" *" if name == board["best"] else ""), row, chosen, f"{row['fit_seconds']:.1f}")
        if row.get("warning"):
            print(f"{'':<15} warning: {row['warning']}")
        if row["nll"] > board["map"]["nll"] and not row.get("warning"):
            suspicious.append(name)
    if suspicious:
        print(f"worse than MAP on validation NLL, with no warning: {', '.join(suspicious)}")
    return suspicious


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", choices=("lenet", "resnet"), default=None)
    ap.add_argument("--width", type=int, default=32, help="ResNet-18 base width (64 = stock)")
    ap.add_argument("--epochs", type=int, default=6, help="ResNet-18 training epochs")
    ap.add_argument("--resnet-methods", default=None, help="--methods for the ResNet select (default: all)")
    ap.add_argument("--reuse", action="store_true", help="keep checkpoints already in --out")
    args = ap.parse_args()
    shared = args.shared.resolve()
    mnist_root = shared / "data" / "mnist"
    notmnist = shared / "data" / "notmnist" / "raw"
    if not (mnist_root / "MNIST" / "raw").is_dir() or not notmnist.is_dir():
        sys.exit(f"real data not found under {shared / 'data'}; pass --shared DIR")
    out = (args.out or Path(tempfile.mkdtemp(prefix="bayescli-select-real-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    result: dict = {"boards": {}, "seconds": {}, "flagged": {}}
    tables: list[tuple[str, dict]] = []

    if args.only in (None, "lenet"):
        ckpt = out / "lenet.safetensors"
        if not (args.reuse and ckpt.exists()):
            result["seconds"]["lenet_train"], _ = bayescli(
                "train", "--model", "builtin:lenet", "--data", "mnist:test[:5000]", "--epochs", 15,
                "--out", ckpt, "--data-root", mnist_root, "--quiet",
            )  # fmt: skip
        result["seconds"]["lenet_select"], stdout = bayescli(
            "select", "--model", "builtin:lenet", "--checkpoint", ckpt, "--data", "mnist:test[:5000]",
            "--val-data", "mnist:test[5000:6000]", "--ood", f"idx:{notmnist}",
            "--out-dir", out / "select-lenet", "--data-root", mnist_root, "--json", capture=True,
        )  # fmt: skip
        board = json.loads(stdout)
        result["boards"]["mnist_lenet"] = board
        tables.append(("MNIST LeNet: fit test[:5000], val test[5000:6000], OOD notMNIST", board))

    if args.only in (None, "resnet"):
        work = out / "resnet"
        work.mkdir(exist_ok=True)
        (work / "cifar_resnet.py").write_text(FACTORY)
        npz = make_npz(shared, work)
        ckpt = work / f"resnet18-w{args.width}-e{args.epochs}.safetensors"
        if not (args.reuse and ckpt.exists()):
            result["resnet_training"] = train_resnet(
                npz["fit"], npz["val"], args.width, args.epochs, ckpt, work
            )
            result["seconds"]["resnet_train"] = result["resnet_training"]["train_seconds"]
        methods = ["--methods", args.resnet_methods] if args.resnet_methods else []
        result["seconds"]["resnet_select"], stdout = bayescli(
            "select", "--model", "py:cifar_resnet:resnet18", "--model-arg", f"width={args.width}",
            "--checkpoint", ckpt, "--data", f"npz:{npz['fit']}", "--val-data", f"npz:{npz['val']}",
            "--ood", f"npz:{npz['ood']}", "--out-dir", out / "select-resnet18", *methods, "--json",
            cwd=work, capture=True,
        )  # fmt: skip
        board = json.loads(stdout)
        result["boards"]["mnist32rgb_resnet18"] = board
        tables.append((
            f"ResNet-18 (32x32 stem, width {args.width}) on colourised 32x32 MNIST: fit test[:5000], "
            "val test[5000:6000], OOD colourised notMNIST", board,
        ))  # fmt: skip

    for title, board in tables:
        result["flagged"][title] = print_board(title, board)
    result["seconds"]["total"] = time.perf_counter() - wall
    times = ", ".join(f"{k} {v:.1f}" for k, v in result["seconds"].items())
    print(f"\nseconds: {times}; files in {out}")
    (out / "leaderboards.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
