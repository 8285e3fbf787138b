"""Pictures and a self-contained HTML page from an evaluation report (a JSON dictionary).

Figures: reliability diagrams per method (with the confidence histogram under each), accuracy /
NLL / ECE / MMC against rotation angle, corruption severity (mean over corruptions) and FGSM ε,
ROC curves per OOD set, and conformal coverage against mean set size. The HTML embeds the PNGs
(base64) and the summary tables (OOD: every score; conformal sets; link fidelity), so it is one
file that opens anywhere.

A multi-label report (``likelihood: bernoulli``) draws per-label average precision and ECE in
place of the reliability diagrams, mAP / NLL / ECE / Hamming loss against the shifts, and the
per-label conformal coverage; its tables add the per-label metrics.
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
MULTILABEL_CURVE_METRICS = ("map", "nll", "ece", "hamming_loss")
MULTILABEL_METRICS = ["map", "micro_f1", "macro_f1", "hamming_loss", "subset_accuracy", "nll", "brier", "ece"]
MULTILABEL_METRICS += ["mean_entropy", "subset_accuracy_at_90", "hamming_loss_at_90", "aurc_hamming"]
PER_LABEL = ("positives", "average_precision", "f1", "nll", "brier", "ece")
PANEL_COLUMNS = 4  # reliability panels per row
ROC_COLUMNS = 2  # ROC panels per row (each with its legend beside it)
LEGEND_OUTSIDE = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0}


def _png(fig, tight: bool = True) -> bytes:
    if tight:  # figures with nested grids set their own spacing
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _grid(n: int, max_cols: int) -> tuple[int, int]:
    """Rows and columns of a grid of ``n`` panels, at most ``max_cols`` wide."""
    cols = max(1, min(n, max_cols))
    return -(-n // cols), cols


def _reliability(results: dict) -> bytes:
    """One panel per method (in-distribution accuracy per confidence bin over the share of inputs
    in each bin), in a grid of at most ``PANEL_COLUMNS`` columns so that 10+ methods stay
    readable."""
    methods = list(results["in_distribution"])
    rows, cols = _grid(len(methods), PANEL_COLUMNS)
    fig = plt.figure(figsize=(3.2 * cols, 4.4 * rows))
    outer = fig.add_gridspec(rows, cols, hspace=0.3, wspace=0.3)
    for i, m in enumerate(methods):
        inner = outer[i // cols, i % cols].subgridspec(2, 1, height_ratios=[3, 1], hspace=0.08)
        ax = fig.add_subplot(inner[0])
        hist = fig.add_subplot(inner[1], sharex=ax)
        rel = results["in_distribution"][m]["reliability"]
        bins = len(rel["count"])
        centres = [(j + 0.5) / bins for j in range(bins)]
        acc = [a if c > 0 else 0 for a, c in zip(rel["accuracy"], rel["count"], strict=True)]
        ax.bar(centres, acc, width=1 / bins, edgecolor="black", alpha=0.7, label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(title=f"{m}: ECE {results['in_distribution'][m]['ece']:.3f}", xlim=(0, 1), ylim=(0, 1))
        ax.tick_params(labelbottom=False)
        total = max(1.0, sum(rel["count"]))
        hist.bar(centres, [c / total for c in rel["count"]], width=1 / bins, color="grey", edgecolor="black")
        hist.set(xlabel="confidence", xlim=(0, 1))
        if i % cols == 0:
            ax.set_ylabel("accuracy")
            hist.set_ylabel("share")
    fig.align_ylabels()
    return _png(fig, tight=False)


def _per_label(results: dict) -> bytes:
    """Per-label average precision and ECE of every method (grouped bars, one group per label)."""
    rows = results["in_distribution"]
    methods = list(rows)
    labels = list(next(iter(rows.values()))["per_label"]["ece"])
    fig, axes = plt.subplots(1, 2, figsize=(2 * max(5.0, 0.4 * len(labels)), 3.2))
    width = 0.8 / len(methods)
    for ax, metric, title in zip(
        axes, ("average_precision", "ece"), ("average precision", "ECE"), strict=True
    ):
        for i, m in enumerate(methods):
            values = [rows[m]["per_label"][metric][k] for k in labels]
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, [0 if v is None else v for v in values], width=width, label=m)
        ax.set(title=f"per label: {title}", xlabel="label", xticks=range(len(labels)), xticklabels=labels)
    axes[-1].legend(**LEGEND_OUTSIDE)
    return _png(fig)


def _curves(
    by_x: dict[float, dict], xlabel: str, title: str, metrics: tuple[str, ...] = CURVE_METRICS
) -> bytes:
    xs = sorted(by_x)
    methods = list(by_x[xs[0]])
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.0))
    for ax, metric in zip(axes, metrics, strict=True):
        for m in methods:
            ax.plot(xs, [by_x[x][m][metric] for x in xs], marker="o", ms=3, label=m)
        ax.set(xlabel=xlabel, title=metric)
    axes[-1].legend(**LEGEND_OUTSIDE)  # beside the last panel, not over the curves
    axes[0].set_ylabel(title)
    return _png(fig)


def _roc(ood: dict) -> bytes:
    """ROC per OOD set, at most ``ROC_COLUMNS`` panels a row, each legend outside its axes."""
    sets = list(ood)
    rows, cols = _grid(len(sets), ROC_COLUMNS)
    fig, axes = plt.subplots(rows, cols, figsize=(6.8 * cols, 3.4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(sets) :]:
        ax.set_visible(False)
    for ax, name in zip(flat, sets, strict=False):
        for m, res in ood[name].items():
            # the confidence score every method has (softmax, multi-label), else the first one
            preferred = [k for k in ("max_prob", "max_sigmoid") if isinstance(res.get(k), dict)]
            score = preferred[0] if preferred else next(k for k, v in res.items() if isinstance(v, dict))
            roc = res[score]["roc"]
            ax.plot(roc["fpr"], roc["tpr"], label=f"{m} {score} ({res[score]['auroc']:.3f})")
        ax.plot([0, 1], [0, 1], "k:", lw=1)
        ax.set(title=f"OOD: {name}", xlabel="FPR", ylabel="TPR (in-distribution)", aspect="equal")
        ax.legend(**LEGEND_OUTSIDE)
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
    axes[0][-1].legend(**LEGEND_OUTSIDE)
    return _png(fig)


def _label_coverage(conformal: dict, alpha: float) -> bytes:
    """Per-label conformal coverage of every method against the target ``1 − α``."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for m, per in conformal.items():
        coverage = per["lac"]["per_label"]["coverage"]
        ax.plot(list(coverage), list(coverage.values()), "o-", ms=3, label=m)
    ax.axhline(1 - alpha, color="k", ls=":", lw=1)
    ax.set(title="per-label conformal sets (lac)", xlabel="label", ylabel="coverage")
    ax.legend(**LEGEND_OUTSIDE)
    return _png(fig)


