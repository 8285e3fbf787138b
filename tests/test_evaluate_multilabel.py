"""``evaluate``, ``conformal`` and ``report`` on a multi-label (bernoulli) posterior, end to end on
composed digits: every number of the multi-label blocks against an independent recomputation
(scikit-learn and numpy on the probabilities ``predict`` gives), the schema, ``--fail-if`` on
multi-label paths, and the one-line refusals."""

import json
import math
from functools import partial
from importlib.resources import files

import jsonschema
import numpy as np
import pytest
import torch
from scipy.special import xlogy
from sklearn import metrics as skm
from test_cli import one_error_line
from tolerance import assert_close

from bayescli.data import load_data
from bayescli.data.corruptions import corrupt
from bayescli.data.shifts import rotate, synthetic_ood
from bayescli.evaluation.report import figures, render_html
from bayescli.io import load_tensors, save_tensors
from bayescli.models.features import extract_features
from bayescli.posterior.base import load_posterior
from bayescli.predictive.glm import predict
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier

METHODS = "map,glm-none,glm-probit,glm-mc,glm-beta"
SAMPLES = 200  # the mc link's draws; the recomputation draws the same ones (same seed)
ALPHA = 0.1
EPS = 0.05
# Both sides compute in float64 from the same float32 probabilities; sums over ≤ 1800·10 terms
# round at ≲ 1e-13 relative. 1e-10 leaves a margin of 10³ and still catches any changed term.
TOL = 1e-10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A sigmoid-per-digit MLP on composed digits, its validated Laplace posterior, and one
    ``evaluate`` run with every suite (exit 1: one of its gates holds)."""
    from bayescli.cli.app import main

    tmp = tmp_path_factory.mktemp("eval_multi")
    ckpt, post = tmp / "multi.safetensors", tmp / "post.safetensors"
    train, val = load_data("composed-digits:train"), load_data("composed-digits:val")
    clf, meta = train_classifier(
        "builtin:mlp", train, val, TrainConfig(epochs=40, seed=0, weight_decay=0.0), likelihood="bernoulli"
    )
    save_checkpoint(ckpt, clf, meta)

    def run(*args) -> int:
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    # --device cpu: every number below is compared with an in-process CPU recomputation at TOL
    fit = ("--model", "builtin:mlp", "--checkpoint", ckpt, "--data", "composed-digits:train")
    fit = (*fit, "--device", "cpu")
    assert run("fit-laplace", *fit, "--val-data", "composed-digits:val", "--out", post, "--quiet") == 0
    report = tmp / "report.json"
    code = run(
        "evaluate", "--posterior", post, "--data", "composed-digits:test", "--methods", METHODS,
        "--samples", SAMPLES, "--ood", "noise:uniform", "--rotation", "0:90:45", "--fgsm", f"0,{EPS}",
        "--corruption", "gaussian_noise", "--severity", "2",
        "--conformal", ALPHA, "--out", report, "--quiet", "--device", "cpu",
        "--fail-if", "in_distribution.glm-probit.map < 0.5",  # passes (mAP ≈ 0.93)
        "--fail-if", "ood.noise:uniform.glm-probit.joint_energy.auroc > 0.5",  # fails (≈ 0.56)
        "--fail-if", "in_distribution.glm-beta.per_label.nll.3 > 10",  # passes
    )  # fmt: skip
    return {"tmp": tmp, "post": post, "code": code, "report": json.loads(report.read_text())}


@pytest.fixture(scope="module")
def predictions(setup):
    """Each method's probabilities (and what its OOD scores need) on the test set and the OOD
    set, from ``predict`` on features extracted here."""
    post = load_posterior(setup["post"])
    model = post.load_model()
    test = load_data("composed-digits:test", preprocess=model.preprocess)
    ood = synthetic_ood("noise:uniform", test, len(test), 0)
    out = {"post": post, "model": model, "data": test, "y": test.y.numpy()}
    for name, data in (("test", test), ("ood", ood)):
        feats = extract_features(model, data)
        rows = {
            "map": {"probs": torch.sigmoid(feats.logits).double().numpy(), "logits": feats.logits.double()}
        }
        for link in ("none", "probit", "mc", "beta"):
            pred = predict(post, feats, link=link, samples=SAMPLES, seed=0)
            mi = pred.per_label.mutual_information if pred.per_label is not None else None
            rows[f"glm-{link}"] = {
                "probs": pred.probs.double().numpy(),
                "mean": pred.logit_mean.double().numpy(),
                "var": pred.logit_var.double().numpy(),
                "mi": None if mi is None else mi.double().numpy(),
                "log_odds": pred.per_label.log_odds.numpy(),
            }
        out[name] = rows
    return out


# -- the independent recomputation -----------------------------------------------------------------


def ece_by_loop(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Binary reliability ECE of one label: right-closed equal-width bins, 0 in the first."""
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = (p > lo) & (p <= hi) if b else (p >= 0) & (p <= hi)
        if inside.any():
            total += inside.sum() / len(p) * abs(y[inside].mean() - p[inside].mean())
    return total


