"""Scale: a last-layer Laplace fit and GLM predictive where the backbone runs (GPU or CPU).

timm ``resnet50`` with random weights, synthetic 224 px images generated on the device (so data
loading is out of the picture), its 2048→1000 head. Three passes over the same images:

1. the plain forward pass (inference mode): the reference;
2. the kron fit as ``fit-laplace`` does it: features batch by batch into the float64 curvature
   sums on the device, then the float64 eigendecompositions and the marglik δ — as a ratio to (1)
   (issue 11 target on a GPU: ≤ 1.3× over 50,000 images);
3. GLM + probit prediction (features, logit Gaussian, link) over ``--predict-images`` — the time it
   adds to the forward pass (target on a GPU: ≤ 5%).

With ``--precision bf16`` (or ``fp16``, CUDA only) passes 2 and 3 run the backbone as
``FeatureStream`` does at that precision (autocast, channels_last, φ cast to float32 before the
head, float64 curvature sums), and their times are given as ratios to the **fp32** forward pass
(issue 33 target on an H100/H200 at bf16: ≤ 0.6× for both); the forward pass at that precision is
shown beside it.

Also the peak device memory (CUDA) or peak RSS (CPU), and the per-image costs behind the
ImageNet extrapolation in README. Defaults: 50,000 / 10,000 images on CUDA; 512 / 256 on a CPU,
where this is a check that the script works and a CPU measurement, not the GPU one.

Run: ``python benchmarks/scale.py [--device cuda] [--images N] [--predict-images M] [--precision bf16]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_gib, setup_threads  # noqa: E402

from bayescli import devices  # noqa: E402
from bayescli.models.features import autocast, backbone_layout, check_precision  # noqa: E402
from bayescli.models.specs import Classifier  # noqa: E402
from bayescli.options import Precision  # noqa: E402
from bayescli.posterior.laplace import LaplacePosterior  # noqa: E402
from bayescli.predictive.links import probit  # noqa: E402


def images(n: int, batch: int, device: torch.device, seed: int = 0):
    """``n`` uniform 224 px RGB images in batches, drawn on ``device`` (the same for each pass)."""
    gen = devices.generator(device, seed)
    for start in range(0, n, batch):
        yield torch.rand(min(batch, n - start), 3, 224, 224, generator=gen, device=device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Wall seconds of ``fn()`` with the device's queue drained before and after, and its result."""
    devices.synchronize(device)
    start = time.perf_counter()
    out = fn()
    devices.synchronize(device)
    return time.perf_counter() - start, out


def main() -> None:
    import timm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--predict-images", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precision", choices=[p.value for p in Precision], default="fp32")
    args = parser.parse_args()
    dev = devices.resolve_device(args.device)
    precision = check_precision(args.precision, dev)
    cuda = dev.type == "cuda"
    n_fit = args.images or (50_000 if cuda else 512)
    n_pred = args.predict_images or (10_000 if cuda else 256)
    batch = args.batch_size if cuda else min(args.batch_size, 64)
    torch.backends.cudnn.benchmark = True

    net = timm.create_model("resnet50", pretrained=False, num_classes=1000)
    clf = Classifier(net, "fc").to(dev).eval()
    name = torch.cuda.get_device_name(dev) if cuda else f"CPU, {setup_threads()}"
    print(
        f"# resnet50 random weights, 224 px synthetic images on {dev} ({name}), batch {batch}, "
        f"precision {precision.value}"
    )
    low = precision is not Precision.FP32

    def layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x

    def features(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
        """φ as FeatureStream computes it at ``precision`` (float32 for the head)."""
        with autocast(precision, dev):
            phi = clf.features(layout(x, channels_last))
        return phi.float() if low else phi

    def forward(n: int, at: Precision = Precision.FP32):
        def run() -> None:
            with backbone_layout(clf, at) as channels_last, torch.inference_mode(), autocast(at, dev):
                for x in images(n, batch, dev):
                    clf(layout(x, channels_last))

        return run

    def fit():
        def stream(channels_last: bool):
            for x in images(n_fit, batch, dev):
                with torch.inference_mode():  # around the forward only, as in FeatureStream
                    phi = features(x, channels_last)
                    labels = clf.head(phi).argmax(1)  # the MAP labels: marglik needs labels
                yield phi, labels

        with backbone_layout(clf, precision) as channels_last:
            post = LaplacePosterior.fit_last_layer_stream(stream(channels_last), clf.head, "kron")
        post.optimise_prior_marglik()
        return post

    def predict(post: LaplacePosterior):
        def run() -> None:
            with backbone_layout(clf, precision) as channels_last, torch.inference_mode():
                for x in images(n_pred, batch, dev):
                    probit(post.logit_gaussian(features(x, channels_last)))

        return run

    timed(forward(2 * batch), dev)  # warm-up: kernels, allocator, cudnn autotuning
    if low:
        timed(forward(2 * batch, precision), dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    fwd_fit, _ = timed(forward(n_fit), dev)
    fwd_low = timed(forward(n_fit, precision), dev)[0] if low else None
    fit_s, post = timed(fit, dev)
    fwd_pred, _ = timed(forward(n_pred), dev)
    pred_s, _ = timed(predict(post), dev)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else peak_rss_gib()
    tag = f" {precision.value}" if low else ""
    fit_target = "(GPU target ≤ 0.6x)" if low else "(GPU target ≤ 1.3x)"
    print("pass                          images    seconds   ms/image   vs fp32 forward")
    print(
        f"forward                     {n_fit:8d} {fwd_fit:10.2f} {1e3 * fwd_fit / n_fit:10.3f}        1.00x"
    )
    if fwd_low is not None:
        print(
            f"{'forward' + tag:<27} {n_fit:8d} {fwd_low:10.2f} {1e3 * fwd_low / n_fit:10.3f} "
            f"{fwd_low / fwd_fit:11.2f}x"
        )
    print(
        f"{'fit-laplace kron + marglik' + tag:<27} {n_fit:8d} {fit_s:10.2f} {1e3 * fit_s / n_fit:10.3f} "
        f"{fit_s / fwd_fit:11.2f}x   {fit_target}"
    )
    print(
        f"forward                     {n_pred:8d} {fwd_pred:10.2f} {1e3 * fwd_pred / n_pred:10.3f}"
        + " " * 8
        + "1.00x"
    )
    print(
        f"{'GLM + probit predict' + tag:<27} {n_pred:8d} {pred_s:10.2f} {1e3 * pred_s / n_pred:10.3f} "
        f"{pred_s / fwd_pred:11.2f}x   {'(GPU target ≤ 0.6x)' if low else '(GPU target ≤ 1.05x)'}"
    )
    print(f"prior precision (marglik): {post.prior_precision:.4g}")
    print(f"peak {'GPU memory' if cuda else 'RSS'}: {peak:.2f} GiB")
    per_image = fit_s / n_fit
    hours = 1.28e6 * per_image / 3600
    print(
        f"extrapolation: 1.28 M images × {1e3 * per_image:.3f} ms = {hours:.1f} h on one {dev.type} "
        f"process; {hours / 8:.2f} h on 8, {hours / 32:.2f} h on 32 (fit pass; the all_reduce of "
        "the float64 factors, 8 MB + 34 MB once, is negligible)"
    )


if __name__ == "__main__":
    main()
