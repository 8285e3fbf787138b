"""Streaming: throughput of the image pipeline, and memory that does not grow with the data.

1. Throughput: an ImageFolder of generated JPEGs (random sizes 160–400 px, 10 classes), timm
   ``resnet18`` (random weights) at 224 px (resize 256, centre crop 224), ``--num-workers 2``,
   batches of 64: features per second of ``bayescli`` (``load_data`` + ``extract_features``) against
   a plain torch ``DataLoader`` over torchvision's ``ImageFolder`` with the same transforms
   (PIL decode, float, antialiased bilinear resize, centre crop) and the same model. Target ≥ 0.9×.
2. Memory: peak RSS of ``bayescli fit-laplace --hessian kron`` (a fresh process, 2 workers) on
   N and on 4N of those images. Target: growth < 15%.
3. A 2048→1000 KFAC fit streamed over 200,000 synthetic feature vectors, generated batch by batch
   and fed to ``LaplacePosterior.fit_last_layer_stream`` (marglik δ included). Target: peak RSS
   < 3 GiB.

Run: ``python benchmarks/streaming.py [--images 2000] [--dir DIR]`` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BATCH, WORKERS, CLASSES = 64, 2, 10


def make_folder(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` JPEGs of random sizes (160–400 px a side): smooth random colour fields plus noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        folder = root / f"class{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        w, h = (int(v) for v in rng.integers(160, 401, size=2))
        coarse = Image.fromarray(rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)).resize(
            (w, h), Image.BICUBIC
        )
        pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-20, 21, size=(h, w, 3))
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)
    return root


def make_checkpoint(path: Path) -> Path:
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = timm.create_model("resnet18", pretrained=False, num_classes=CLASSES)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return path


def throughput(folder: Path, ckpt: Path, repeat: int) -> dict:
    """Features per second: bayescli vs a plain DataLoader loop (best of ``repeat`` alternating runs)."""
    import torchvision
    from torchvision.transforms import v2

    from bayescli.data import load_data
    from bayescli.models.features import extract_features
    from bayescli.models.preprocess import Preprocess
    from bayescli.models.specs import load_classifier

    pre = Preprocess("bench", resize=256, crop=224)
    model = load_classifier("timm:resnet18", ckpt, preprocess=pre)
    clf = model.classifier.eval()

    def ours() -> int:
        data = load_data(f"imagefolder:{folder}", preprocess=pre, num_workers=WORKERS)
        return len(extract_features(model, data, BATCH))

    transform = v2.Compose(
        [
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Resize(256, interpolation=v2.InterpolationMode.BILINEAR, antialias=True),
            v2.CenterCrop(224),
        ]
    )

    def plain() -> int:
        dataset = torchvision.datasets.ImageFolder(str(folder), transform=transform)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)
        n = 0
        with torch.inference_mode():
            for x, _ in loader:
                clf(x)
                n += len(x)
        return n

    best = {"bayescli": 0.0, "plain": 0.0}
    for _ in range(repeat):
        for name, fn in (("plain", plain), ("bayescli", ours)):
            start = time.perf_counter()
            n = fn()
            best[name] = max(best[name], n / (time.perf_counter() - start))
    return {**best, "ratio": best["bayescli"] / best["plain"]}


def fit_rss(folder: Path, ckpt: Path, out: Path, limit: int) -> dict:
    """Peak RSS of one ``fit-laplace --hessian kron`` process on ``limit`` images (own child process)."""
    code = (
        "import resource, sys\n"
        "from bayescli.cli.app import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(f'RSS {self} {kids}')\n"
    )
    args = [
        "fit-laplace",
        "--model",
        "timm:resnet18",
        "--checkpoint",
        ckpt,
        "--data",
        f"imagefolder:{folder}",
    ]
    args += ["--limit", limit, "--resize", "256", "--crop", "224", "--hessian", "kron", "--device", "cpu"]
    args += ["--batch-size", BATCH, "--num-workers", WORKERS, "--out", out, "--quiet"]
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if res.returncode:
        sys.exit(res.stderr)
    main_kib, worker_kib = res.stdout.split("RSS")[-1].split()
    return {
        "images": limit,
        "seconds": time.perf_counter() - start,
        "main_rss_mib": int(main_kib) / 1024,
        "worker_rss_mib": int(worker_kib) / 1024,
    }


def big_kron(n: int = 200_000, d: int = 2048, k: int = 1000, batch: int = 1024) -> dict:
    """A ``d → k`` KFAC fit over ``n`` synthetic features generated batch by batch (run in a child)."""
    from bayescli.posterior.laplace import LaplacePosterior

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(d, k)
    with torch.no_grad():
        head.weight.copy_(torch.randn(k, d, generator=gen) / d**0.5)
        head.bias.zero_()

    def batches():
        for start in range(0, n, batch):
            phi = torch.randn(min(batch, n - start), d, generator=gen).relu_()  # ReLU features, like a CNN's
            with torch.no_grad():
                labels = torch.multinomial(head(phi).softmax(-1), 1, generator=gen).squeeze(1)
            yield phi, labels

    start = time.perf_counter()
    post = LaplacePosterior.fit_last_layer_stream(batches(), head, "kron", batch_size=batch)
    fitted = time.perf_counter() - start
    fit_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    delta = post.optimise_prior_marglik()
    return {
        "n": n,
        "head": f"{d}→{k}",
        "fit_seconds": fitted,
        "marglik_seconds": time.perf_counter() - start - fitted,
        "prior_precision": delta,
        "peak_rss_gib_after_fit": fit_rss,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000, help="images in the generated folder (4N for memory)")
    ap.add_argument("--repeat", type=int, default=2, help="alternating throughput runs (best kept)")
    ap.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--part", choices=["all", "throughput", "memory", "big-kron"], default="all")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # runs big_kron, prints JSON
    args = ap.parse_args()
    if args.child:
        print(json.dumps(big_kron()))
        return
    print(f"# streaming: torch {torch.__version__}, {torch.get_num_threads()} threads, workers {WORKERS}")
    if args.part in ("all", "throughput", "memory"):
        work = args.dir or Path(tempfile.mkdtemp(prefix="bayescli-streaming-"))
        folder = work / "images"
        if not folder.is_dir():
            start = time.perf_counter()
            make_folder(folder, args.images)
            took = time.perf_counter() - start
            print(f"generated {args.images} JPEGs in {took:.1f}s under {folder}", flush=True)
        ckpt = make_checkpoint(work / "r18.safetensors")
    if args.part in ("all", "throughput"):
        tp = throughput(folder, ckpt, args.repeat)
        print(
            f"throughput ({args.images} images, features/s, best of {args.repeat}): bayescli "
            f"{tp['bayescli']:.1f} | plain DataLoader {tp['plain']:.1f} | "
            f"ratio {tp['ratio']:.3f} (target ≥ 0.9)",
            flush=True,
        )
    if args.part in ("all", "memory"):
        small = fit_rss(folder, ckpt, work / "post_n.safetensors", args.images // 4)
        large = fit_rss(folder, ckpt, work / "post_4n.safetensors", args.images)
        growth = large["main_rss_mib"] / small["main_rss_mib"] - 1
        print(
            f"fit-laplace kron peak RSS: N={small['images']} {small['main_rss_mib']:.0f} MiB "
            f"({small['seconds']:.0f}s) | 4N={large['images']} {large['main_rss_mib']:.0f} MiB "
            f"({large['seconds']:.0f}s) | growth {100 * growth:.1f}% (target < 15%) | "
            f"largest worker {max(small['worker_rss_mib'], large['worker_rss_mib']):.0f} MiB",
            flush=True,
        )
    if args.part in ("all", "big-kron"):
        res = subprocess.run(
            [sys.executable, __file__, "--child"], capture_output=True, text=True, check=True
        )
        big = json.loads(res.stdout.strip().splitlines()[-1])
        print(
            f"streamed kron {big['head']} over {big['n']:,} features: fit {big['fit_seconds']:.0f}s, "
            f"marglik {big['marglik_seconds']:.1f}s, δ={big['prior_precision']:.3g}, "
            f"peak RSS {big['peak_rss_gib']:.2f} GiB (after the fit {big['peak_rss_gib_after_fit']:.2f}; "
            "target < 3 GiB)"
        )


if __name__ == "__main__":
    main()
