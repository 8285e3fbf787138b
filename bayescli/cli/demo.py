"""``bayescli demo``: the whole pipeline on the bundled digits data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bayescli._version import __version__
from bayescli.cli import common as c
from bayescli.options import DEFAULT_METHODS, TrainConfig


def demo(
    out_dir: Annotated[Path, typer.Option(help="Where checkpoint, posterior and reports go.")] = Path(
        "demo-output"
    ),
    device: c.Device = "auto",
    seed: c.Seed = 0,
    quiet: c.Quiet = False,
    as_json: c.Json = False,
) -> None:
    """Train a small CNN on digits, fit a last-layer KFAC Laplace, compare MAP with the
    Laplace predictives on the test split, build uncertainty-aware top-k sets, and run the
    evaluation suites (OOD, rotation, corruptions, FGSM) into report.json and report.html.

    Example: bayescli demo --out-dir demo-output
    """
    from bayescli.data.shifts import parse_angles
    from bayescli.evaluation.attacks import parse_epsilons
    from bayescli.evaluation.config import EvalConfig
    from bayescli.evaluation.methods import parse_methods
    from bayescli.evaluation.report import write_report
    from bayescli.evaluation.runner import run_evaluation
    from bayescli.fitting.fit_source import FitSource
    from bayescli.fitting.pipeline import DataOptions, fit_posterior
    from bayescli.io import write_json
    from bayescli.metrics.classification import classification_summary
    from bayescli.models.features import extract_features
    from bayescli.models.specs import load_classifier
    from bayescli.predictive import dirichlet
    from bayescli.predictive.glm import predict
    from bayescli.predictive.topk import topk_summary, uncertainty_topk
    from bayescli.training.classifier import save_checkpoint, train_classifier

    c.setup(quiet, as_json, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = c.resolve_device(device)
    data_opts = DataOptions(seed=seed)
    train_data, val_data, test_data = (data_opts.load(f"digits:{s}", None) for s in ("train", "val", "test"))

    ckpt = out_dir / "model.safetensors"
    clf, meta = train_classifier("builtin:small-cnn", train_data, val_data, TrainConfig(seed=seed), dev)
    save_checkpoint(ckpt, clf.cpu(), meta)

    model = load_classifier("builtin:small-cnn", ckpt)
    # δ chosen on the validation split (the grid runs through marglik's δ up to the MAP limit)
    post = fit_posterior("laplace", FitSource(model, train_data, val_data, dev), seed=seed)
    test_feats = extract_features(model, test_data, device=dev)
    post_path = out_dir / "posterior.safetensors"
    post.save(post_path)

    results = {"map": classification_summary(test_feats.logits.softmax(-1), test_feats.labels)}
    timings = {"forward": test_feats.seconds, "fit": post.meta["fit_seconds"]}
    bridge_pred = None
    for link in ("probit", "bridge"):
        pred = predict(post, test_feats, "glm", link, seed=seed)
        results[f"glm-{link}"] = classification_summary(pred.probs, test_feats.labels)
        timings[f"glm-{link}"] = pred.timings["predictive"] + pred.timings["link"]
        bridge_pred = pred if link == "bridge" else bridge_pred
    results["glm-bridge"]["mean_alpha0"] = float(dirichlet.precision(bridge_pred.alpha).mean())
    results["glm-bridge"]["mean_mutual_information"] = float(
        dirichlet.mutual_information(bridge_pred.alpha).mean()
    )
    sets = uncertainty_topk(bridge_pred.alpha, 0.05, 10)
    topk = topk_summary(sets, bridge_pred.probs, test_feats.labels, 10)
    # Marglik is known to be underconfident on small data: show it beside the validated δ.
    val_delta, marglik_delta = post.prior_precision, post.prior_record["marglik"]
    post.gaussian.with_delta(marglik_delta)
    results["glm-probit (marglik δ)"] = classification_summary(
        predict(post, test_feats, "glm", "probit", seed=seed).probs, test_feats.labels
    )
    post.gaussian.with_delta(val_delta)

    report = {
        "schema_version": 1,
        "kind": "demo",
        "bayescli_version": __version__,
        "checkpoint": str(ckpt),
        "posterior": str(post_path),
        "posterior_summary": c.posterior_summary(post),
        "marglik_prior_precision": marglik_delta,
        "train_accuracy": meta["train_accuracy"],
        "val_accuracy": meta["val_accuracy"],
        "data": test_data.info,
        "results": results,
        "topk": {"threshold": 0.05, "max_k": 10, **topk},
        "timings": timings,
    }
    write_json(out_dir / "demo.json", report)

    # The evaluation suites, with the posterior as saved.
    cfg = EvalConfig(
        methods=parse_methods(DEFAULT_METHODS),
        ood=["noise:uniform", "patches"],
        rotations=parse_angles("0:180:15"),
        corruptions=["gaussian_noise", "defocus_blur", "contrast", "pixelate", "jpeg_compression"],
        severities=[1, 3, 5],
        epsilons=parse_epsilons("0,2/255,8/255"),
        seed=seed,
        device=dev,
    )
    evaluation = run_evaluation({"posterior": post}, model, test_data, cfg)
    write_json(out_dir / "report.json", evaluation)
    write_report(evaluation, html_path=out_dir / "report.html")
    ood_rows = [
        [name, m, r["max_prob"]["auroc"], r["mmc"]]
        for name, per in evaluation["results"]["ood"].items()
        for m, r in per.items()
    ]
    topk_rows = [[k, v] for k, v in topk.items() if not isinstance(v, dict)]
    topk_rows.append(["k histogram", " ".join(f"{k}:{v}" for k, v in topk["k_histogram"].items() if v)])
    c.show(
        quiet,
        as_json,
        c.table(
            "Laplace posterior (last layer, KFAC)",
            ["", "value"],
            [
                ["prior precision (validation NLL)", val_delta],
                ["prior precision (marglik)", marglik_delta],
                ["log marglik at marglik δ", post.log_marglik(marglik_delta)],
                ["parameters", post.gaussian.num_params],
                ["fit seconds", post.meta["fit_seconds"]],
            ],
        ),
        c.metrics_table(
            f"digits test ({len(test_data)} inputs): MAP vs Laplace (δ chosen on digits:val unless noted)",
            results,
        ),
        c.table("uncertainty-aware top-k (bridge, T=0.05)", ["", "value"], topk_rows),
        c.table("timings (s)", ["", "seconds"], [[k, v] for k, v in timings.items()]),
        c.table("OOD detection (max-prob score)", ["set", "method", "AUROC", "MMC"], ood_rows),
        f"evaluation suites: {evaluation['timings']['total']:.1f} s; "
        f"wrote {ckpt}, {post_path} and demo.json, report.json, report.html in {out_dir}",
        payload=report,
    )