def figures(report: dict) -> dict[str, bytes]:
    """PNG images keyed by a file stem."""
    res = report["results"]
    multilabel = report.get("likelihood") == "bernoulli"
    metrics = MULTILABEL_CURVE_METRICS if multilabel else CURVE_METRICS
    out = {"per_label": _per_label(res)} if multilabel else {"reliability": _reliability(res)}
    if "rotation" in res:
        rotation = {float(k): v for k, v in res["rotation"].items()}
        out["rotation"] = _curves(rotation, "angle (°)", "rotation", metrics)
    if "corruption" in res:
        by_sev: dict[float, dict] = {}
        for per_sev in res["corruption"].values():
            for sev, methods in per_sev.items():
                slot = by_sev.setdefault(float(sev), {})
                for m, values in methods.items():
                    acc = slot.setdefault(m, {k: [] for k in metrics})
                    for k in metrics:
                        acc[k].append(values[k])
        mean = {
            s: {m: {k: sum(v) / len(v) for k, v in d.items()} for m, d in ms.items()}
            for s, ms in by_sev.items()
        }
        out["corruption"] = _curves(mean, "severity", "corruption (mean over corruptions)", metrics)
    if "fgsm" in res:
        eps = report["protocol"]["fgsm"]["epsilons"]
        out["fgsm"] = _curves({eps[k]: v for k, v in res["fgsm"].items()}, "ε (pixels)", "FGSM", metrics)
    if "ood" in res:
        out["ood_roc"] = _roc(res["ood"])
    if "conformal" in res:
        alpha = report["protocol"]["conformal"]["alpha"]
        draw = _label_coverage if multilabel else _conformal
        out["conformal"] = draw(res["conformal"], alpha)
    return out


def _table(title: str, header: list[str], rows: list[list]) -> str:
    def cell(v: object) -> str:
        return f"{v:.4f}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def _interval(ci: list[float] | None) -> str:
    return "" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def _recipe(pre: dict | None) -> str:
    """A preprocessing recipe on one line (``the checkpoint's own`` when none is recorded)."""
    if not pre:
        return "the checkpoint's own"
    return ", ".join(f"{k} {v}" for k, v in pre.items() if v is not None)


