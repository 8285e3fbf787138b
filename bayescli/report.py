"""Pictures and a self-contained HTML page from an evaluation report (a JSON dictionary).

Figures: reliability diagrams per method (with the confidence histogram under each), accuracy /
NLL / ECE / MMC against rotation angle, corruption severity (mean over corruptions) and FGSM ε,
ROC curves per OOD set, and conformal coverage against mean set size. The HTML embeds the PNGs
(base64) and the summary tables (OOD: every score; conformal sets; link fidelity), so it is one
file that opens anywhere.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bayescli.io import atomic_path  # noqa: E402

CURVE_METRICS = ("accuracy", "nll", "ece", "mmc")


def _png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _reliability(results: dict) -> bytes:
    methods = list(results["in_distribution"])
    fig, axes = plt.subplots(
        2,
        len(methods),
        figsize=(3.2 * len(methods), 4.4),
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 1]},
        sharex=True,
    )
    for ax, hist, m in zip(axes[0], axes[1], methods, strict=True):
        rel = results["in_distribution"][m]["reliability"]
        bins = len(rel["count"])
        centres = [(i + 0.5) / bins for i in range(bins)]
        acc = [a if c > 0 else 0 for a, c in zip(rel["accuracy"], rel["count"], strict=True)]
        ax.bar(centres, acc, width=1 / bins, edgecolor="black", alpha=0.7, label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(title=f"{m}: ECE {results['in_distribution'][m]['ece']:.3f}", xlim=(0, 1), ylim=(0, 1))
        total = max(1.0, sum(rel["count"]))
        hist.bar(centres, [c / total for c in rel["count"]], width=1 / bins, color="grey", edgecolor="black")
        hist.set(xlabel="confidence", xlim=(0, 1))
    axes[0][0].set_ylabel("accuracy (in-distribution)")
    axes[1][0].set_ylabel("fraction of inputs")
    return _png(fig)


def _curves(by_x: dict[float, dict], xlabel: str, title: str) -> bytes:
    xs = sorted(by_x)
    methods = list(by_x[xs[0]])
    fig, axes = plt.subplots(1, len(CURVE_METRICS), figsize=(3.3 * len(CURVE_METRICS), 3.0))
    for ax, metric in zip(axes, CURVE_METRICS, strict=True):
        for m in methods:
            ax.plot(xs, [by_x[x][m][metric] for x in xs], marker="o", ms=3, label=m)
        ax.set(xlabel=xlabel, title=metric)
    axes[0].legend(fontsize=7)
    axes[0].set_ylabel(title)
    return _png(fig)


def _roc(ood: dict) -> bytes:
    sets = list(ood)
    fig, axes = plt.subplots(1, len(sets), figsize=(3.3 * len(sets), 3.2), squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        for m, res in ood[name].items():
            score = (
                "max_prob" if "max_prob" in res else next(k for k, v in res.items() if isinstance(v, dict))
            )
            roc = res[score]["roc"]
            ax.plot(roc["fpr"], roc["tpr"], label=f"{m} {score} ({res[score]['auroc']:.3f})")
        ax.plot([0, 1], [0, 1], "k:", lw=1)
        ax.set(title=f"OOD: {name}", xlabel="FPR", ylabel="TPR (in-distribution)")
        ax.legend(fontsize=7)
    return _png(fig)


def _conformal(conformal: dict, alpha: float) -> bytes:
    """Coverage against mean set size per score; methods as points, top-k at the same size as x."""
    scores = list(next(iter(conformal.values())))
    fig, axes = plt.subplots(1, len(scores), figsize=(3.3 * len(scores), 3.2), squeeze=False, sharey=True)
    for ax, score in zip(axes[0], scores, strict=True):
        for m, per in conformal.items():
            row = per[score]
            (dot,) = ax.plot(row["mean_size"], row["coverage"], "o", label=m)
            topk = row["topk_same_size"]
            if "coverage" in topk:
                ax.plot(topk["mean_size"], topk["coverage"], "x", color=dot.get_color())
        ax.axhline(1 - alpha, color="k", ls=":", lw=1)
        ax.set(title=f"{score} (x: top-k, same size)", xlabel="mean set size")
    axes[0][0].set_ylabel("coverage")
    axes[0][0].legend(fontsize=7)
    return _png(fig)


def figures(report: dict) -> dict[str, bytes]:
    """PNG images keyed by a file stem."""
    res = report["results"]
    out = {"reliability": _reliability(res)}
    if "rotation" in res:
        out["rotation"] = _curves({float(k): v for k, v in res["rotation"].items()}, "angle (°)", "rotation")
    if "corruption" in res:
        by_sev: dict[float, dict] = {}
        for per_sev in res["corruption"].values():
            for sev, methods in per_sev.items():
                slot = by_sev.setdefault(float(sev), {})
                for m, metrics in methods.items():
                    acc = slot.setdefault(m, {k: [] for k in CURVE_METRICS})
                    for k in CURVE_METRICS:
                        acc[k].append(metrics[k])
        mean = {
            s: {m: {k: sum(v) / len(v) for k, v in d.items()} for m, d in ms.items()}
            for s, ms in by_sev.items()
        }
        out["corruption"] = _curves(mean, "severity", "corruption (mean over corruptions)")
    if "fgsm" in res:
        eps = report["protocol"]["fgsm"]["epsilons"]
        out["fgsm"] = _curves({eps[k]: v for k, v in res["fgsm"].items()}, "ε (pixels)", "FGSM")
    if "ood" in res:
        out["ood_roc"] = _roc(res["ood"])
    if "conformal" in res:
        out["conformal"] = _conformal(res["conformal"], report["protocol"]["conformal"]["alpha"])
    return out


def _table(title: str, header: list[str], rows: list[list]) -> str:
    def cell(v: object) -> str:
        return f"{v:.4f}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def render_html(report: dict, images: dict[str, bytes]) -> str:
    """One self-contained HTML page."""
    res = report["results"]
    metrics = ["accuracy", "nll", "brier", "ece", "adaptive_ece", "classwise_ece", "mce", "mmc", "entropy"]
    metrics += ["accuracy_at_90", "aurc"]
    parts = [f"<p class='warn'>warning: {html.escape(w)}</p>" for w in report.get("warnings", [])]
    parts.append(
        _table(
            "In-distribution",
            ["method", *metrics],
            [[m, *(v.get(k, "") for k in metrics)] for m, v in res["in_distribution"].items()],
        )
    )
    if "ood" in res:
        rows = [
            [name, m, score, d["auroc"], d["aupr_in"], d["aupr_out"], d["fpr95"], r["mmc"]]
            for name, per in res["ood"].items()
            for m, r in per.items()
            for score, d in r.items()
            if isinstance(d, dict)
        ]
        parts.append(
            _table(
                "Out-of-distribution (in-distribution positive)",
                ["set", "method", "score", "AUROC", "AUPR-in", "AUPR-out", "FPR@95", "MMC"],
                rows,
            )
        )
    if "conformal" in res:
        rows = [
            [m, score, r["threshold"], r.get("coverage", ""), r["mean_size"], t["threshold"], t["mean_size"]]
            + [t.get("coverage", "")]
            for m, per in res["conformal"].items()
            for score, r in per.items()
            for t in [r["topk_same_size"]]
        ]
        alpha = report["protocol"]["conformal"]["alpha"]
        parts.append(
            _table(
                f"Conformal sets (alpha = {alpha}) and uncertainty-aware top-k at the same mean size",
                ["method", "score", "q̂", "coverage", "mean size", "top-k T", "top-k size", "top-k coverage"],
                rows,
            )
        )
    if "link_fidelity" in res:
        rows = [
            [k, *(r.get(key, "") for key in ("kl_mean", "kl_max", "nll", "noise_floor"))]
            for k, r in res["link_fidelity"].items()
        ]
        parts.append(
            _table(
                "Link fidelity: KL(MC ‖ link) on the protocol's test subset (mc: the reference)",
                ["link", "mean KL", "max KL", "NLL", "MC noise floor"],
                rows,
            )
        )
    if report.get("gates"):
        parts.append(
            _table(
                "CI gates",
                ["condition", "value", "failed"],
                [[g["condition"], g["value"], g["failed"]] for g in report["gates"]],
            )
        )
    parts.append(_table("Timings (s)", ["", "seconds"], [[k, v] for k, v in report["timings"].items()]))
    imgs = "".join(
        f'<h2>{html.escape(name)}</h2><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}"/>'
        for name, png in images.items()
    )
    proto = html.escape(str(report.get("protocol", {})))
    model = html.escape(f"{report['model']['model']} · sha256 {report['model']['checkpoint_sha256'][:12]}…")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>bayescli report</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}img{max-width:100%}"
        ".warn{color:#a40}"
        "</style></head><body>"
        f"<h1>bayescli evaluation: {html.escape(report['data']['spec'])}</h1><p>{model}</p>"
        f"{''.join(parts)}{imgs}<h2>Protocol</h2><pre>{proto}</pre></body></html>"
    )


def write_report(report: dict, html_path: Path | None = None, png_dir: Path | None = None) -> list[Path]:
    """Write the HTML page and/or the PNGs (atomically); returns the written paths."""
    images = figures(report)
    written = []
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, png in images.items():
            with atomic_path(png_dir / f"{name}.png") as tmp:
                tmp.write_bytes(png)
            written.append(png_dir / f"{name}.png")
    if html_path is not None:
        text = render_html(report, images)
        with atomic_path(html_path) as tmp:
            tmp.write_text(text)
        written.append(html_path)
    return written