def expected_summary(p: np.ndarray, y: np.ndarray, s: np.ndarray | None = None) -> dict:
    """The multi-label block of ``p [N, K]``; its NLL ``log(1 + e^{∓s})`` from the log-odds ``s``
    when the method has them (MAP's logits, the none/probit links), else from ``p`` (floored at
    the smallest positive float64, which these sets never reach)."""
    pred = (p >= 0.5).astype(int)
    if s is None:
        nll = -np.log(np.clip(np.where(y == 1, p, 1 - p), np.finfo(np.float64).tiny, None)).mean(0)
    else:
        nll = np.logaddexp(0, np.where(y == 1, -s, s)).mean(0)
    brier = ((p - y) ** 2).mean(0)
    ece = np.array([ece_by_loop(p[:, k], y[:, k]) for k in range(y.shape[1])])
    ap = [skm.average_precision_score(y[:, k], p[:, k]) if y[:, k].any() else None for k in range(y.shape[1])]
    entropy = -(xlogy(p, p) + xlogy(1 - p, 1 - p))
    return {
        "map": np.mean([a for a in ap if a is not None]),
        "micro_f1": skm.f1_score(y, pred, average="micro", zero_division=0),
        "macro_f1": skm.f1_score(y, pred, average="macro", zero_division=0),
        "hamming_loss": skm.hamming_loss(y, pred),
        "subset_accuracy": skm.accuracy_score(y, pred),
        "nll": nll.mean(),
        "brier": brier.mean(),
        "ece": ece.mean(),
        "mean_entropy": entropy.mean(),
        "per_label": {
            "positives": y.sum(0),
            "average_precision": ap,
            "f1": skm.f1_score(y, pred, average=None, zero_division=0),
            "nll": nll,
            "brier": brier,
            "ece": ece,
        },
    }


def expected_selective(p: np.ndarray, y: np.ndarray) -> dict:
    conf = np.maximum(p, 1 - p).mean(1)
    order = np.argsort(-conf, kind="stable")
    wrong = ((p >= 0.5) != (y == 1))[order]
    n = len(p)
    out = {}
    for c in (50, 80, 90):
        m = max(1, math.ceil(c / 100 * n))
        out[f"subset_accuracy_at_{c}"] = (~wrong[:m].any(1)).mean()
        out[f"hamming_loss_at_{c}"] = wrong[:m].mean()
    out["aurc_hamming"] = np.mean([wrong[:m].mean() for m in range(1, n + 1)])
    out["aurc_subset"] = np.mean([1 - (~wrong[:m].any(1)).mean() for m in range(1, n + 1)])
    return out


def softplus(f: np.ndarray) -> np.ndarray:
    return np.logaddexp(0, f)


