"""GLM vs GGP predictives, at θ* / f* and refined, on the digits test split.

Trains the demo CNN (seeded), fits a last-layer full Laplace with the marginal-likelihood prior
(chosen at θ*), then reports NLL / accuracy / ECE (probit link) and wall time for: MAP, GLM at
θ*, GLM refined (``--refine-mode``; δ kept, and δ re-chosen at the refined mode), GGP at f*
and GGP refined (δ kept), for M ∈ {100, 300, 1000, all} fitting points. With all points, GGP
at f* equals GLM at θ* and GGP refined equals GLM refined with δ kept (seed 003 §2.5).

Run: ``python benchmarks/ggp.py``
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import setup_threads  # noqa: E402

from bayescli.data import Data, load_data  # noqa: E402
from bayescli.metrics.classification import classification_summary, nll  # noqa: E402
from bayescli.models.features import Features, extract_features  # noqa: E402
from bayescli.models.specs import LoadedModel, load_classifier  # noqa: E402
from bayescli.posterior.laplace import fit_laplace  # noqa: E402
from bayescli.predictive.ggp import GGPPredictor  # noqa: E402
from bayescli.predictive.links import probit  # noqa: E402
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier  # noqa: E402


def row(name: str, probs, labels, seconds: float) -> None:  # noqa: ANN001
    m = classification_summary(probs, labels)
    print(f"{name} | {m['nll']:.4f} | {m['accuracy']:.4f} | {m['ece']:.4f} | {seconds:.2f}")


def setup() -> tuple[LoadedModel, Data, Data, Features, Features]:
    """The seeded demo CNN on digits: ``(model, train, test, train features, test features)``."""
    train, val, test = (load_data(f"digits:{s}") for s in ("train", "val", "test"))
    net, meta = train_classifier("builtin:small-cnn", train, val, TrainConfig(seed=0))
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "cnn.safetensors", net, meta)
        model = load_classifier("builtin:small-cnn", Path(tmp) / "cnn.safetensors")
    return model, train, test, extract_features(model, train), extract_features(model, test)


def all_points_equivalence() -> dict[str, float]:
    """Seed 003 §2.5 with every fitting point: test NLLs (probit) of GLM at θ* and GGP at f*, of
    GLM refined and GGP refined (δ kept, the marglik δ at θ*), and the largest probability gap
    of each pair."""
    model, train, _, tr, te = setup()
    post = fit_laplace(model.classifier, tr.phi, tr.labels, structure="full", prior_precision="auto")
    refined = fit_laplace(
        model.classifier, tr.phi, tr.labels, structure="full", prior_precision=post.prior_precision,
        refine_steps=20,
    )  # fmt: skip
    out: dict[str, float] = {"prior_precision": post.prior_precision, "points": float(len(train))}
    for name, glm_post, refine in (("f*", post, False), ("refined", refined, True)):
        p_glm = probit(glm_post.logit_gaussian(te.phi))
        p_ggp = probit(GGPPredictor(post, tr, refine).logit_gaussian(te))
        out[f"glm {name}"] = nll(p_glm, te.labels)
        out[f"ggp {name}"] = nll(p_ggp, te.labels)
        out[f"max gap {name}"] = float((p_glm - p_ggp).abs().max())
    return out


def main() -> None:
    model, train, test, tr, te = setup()
    clf = model.classifier
    print(f"# GLM vs GGP on digits ({len(train)} train, {len(test)} test), probit link, {setup_threads()}")
    print("setting | NLL | accuracy | ECE | seconds")
    row("MAP", te.logits.softmax(-1), te.labels, 0.0)
    start = time.perf_counter()
    post = fit_laplace(clf, tr.phi, tr.labels, structure="full", prior_precision="auto")
    fit_s = time.perf_counter() - start
    delta = post.prior_precision
    row(f"GLM at θ* (full, marglik δ={delta:.3g})", probit(post.logit_gaussian(te.phi)), te.labels, fit_s)
    for prior, label in ((delta, f"δ={delta:.3g} kept"), ("auto", "marglik δ re-chosen")):
        start = time.perf_counter()
        refined = fit_laplace(
            clf, tr.phi, tr.labels, structure="full", prior_precision=prior, refine_steps=20
        )
        ref = refined.meta["refinement"]
        row(
            f"GLM refined ({label} → {refined.prior_precision:.3g}; {ref['steps_taken']} Newton steps, "
            f"objective {ref['objective_at_map']:.2f} → {ref['objective_refined']:.2f})",
            probit(refined.logit_gaussian(te.phi)),
            te.labels,
            time.perf_counter() - start,
        )
    for m in (100, 300, 1000, len(train)):
        sub = load_data("digits:train", limit=m) if m < len(train) else train
        fs = extract_features(model, sub)
        for refine in (False, True):
            start = time.perf_counter()
            ggp = GGPPredictor(post, Features(fs.phi, fs.logits, fs.labels), refine)
            lg = ggp.logit_gaussian(te)
            label = "refined" if refine else "at f*"
            extra = f", {ggp.info['newton_iterations']} Newton steps" if refine else ""
            row(f"GGP {label} (M={len(sub)}{extra})", probit(lg), te.labels, time.perf_counter() - start)


if __name__ == "__main__":
    main()