def _model_section(report: dict) -> str:
    """What was evaluated: model spec, checkpoint (path and short sha256), classes, the
    preprocessing of the inputs, and each posterior (method, prior precision, recipe)."""
    model = report.get("model") or {}
    sha = str(model.get("checkpoint_sha256", ""))
    rows = [
        ["model", model.get("model", "")],
        ["checkpoint", model.get("checkpoint", "")],
        ["checkpoint sha256", f"{sha[:12]}…" if sha else ""],
        ["classes", model.get("num_classes", "")],
        ["preprocessing", _recipe(model.get("preprocess"))],
    ]
    for group in report.get("protocol", {}).get("preprocessing") or []:
        rows.append([f"preprocessing of {', '.join(group['posteriors'])}", _recipe(group.get("preprocess"))])
    for tag, post in (report.get("posteriors") or {}).items():
        facts = [post.get("method"), post.get("subset")]
        delta = post.get("prior_precision")
        if delta is not None:
            facts.append(f"prior precision δ = {delta:.4g}" if isinstance(delta, float) else f"δ = {delta}")
        if post.get("preprocess"):
            facts.append(f"fitted with preprocessing {_recipe(post['preprocess'])}")
        rows.append([f"posterior {tag}", ", ".join(str(f) for f in facts if f is not None)])
    body = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td class='l'>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    return f"<h2>Model</h2><table>{body}</table>"


def render_html(report: dict, images: dict[str, bytes]) -> str:
    """One self-contained HTML page."""
    res = report["results"]
    multilabel = report.get("likelihood") == "bernoulli"
    metrics = ["accuracy", "nll", "brier", "ece", "adaptive_ece", "classwise_ece", "mce", "mmc", "entropy"]
    metrics += ["accuracy_at_90", "aurc"]
    metrics = MULTILABEL_METRICS if multilabel else metrics
    parts = [_model_section(report)]
    parts += [f"<p class='warn'>warning: {html.escape(w)}</p>" for w in report.get("warnings", [])]
    parts.append(
        _table(
            "In-distribution (multi-label: means over labels)" if multilabel else "In-distribution",
            ["method", *metrics],
            [[m, *(v.get(k, "") for k in metrics)] for m, v in res["in_distribution"].items()],
        )
    )
    if multilabel:
        rows = [
            [
                m,
                label,
                *("" if v["per_label"][k][label] is None else v["per_label"][k][label] for k in PER_LABEL),
            ]
            for m, v in res["in_distribution"].items()
            for label in v["per_label"]["ece"]
        ]
        parts.append(_table("In-distribution per label", ["method", "label", *PER_LABEL], rows))
    mean = "mean_max_sigmoid" if multilabel else "mmc"
    if "ood" in res:
        rows = [
            [name, m, score, d["auroc"], d["aupr_in"], d["aupr_out"], d["fpr95"], r[mean]]
            for name, per in res["ood"].items()
            for m, r in per.items()
            for score, d in r.items()
            if isinstance(d, dict)
        ]
        parts.append(
            _table(
                "Out-of-distribution (in-distribution positive)",
                ["set", "method", "score", "AUROC", "AUPR-in", "AUPR-out", "FPR@95"]
                + ["mean max sigmoid" if multilabel else "MMC"],
                rows,
            )
        )
    if "conformal" in res and multilabel:
        rows = [
            [m, label, per["lac"]["per_label"]["threshold"][label], cov]
            + [
                _interval(per["lac"]["per_label"]["coverage_ci"][label]),
                per["lac"]["per_label"]["mean_size"][label],
            ]
            for m, per in res["conformal"].items()
            for label, cov in per["lac"]["per_label"]["coverage"].items()
        ]
        alpha = report["protocol"]["conformal"]["alpha"]
        parts.append(
            _table(
                f"Per-label conformal sets (lac, alpha = {alpha}): coverage holds per label",
                ["method", "label", "q̂", "coverage", "95% CI (Clopper–Pearson)", "mean size"],
                rows,
            )
        )
    elif "conformal" in res:
        rows = [
            [m, score, r["threshold"], r.get("coverage", ""), _interval(r.get("coverage_ci"))]
            + [r["mean_size"], t["threshold"], t["mean_size"], t.get("coverage", "")]
            for m, per in res["conformal"].items()
            for score, r in per.items()
            for t in [r["topk_same_size"]]
        ]
        alpha = report["protocol"]["conformal"]["alpha"]
        parts.append(
            _table(
                f"Conformal sets (alpha = {alpha}) and uncertainty-aware top-k at the same mean size",
                ["method", "score", "q̂", "coverage", "95% CI (Clopper–Pearson)", "mean size", "top-k T"]
                + ["top-k size", "top-k coverage"],
                rows,
            )
        )
    if "link_fidelity" in res:
        fid = res["link_fidelity"]
        note = any("undefined" in r for r in fid.values())  # a null row says why
        rows = [
            [k, *("" if r.get(v) is None else r[v] for v in ("kl_mean", "kl_max", "nll", "noise_floor"))]
            + ([r.get("undefined", "")] if note else [])
            for k, r in fid.items()
        ]
        parts.append(
            _table(
                "Link fidelity: KL(reference ‖ link) on the protocol's test subset (the reference: mc, or "
                "dirichlet for a posterior whose native output is a Dirichlet)",
                ["link", "mean KL", "max KL", "NLL", "MC noise floor"] + (["note"] if note else []),
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
        ".warn{color:#a40}td.l{text-align:left}"
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