def own_logit(name: str, row: dict) -> np.ndarray | None:
    """The method's own log-odds ``[N, K]`` where its probabilities are their sigmoid."""
    if name == "map":
        return row["logits"].numpy()
    if name == "glm-none":
        return row["mean"]
    if name == "glm-probit":
        return row["mean"] / np.sqrt(1 + np.pi * row["var"] / 8)
    return row["log_odds"]  # mc, beta: predict's own (tests/test_exact_scores.py checks them)


def expected_scores(name: str, row: dict) -> dict:
    """Each multi-label OOD score (higher = in-distribution) from its definition."""
    p = row["probs"]
    entropy = -(xlogy(p, p) + xlogy(1 - p, 1 - p)).sum(1)
    energy = softplus(own_logit(name, row)).sum(1)
    out = {"max_sigmoid": p.max(1), "neg_total_entropy": -entropy, "joint_energy": energy}
    if row.get("mi") is not None:
        out["neg_mi_sum"] = -row["mi"].sum(1)
        out["neg_mi_max"] = -row["mi"].max(1)
    return out


def expected_detection(s_in: np.ndarray, s_out: np.ndarray) -> dict:
    s = np.concatenate([s_in, s_out])
    truth = np.concatenate([np.ones(len(s_in)), np.zeros(len(s_out))])
    fpr, tpr, _ = skm.roc_curve(truth, s, drop_intermediate=False)
    return {
        "auroc": skm.roc_auc_score(truth, s),
        "aupr_in": skm.average_precision_score(truth, s),
        "aupr_out": skm.average_precision_score(1 - truth, -s),
        "fpr95": fpr[np.argmax(tpr >= 0.95)],
    }


def check_block(got: dict, expected: dict, names: list[str], what: str) -> None:
    for key, value in expected.items():
        if key == "per_label":
            for metric, values in value.items():
                for name, v in zip(names, values, strict=True):
                    cell = got["per_label"][metric][name]
                    if v is None:
                        assert cell is None, f"{what} per_label.{metric}.{name}"
                    else:
                        assert_close(cell, v, atol=TOL, what=f"{what} per_label.{metric}.{name}")
        else:
            assert_close(got[key], value, atol=TOL, what=f"{what} {key}")


# -- the tests ---------------------------------------------------------------------------------------


def test_in_distribution_blocks_equal_scikit_learn_on_the_predict_output(setup, predictions):
    res = setup["report"]["results"]["in_distribution"]
    names = list(res["map"]["per_label"]["ece"])
    assert names == [str(i) for i in range(10)] and list(res) == METHODS.split(",")
    y = predictions["y"]
    for name, row in predictions["test"].items():
        expected = expected_summary(row["probs"], y, own_logit(name, row)) | expected_selective(
            row["probs"], y
        )
        check_block(res[name], expected, names, name)
        assert set(res[name]) == set(expected)  # nothing unchecked
    # the posterior moves the probabilities: the blocks are not all MAP's
    assert res["glm-probit"]["nll"] < res["map"]["nll"]


def test_ood_scores_and_detection_metrics_equal_their_definitions(setup, predictions):
    cells = setup["report"]["results"]["ood"]["noise:uniform"]
    for name in METHODS.split(","):
        scores_in = expected_scores(name, predictions["test"][name])
        scores_out = expected_scores(name, predictions["ood"][name])
        expected_keys = set(scores_in) | ({"knn"} if name == "map" else set())
        assert set(cells[name]) - {"mean_max_sigmoid"} == expected_keys, name
        assert_close(cells[name]["mean_max_sigmoid"], scores_out["max_sigmoid"].mean(), atol=TOL,
                     what=f"{name} mean max sigmoid")  # fmt: skip
        for score, s_in in scores_in.items():
            for key, value in expected_detection(s_in, scores_out[score]).items():
                assert_close(cells[name][score][key], value, atol=TOL, what=f"{name} {score} {key}")


