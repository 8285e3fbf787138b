"""The HTML/PNG report explains itself (issue 23): readable figures with 10+ methods, the model,
checkpoint hash and preprocessing in the page, coverage intervals and undefined fidelity."""

import struct

from bayescli.evaluation.report import figures, render_html

METHODS = [f"method-{i}" for i in range(10)]
SHA = "0123456789abcdef" * 4


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])  # the IHDR chunk: width, height


def _report() -> dict:
    bins = 10
    row = {
        "accuracy": 0.9, "nll": 0.3, "brier": 0.1, "ece": 0.02, "mmc": 0.9, "entropy": 0.2,
        "reliability": {"count": [0] * 8 + [20, 80], "accuracy": [0.0] * 8 + [0.8, 0.95],
                        "confidence": [0.0] * 8 + [0.85, 0.97]},
    }  # fmt: skip
    roc = {"fpr": [0.0, 0.2, 1.0], "tpr": [0.0, 0.7, 1.0]}
    detection = {"auroc": 0.8, "aupr_in": 0.8, "aupr_out": 0.8, "fpr95": 0.5, "roc": roc}
    conformal = {
        "threshold": 0.7, "mean_size": 1.2, "coverage": 0.88, "coverage_ci": [0.8301, 0.9212],
        "size_histogram": {"1": 180, "2": 36},
        "topk_same_size": {"threshold": 0.1, "mean_size": 1.2, "max_k": 10, "coverage": 0.87},
    }  # fmt: skip
    assert len(row["reliability"]["count"]) == bins
    return {
        "data": {"spec": "digits:test"},
        "model": {
            "model": "builtin:small-cnn",
            "checkpoint": "ckpt.safetensors",
            "checkpoint_sha256": SHA,
            "num_classes": 10,
            "preprocess": {"mean": [0.5], "std": [0.25], "resize": None, "crop": None},
        },
        "posteriors": {"post": {"method": "laplace", "subset": "last_layer", "prior_precision": 1e8}},
        "protocol": {"conformal": {"alpha": 0.1}},
        "results": {
            "in_distribution": {m: row for m in METHODS},
            "ood": {"patches": {m: {"mmc": 0.6, "max_prob": detection} for m in METHODS}},
            "conformal": {m: {"lac": conformal} for m in METHODS},
            "link_fidelity": {
                "bridge": {"kl_mean": 0.04, "kl_max": 0.1, "nll": 0.3},
                "bridge-norm": {
                    "kl_mean": None,
                    "kl_max": None,
                    "nll": None,
                    "undefined": "undefined on 64 of 64 inputs: logit variances ≈ 0",
                },
            },
        },
        "timings": {"forward": 1.0, "total": 2.0},
        "warnings": [],
    }


def test_figures_stay_readable_with_ten_methods():
    """10 methods in one row made a 3,509-px reliability figure; a grid of ≤ 4 columns keeps it
    under ~2,000 px wide (and stacks rows), and the ROC legend sits outside the axes."""
    images = figures(_report())
    width, height = _png_size(images["reliability"])
    assert width <= 2000 and height > width / 2  # several rows of panels, not one long strip
    roc_width, _ = _png_size(images["ood_roc"])
    assert roc_width <= 2000


def test_roc_legend_is_outside_the_axes():
    import matplotlib.pyplot as plt

    from bayescli.evaluation import report as rp

    captured = []
    real = rp._png

    def keep(fig):
        fig.canvas.draw()
        ax = fig.axes[0]
        captured.append((ax.get_window_extent(), ax.get_legend().get_window_extent()))
        return real(fig)

    rp._png = keep
    try:
        rp._roc(_report()["results"]["ood"])
    finally:
        rp._png = real
        plt.close("all")
    axes_box, legend_box = captured[0]
    assert legend_box.x0 >= axes_box.x1  # to the right of the curves, not over them


def test_html_shows_model_checkpoint_preprocessing_coverage_interval_and_undefined_fidelity():
    page = render_html(_report(), {})
    assert "builtin:small-cnn" in page and SHA[:12] in page
    assert "preprocessing" in page and "mean [0.5], std [0.25]" in page
    assert "prior precision δ = 1e+08" in page
    assert "[0.8301, 0.9212]" in page  # the conformal coverage's binomial interval
    assert "logit variances ≈ 0" in page and "nan" not in page.lower()