def test_shift_suites_report_per_label_metrics_of_the_shifted_inputs(setup, predictions):
    """Rotation by 45°, a corruption and FGSM on the summed binary cross-entropy, recomputed here
    (the MAP network's sigmoids on inputs rotated / corrupted / attacked independently)."""
    res = setup["report"]["results"]
    model, test, y = predictions["model"], predictions["data"], predictions["y"]
    names = [str(i) for i in range(10)]
    assert res["rotation"]["0"]["glm-beta"]["map"] == res["in_distribution"]["glm-beta"]["map"]
    rotated = extract_features(model, test.map_inputs(partial(rotate, angle=45.0)))
    p, s = torch.sigmoid(rotated.logits).double().numpy(), rotated.logits.double().numpy()
    check_block(res["rotation"]["45"]["map"], expected_summary(p, y, s), names, "rotation 45")
    # the corrupted inputs as the protocol seeds them (seed·1000 + severity, per batch)
    noisy = test.map_inputs(partial(corrupt, name="gaussian_noise", severity=2), seed=2)
    z = extract_features(model, noisy).logits
    p, s = torch.sigmoid(z).double().numpy(), z.double().numpy()
    check_block(
        res["corruption"]["gaussian_noise"]["2"]["map"], expected_summary(p, y, s), names, "corruption"
    )

    # per batch of 256 as the runner streams them: the sign of a near-zero gradient depends on
    # the summation order, and one flipped pixel moves a probability by far more than rounding
    clf = model.classifier.eval()
    attacked = []
    for xb, yb in test.batches(256):
        xb = xb.clone().requires_grad_(True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(clf(xb), yb.to(xb.dtype), reduction="sum")
        (grad,) = torch.autograd.grad(loss, xb)
        attacked.append((xb + EPS * grad.sign()).clamp(0, 1).detach())
    with torch.no_grad():
        z = clf(torch.cat(attacked))
    p, s = torch.sigmoid(z).double().numpy(), z.double().numpy()
    got = res["fgsm"][str(EPS)]["map"]
    check_block(got, expected_summary(p, y, s), names, "fgsm")
    assert got["map"] < res["fgsm"]["0"]["map"]["map"] - 0.1  # the attack works


def test_per_label_conformal_sets_cover_as_recomputed(setup, predictions):
    rows = setup["report"]["results"]["conformal"]
    y = predictions["y"]
    n = len(y)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).numpy()
    cal, ev = np.sort(perm[: n // 2]), np.sort(perm[n // 2 :])
    rank = math.ceil((len(cal) + 1) * (1 - ALPHA))
    for name, row in predictions["test"].items():
        p = row["probs"]
        got = rows[name]["lac"]
        coverage = []
        for k in range(y.shape[1]):
            score = np.where(y[cal, k] == 1, 1 - p[cal, k], p[cal, k])  # 1 − p(observed value)
            q = np.sort(score)[rank - 1]
            members = np.stack([p[ev, k] <= q, 1 - p[ev, k] <= q], 1)  # v = 0, 1
            hit = members[np.arange(len(ev)), y[ev, k]]
            assert_close(got["per_label"]["threshold"][str(k)], q, atol=1e-12, what=f"{name} q {k}")
            assert_close(got["per_label"]["coverage"][str(k)], hit.mean(), atol=TOL, what=f"{name} cov {k}")
            assert_close(got["per_label"]["mean_size"][str(k)], members.sum(1).mean(), atol=TOL, what="size")
            coverage.append(hit.mean())
        assert_close(got["coverage"], np.mean(coverage), atol=TOL, what=f"{name} mean coverage")
        assert_close(got["min_label_coverage"], min(coverage), atol=TOL, what=f"{name} min coverage")
        assert abs(np.mean(coverage) - (1 - ALPHA)) < 0.05  # marginal coverage ≈ 1 − α


def test_report_validates_and_gates_read_multilabel_paths(setup):
    report = setup["report"]
    schema = json.loads(files("bayescli").joinpath("schemas/report.schema.json").read_text())
    jsonschema.validate(report, schema)
    assert report["likelihood"] == "bernoulli" and "link_fidelity" not in report["results"]
    gates = {g["condition"]: g for g in report["gates"]}
    ml = report["results"]["in_distribution"]
    assert setup["code"] == 1
    assert gates["in_distribution.glm-probit.map < 0.5"] == {
        "condition": "in_distribution.glm-probit.map < 0.5", "value": ml["glm-probit"]["map"], "failed": False
    }  # fmt: skip
    cell = report["results"]["ood"]["noise:uniform"]["glm-probit"]["joint_energy"]["auroc"]
    assert gates["ood.noise:uniform.glm-probit.joint_energy.auroc > 0.5"]["value"] == cell
    assert gates["ood.noise:uniform.glm-probit.joint_energy.auroc > 0.5"]["failed"] is (cell > 0.5)
    per_label = gates["in_distribution.glm-beta.per_label.nll.3 > 10"]
    assert per_label["value"] == ml["glm-beta"]["per_label"]["nll"]["3"] and not per_label["failed"]
    # a broken block is rejected: the multi-label rows are checked, not waved through
    broken = json.loads(json.dumps(report))
    del broken["results"]["in_distribution"]["glm-mc"]["per_label"]["ece"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    html = render_html(report, figures(report))
    assert "In-distribution per label" in html and "Per-label conformal sets" in html
    assert set(figures(report)) == {"per_label", "rotation", "corruption", "fgsm", "ood_roc", "conformal"}


def test_cli_gates_exit_0_and_bad_paths_list_the_multilabel_ones(cli, setup):
    post = setup["post"]
    base = ("evaluate", "--posterior", post, "--data", "composed-digits:test", "--fidelity-inputs", "0")
    res = cli(
        *base, "--methods", "map,glm-probit", "--fail-if", "in_distribution.glm-probit.subset_accuracy < 0.3"
    )
    assert res.code == 0, res.err
    res = cli(
        *base, "--methods", "map,glm-probit", "--fail-if", "in_distribution.glm-probit.subset_accuracy > 0.3"
    )
    assert res.code == 1 and "gate failed: in_distribution.glm-probit.subset_accuracy > 0.3" in res.err
    line = one_error_line(
        cli(*base, "--ood", "noise:uniform", "--fail-if", "ood.noise:uniform.glm-probit.max_prob.auroc < 0.5")
    )
    assert (
        "--fail-if path 'ood.noise:uniform.glm-probit.max_prob.auroc' is not in what this evaluation" in line
    )
    # the listing starts with the paths nearest the unknown one: glm-probit's multi-label scores
    for score in ("max_sigmoid", "joint_energy", "neg_total_entropy"):
        assert f"ood.noise:uniform.glm-probit.{score}.auroc" in line, score
    assert "glm-probit.neg_mi_sum" not in line and "glm-bridge" not in line and "mmc" not in line
    line = one_error_line(
        cli(*base, "--ood", "noise:uniform", "--fail-if", "ood.noise:uniform.glm-beta.mi < 1")
    )
    assert (
        "ood.noise:uniform.glm-beta.neg_mi_sum.auroc" in line
        and "ood.noise:uniform.glm-beta.neg_mi_max" in line
    )
    line = one_error_line(cli(*base, "--ood", "noise:uniform", "--fail-if", "ood.noise:uniform.map.k < 1"))
    assert "ood.noise:uniform.map.knn.auroc" in line
    line = one_error_line(cli(*base, "--fail-if", "in_distribution.map.accuracy < 0.5"))
    for key in ("map", "hamming_loss", "subset_accuracy_at_90", "aurc_hamming", "per_label.*"):
        assert f"in_distribution.map.{key}" in line, key


def test_refusals_are_one_line(cli, setup, tmp_path):
    post = setup["post"]
    base = ("evaluate", "--posterior", post, "--data", "composed-digits:test")
    assert one_error_line(cli(*base, "--methods", "map,temp")) == (
        "error: method 'temp' (softmax temperature scaling) has no multi-label form; multi-label "
        "(bernoulli) posteriors take map and glm-LINK with LINK in none, probit, mc, beta"
    )
    assert "method 'glm-bridge' is a softmax method" in one_error_line(cli(*base, "--methods", "glm-bridge"))
    assert "method 'bnn-mc' is a softmax method" in one_error_line(cli(*base, "--methods", "bnn-mc"))
    assert one_error_line(cli(*base, "--ood", "patches", "--ood-scores", "max-sigmoid,mahalanobis")) == (
        "error: OOD score 'mahalanobis' assumes a softmax classifier; multi-label (bernoulli) posteriors "
        "take max-sigmoid, total-entropy, joint-energy, mi-sum, mi-max, knn"
    )
    # a multi-label score for a softmax posterior (a file that is not there reads as softmax)
    missing = tmp_path / "none.safetensors"
    line = one_error_line(cli("evaluate", "--posterior", missing, "--data", "digits:test", "--ood", "patches",
                              "--ood-scores", "msp,joint-energy"))  # fmt: skip
    assert line.startswith("error: OOD score 'joint-energy' is for multi-label (bernoulli) posteriors")
    # the same posterior file claiming the softmax likelihood: one checkpoint, two likelihoods
    tensors, meta = load_tensors(post)
    other = tmp_path / "soft.safetensors"
    save_tensors(other, tensors, {**meta, "likelihood": "categorical"})
    both = ("evaluate", "--posterior", post, "--posterior", other, "--data", "composed-digits:test")
    assert one_error_line(cli(*both)) == (
        "error: the posteriors mix likelihoods (post: bernoulli, soft: categorical); evaluate softmax "
        "and multi-label posteriors in separate calls"
    )  # fmt: skip
    line = one_error_line(cli("evaluate", "--posterior", other, "--data", "composed-digits:test"))
    assert line.startswith("error: posterior soft is for a categorical classifier but ") and line.endswith(
        "multi.safetensors is bernoulli; evaluate a posterior with the checkpoint it was fitted on"
    )
    line = one_error_line(
        cli("conformal", "--posterior", post, "--data", "composed-digits:test", "--score", "aps")
    )
    assert line == (
        "error: score 'aps' ranks classes of one label; multi-label (bernoulli) posteriors take score lac "
        "(per-label sets)"
    )


def test_conformal_command_writes_per_label_sets(cli, setup, predictions, tmp_path):
    out = tmp_path / "sets.json"
    res = cli("conformal", "--posterior", setup["post"], "--data", "composed-digits:test", "--method",
              "glm-probit", "--alpha", ALPHA, "--out", out, "--quiet", "--device", "cpu")  # fmt: skip
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    post, model = predictions["post"], predictions["model"]
    cal = load_data("composed-digits:val", preprocess=model.preprocess)
    p_cal = predict(post, extract_features(model, cal), link="probit").probs.double().numpy()
    p = predictions["test"]["glm-probit"]["probs"]
    y, y_cal = predictions["y"], cal.y.numpy()
    rank = math.ceil((len(y_cal) + 1) * (1 - ALPHA))
    summary = report["summary"]
    for k in range(10):
        q = np.sort(np.where(y_cal[:, k] == 1, 1 - p_cal[:, k], p_cal[:, k]))[rank - 1]
        members = np.stack([p[:, k] <= q, 1 - p[:, k] <= q], 1)
        hit = members[np.arange(len(y)), y[:, k]]
        assert_close(summary["per_label"]["coverage"][str(k)], hit.mean(), atol=TOL, what=f"coverage {k}")
        expected_sets = [[v for v in (0, 1) if members[i, v]] for i in range(len(y))]
        assert [row["sets"][str(k)] for row in report["sets"]] == expected_sets
    assert report["likelihood"] == "bernoulli" and report["score"] == "lac"
    assert report["sets"][0]["label"] == y[0].tolist()
