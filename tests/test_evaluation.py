import json

import numpy as np
import pytest
import torch
from tolerance import assert_below, assert_close

from bayescli.data import ArrayData, load_data
from bayescli.data.shifts import rotate, synthetic_ood
from bayescli.errors import BayescliError
from bayescli.evaluation.attacks import fgsm, parse_epsilons
from bayescli.evaluation.gates import check_gates, parse_gate, resolve
from bayescli.evaluation.methods import parse_methods
from bayescli.metrics.classification import ece, ood_metrics, reliability, selective
from bayescli.models.specs import load_classifier
from bayescli.posterior.selection import Selection


def test_ece_on_constructed_example():
    # two bins used: conf 0.95 (4 inputs, 3 right) and conf 0.55 (2 inputs, 2 right)
    probs = torch.tensor([[0.95, 0.05]] * 4 + [[0.55, 0.45]] * 2, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 0, 0])
    expected = 4 / 6 * abs(0.75 - 0.95) + 2 / 6 * abs(1.0 - 0.55)
    # float64 sums of six terms: rounding ≈ 1e-16
    assert_close(ece(probs, y), expected, rtol=1e-12, what="ece, constructed example")
    rel = reliability(probs, y)
    assert sum(rel["count"]) == 6 and rel["accuracy"][14] == 3 / 4


def test_ece_bins_are_right_closed_with_one_in_last_bin():
    probs = torch.tensor([[1.0, 0.0], [0.75, 0.25], [0.5, 0.5]])  # exact edges with 4 bins
    rel = reliability(probs, torch.tensor([0, 0, 0]), bins=4)
    assert rel["count"] == [0.0, 1.0, 1.0, 1.0]  # 0.5 ∈ (0.25, 0.5], 0.75 ∈ (0.5, 0.75], 1 ∈ last


def test_ood_fpr95_on_known_roc():
    # hand-made ROC: in = 1..20, out = 0.5, 1.5, …: the 95% TPR threshold (19 of 20 in) is 2.
    # AUROC/AUPR against pair counting: tests/test_metrics.py
    known_in, known_out = torch.arange(1.0, 21.0), torch.tensor([0.5, 1.5, 2.5, 3.5])
    assert ood_metrics(known_in, known_out)["fpr95"] == 2 / 4


def test_selective_prediction_and_aurc():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    y = torch.tensor([0, 1, 0, 1])  # right, wrong, right, wrong by confidence
    out = selective(probs, y, (0.5, 1.0))
    assert out["accuracy_at_50"] == 0.5 and out["accuracy_at_100"] == 0.5
    assert_close(out["aurc"], np.mean([0, 0.5, 1 / 3, 0.5]), rtol=1e-12, what="aurc")  # float64, 4 terms


def test_rotation_by_0_and_360_is_identity_and_90_is_rot90():
    x = torch.rand(3, 1, 9, 9)
    assert torch.equal(rotate(x, 0), x) and torch.equal(rotate(x, 360), x)
    # bilinear sampling exactly on pixel centres: only float32 rounding of the sampling grid
    # (≲ 1e-6 px on 9 px) times pixel differences ≤ 1 remains
    assert_close(rotate(x, 90), torch.rot90(x, 1, (2, 3)), atol=1e-5, what="rotation by 90°")


def test_synthetic_ood_takes_reference_shape():
    ref = load_data("digits:test", limit=50)
    for spec in ("noise:uniform", "noise:gaussian", "patches"):
        x = synthetic_ood(spec, ref, 20, seed=0).inputs(slice(None))
        assert x.shape == (20, 1, 8, 8) and x.min() >= 0 and x.max() <= 1
    rgb = ArrayData(torch.rand(5, 3, 32, 32), None, ["a"], {"spec": "r"})
    assert synthetic_ood("patches", rgb, 4).inputs(slice(None)).shape == (4, 3, 32, 32)


def test_fgsm_identity_at_zero_and_raises_loss(digits_ckpt):
    clf = load_classifier("builtin:small-cnn", digits_ckpt).classifier
    data = load_data("digits:test", limit=100)
    x, y = data.inputs(slice(None)), data.y
    assert torch.equal(fgsm(clf, x, y, 0.0), x)
    loss = torch.nn.functional.cross_entropy
    with torch.no_grad():
        base = loss(clf(x), y).item()
        attacked = fgsm(clf, x, y, 8 / 255)
        assert loss(clf(attacked), y).item() > base
        # float32 x + ε then x' − x: two roundings of values ≤ 1, ≤ 1.2e-7
        overshoot = ((attacked - x).abs() - 8 / 255).clamp_min(0)
        assert_below(overshoot, 1e-6, what="FGSM stays within the epsilon ball")
        assert attacked.min() >= 0 and attacked.max() <= 1
    assert parse_epsilons("0,2/255,0.5")[1] == ("2/255", 2 / 255)
    with pytest.raises(BayescliError):
        parse_epsilons("3/0")


def test_methods_and_gates():
    assert [m.name for m in parse_methods("map,glm-probit,bnn-mc")] == ["map", "glm-probit", "bnn-mc"]
    with pytest.raises(BayescliError, match="unknown method"):
        parse_methods("glm-magic")
    results = {"fgsm": {"0.03": {"map": {"accuracy": 0.5}}}, "ood": {"noise:uniform": {"map": {"mmc": 0.7}}}}
    assert resolve(results, "fgsm.0.03.map.accuracy") == 0.5
    out = check_gates(
        results, [parse_gate("fgsm.0.03.map.accuracy < 0.6"), parse_gate("ood.noise:uniform.map.mmc >= 0.9")]
    )
    assert [o["failed"] for o in out] == [True, False]
    with pytest.raises(BayescliError, match="valid paths"):
        check_gates(results, [parse_gate("ood.svhn.map.mmc < 1")])
    with pytest.raises(BayescliError, match="malformed"):
        parse_gate("accuracy is low")


@pytest.fixture(scope="module")
def marglik_posterior(digits_ckpt, tmp_path_factory):
    """A last-layer kron posterior with the marginal-likelihood δ: the GGP's refined mode needs a
    prior that lets the GP fit (held-out selection may pick δ → ∞, where f → the prior mean 0)."""
    from bayescli.cli.app import main

    path = tmp_path_factory.mktemp("marglik") / "post.safetensors"
    args = ["fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", str(digits_ckpt)]
    try:
        main([*args, "--data", "digits:train", "--prior-precision", "auto", "--out", str(path), "-q"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    return path


def test_evaluate_cli_report_schema_gates_and_html(cli, marglik_posterior, tmp_path):
    from importlib.resources import files

    import jsonschema

    out, html = tmp_path / "report.json", tmp_path / "report.html"
    args = [
        "evaluate",
        "--posterior",
        marglik_posterior,
        "--data",
        "digits:test",
        "--limit",
        "120",
        "--methods",
        "map,glm-probit,glm-bridge,glm-mc,ggp-probit",
        "--samples",
        "100",
        "--ggp-points",
        "200",
        "--ood",
        "noise:uniform",
        "--ood",
        "patches",
        "--ood-limit",
        "60",
        "--rotation",
        "0:90:45",
        "--corruption",
        "gaussian_noise,fog",
        "--severity",
        "1,5",
        "--fgsm",
        "0,8/255",
        "--out",
        out,
        "--html",
        html,
    ]
    res = cli(*args, "--fail-if", "in_distribution.map.accuracy < 0.5")
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    schema = json.loads(files("bayescli").joinpath("schemas/report.schema.json").read_text())
    jsonschema.validate(report, schema)
    r = report["results"]
    assert set(r) == {"in_distribution", "ood", "rotation", "corruption", "fgsm", "link_fidelity"}
    assert "neg_mutual_information" in r["ood"]["patches"]["glm-bridge"]
    assert "neg_mutual_information" in r["ood"]["patches"]["glm-mc"]
    assert "alpha0" in r["ood"]["patches"]["glm-bridge"]
    assert report["protocol"]["ggp"]["points"] == 200 and r["in_distribution"]["ggp-probit"]["accuracy"] > 0.8
    assert r["rotation"]["0"]["map"]["accuracy"] == r["in_distribution"]["map"]["accuracy"]
    assert r["fgsm"]["0"]["map"]["accuracy"] == r["in_distribution"]["map"]["accuracy"]
    assert r["fgsm"]["8/255"]["map"]["nll"] > r["fgsm"]["0"]["map"]["nll"]
    assert report["protocol"]["corruption"]["source"] == "generated (approximation)"
    assert report["gates"][0]["failed"] is False
    assert html.read_text().count("data:image/png;base64") >= 4
    # the same gate the other way round fails the run with exit 1 and names the condition
    res = cli(*args, "--fail-if", "in_distribution.map.accuracy > 0.5")
    assert res.code == 1 and "in_distribution.map.accuracy > 0.5" in res.err
    res = cli(*args[:5], "--fail-if", "results.nowhere < 1")
    assert res.code == 2 and "valid paths" in res.err
    res = cli("report", out, "--png-dir", tmp_path / "png")
    assert res.code == 0 and (tmp_path / "png" / "ood_roc.png").exists()


def test_schema_validates_demo_report(cli, tmp_path):
    from importlib.resources import files

    import jsonschema

    assert cli("demo", "--out-dir", tmp_path, "--quiet").code == 0
    schema = json.loads(files("bayescli").joinpath("schemas/report.schema.json").read_text())
    jsonschema.validate(json.loads((tmp_path / "report.json").read_text()), schema)
    assert (tmp_path / "report.html").stat().st_size > 10_000


def _scored_problem():
    """A full last-layer posterior (D = 5, K = 3, no bias), in-distribution features from the
    training distribution and OOD features far out along directions where all logits are equal
    (flat mean, large variance: the case every uncertainty score must rank as OOD)."""
    from conftest import random_head

    from bayescli.models.features import Features
    from bayescli.posterior import LaplacePosterior

    d, k = 5, 3
    gen = torch.Generator().manual_seed(0)
    head = random_head(d, k)
    with torch.no_grad():
        head.bias.zero_()
    phi = torch.randn(300, d, generator=gen, dtype=torch.float64)
    post = LaplacePosterior.fit_last_layer(phi, head(phi).detach().argmax(1), head, "full")
    post.set_prior_precision(1.0)
    centred = head.weight.detach() - head.weight.detach().mean(0)
    null = torch.linalg.svd(centred).Vh[k - 1 :]  # W v ∝ 1 for v in this span
    phi_in = torch.randn(80, d, generator=gen, dtype=torch.float64)
    phi_out = 30 * torch.randn(80, null.shape[0], generator=gen, dtype=torch.float64) @ null
    feats = [Features(p, head(p).detach(), None) for p in (phi_in, phi_out)]
    return post, head, feats


def _dense_logit_cov(post, head, phi: torch.Tensor) -> torch.Tensor:
    from oracles import explicit_jacobian_head

    from bayescli.posterior.gaussian import augment

    g = post.gaussian
    sigma = torch.linalg.inv(g.H + g.delta * torch.eye(g.H.shape[0], dtype=torch.float64))
    jac = explicit_jacobian_head(augment(phi), head.out_features)
    return jac @ sigma @ jac.mT


def _oracle_alpha(mu: torch.Tensor, cov: torch.Tensor) -> np.ndarray:
    """Zero-sum correction in matrix form, then eq. 7 (default bridge)."""
    from oracles import eq7

    one = torch.ones(mu.shape[-1], 1, dtype=torch.float64)
    s1 = cov @ one
    total = (one.T @ cov @ one).squeeze(-1)
    mu_c = mu - s1.squeeze(-1) * mu.sum(-1, keepdim=True) / total
    cov_c = cov - s1 @ s1.mT / total[..., None]
    return eq7(mu_c, cov_c.diagonal(dim1=1, dim2=2)).numpy()


def test_ood_scores_equal_their_definitions_and_rank_ood_lower():
    from scipy.special import digamma

    from bayescli.evaluation.methods import run_method

    post, head, feats = _scored_problem()
    methods = {m.name: m for m in parse_methods("map,glm-bridge,glm-mc")}
    for where, f in zip(("in", "out"), feats, strict=True):
        mu, cov = f.logits, _dense_logit_cov(post, head, f.phi)
        alpha = _oracle_alpha(mu, cov)
        a0 = alpha.sum(1)
        p = alpha / a0[:, None]
        mi = -(p * np.log(p)).sum(1) - (digamma(a0 + 1) - (p * digamma(alpha + 1)).sum(1))
        out = run_method(methods["glm-bridge"], post, f, None, None, 100, 0)
        # float64 throughout; κ(H + δI) ≤ 1e4 here, so 1e-8 relative is ≥ 1000× the rounding
        assert_close(out.scores["alpha0"], a0, rtol=1e-8, what=f"alpha0 = Σα ({where})")
        assert_close(out.scores["neg_mutual_information"], -mi, rtol=1e-8, atol=1e-12, what=f"-MI ({where})")
        probs = out.probs.double().numpy()
        # max_prob is ranked as the top class's log-odds log p_max − log Σ_{j≠max} p_j (exact where
        # p_max saturates); float64 probabilities of order 1: 1e-9 absolute is ≥ 1000× the rounding
        top = probs.max(1)
        rest = np.sort(probs, axis=1)[:, :-1].sum(1)
        assert_close(
            out.scores["max_prob"],
            np.log(top) - np.log(rest),
            rtol=1e-9,
            atol=1e-9,
            what=f"max_prob ({where})",
        )
        neg_h = (probs * np.log(probs)).sum(1)
        assert_close(out.scores["neg_entropy"], neg_h, rtol=1e-12, atol=1e-15, what=f"-H ({where})")
    scores = [run_method(methods["glm-bridge"], post, f, None, None, 100, 0).scores for f in feats]
    for name in ("alpha0", "neg_mutual_information", "max_prob", "neg_entropy"):
        assert ood_metrics(scores[0][name], scores[1][name])["auroc"] > 0.9, name


def test_mc_mutual_information_score_against_independent_sampling():
    from bayescli.evaluation.methods import run_method

    post, head, feats = _scored_problem()
    method = parse_methods("glm-mc")[0]
    f = type(feats[1])(feats[1].phi[:6], feats[1].logits[:6], None)
    ours = -run_method(method, post, f, None, None, 20_000, 0).scores["neg_mutual_information"]
    cov = _dense_logit_cov(post, head, f.phi).numpy()
    rng = np.random.default_rng(0)
    for i in range(len(f)):
        z = rng.multivariate_normal(f.logits[i].numpy(), cov[i], size=100_000)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        log_p = np.log(np.clip(p, 1e-300, None))
        # H[p̄] − mean H[p_s] = mean_s c_s with c_s = −Σ_k p_sk log p̄_k + Σ_k p_sk log p_sk, so the
        # estimate is a sample mean; its standard error (ours used 20,000 draws, this 10⁵) is
        # std(c)·√(1/20,000 + 1/10⁵)
        c = -(p * np.log(p.mean(0))).sum(1) + (p * log_p).sum(1)
        mi, se = c.mean(), c.std() * np.sqrt(1 / 20_000 + 1 / 100_000)
        assert_close(ours[i], mi, atol=6 * se, what="MC mutual information vs own sampling (6 SE)")


def test_parse_baseline_and_bridge_variant_methods():
    from bayescli.options import BridgeCorrection

    methods = {m.name: m for m in parse_methods("map,temp,glm-bridge,glm-bridge-norm,glm-bridge-none")}
    assert methods["temp"].predictive is None
    assert methods["glm-bridge"].correction is BridgeCorrection.ZERO_SUM
    assert methods["glm-bridge-norm"].correction is BridgeCorrection.NORM
    assert methods["glm-bridge-none"].correction is BridgeCorrection.NONE
    with pytest.raises(BayescliError, match="unknown method"):
        parse_methods("glm-bridge-magic")


def _schema_leaf(schema: dict, node: dict, path: list[str]) -> dict | None:
    """The sub-schema that describes ``path`` (None if the schema does not name it)."""
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].split("/")[-1]]
    if not path:
        # a nullable number (e.g. an undefined link fidelity) is described by its number branch
        numbers = [p for p in node.get("anyOf", []) if p.get("type") in ("number", "integer")]
        return numbers[0] if numbers else node
    for part in node.get("allOf", []) + node.get("anyOf", []):
        found = _schema_leaf(schema, part, path)
        if found is not None and found.get("type") in ("number", "integer"):
            return found
    if path[0] in node.get("properties", {}):
        return _schema_leaf(schema, node["properties"][path[0]], path[1:])
    if isinstance(node.get("additionalProperties"), dict):
        return _schema_leaf(schema, node["additionalProperties"], path[1:])
    return None


def _number_paths(tree: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _number_paths(value, (*prefix, key))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append((*prefix, key))
    return out


def test_evaluate_baselines_report_schema_and_gates(cli, digits_posterior, tmp_path):
    from importlib.resources import files

    import jsonschema

    out = tmp_path / "report.json"
    args = [
        "evaluate", "--posterior", digits_posterior, "--data", "digits:test", "--limit", "160",
        "--methods", "map,temp,glm-probit,glm-bridge-norm", "--ood", "patches", "--ood-limit", "80",
        "--ood-scores", "msp,entropy,alpha0,mi,maxlogit,energy,mahalanobis,rel-mahalanobis,knn,vim,react,"
        "odin",
        "--conformal", "0.2", "--fidelity-inputs", "64", "--out", out, "--html", tmp_path / "r.html",
    ]  # fmt: skip
    gates = [
        "conformal.temp.raps.coverage < 0.3",
        "conformal.map.lac.topk_same_size.coverage < 0.3",
        "ood.patches.map.knn.auroc < 0.5",
        "ood.patches.temp.energy.fpr95 > 0.99",
        "link_fidelity.bridge-norm.kl_mean > 100",
        "in_distribution.temp.adaptive_ece > 0.5",
    ]
    res = cli(*args, *[a for g in gates for a in ("--fail-if", g)])
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    schema = json.loads(files("bayescli").joinpath("schemas/report.schema.json").read_text())
    jsonschema.validate(report, schema)
    assert not any(g["failed"] for g in report["gates"])
    # every --fail-if path of the report is described by the schema as a number, and is one that
    # the up-front check (before any work) accepts for these options
    from bayescli.evaluation.config import parse_ood_scores
    from bayescli.evaluation.gates import Gate, check_paths, expected_results

    methods = ["map", "temp", "glm-probit", "glm-bridge-norm"]
    scores = parse_ood_scores(
        "msp,entropy,alpha0,mi,maxlogit,energy,mahalanobis,rel-mahalanobis,knn,vim,react,odin"
    )
    expected = expected_results(methods, ["patches"], scores, conformal=True, fidelity=True)
    for path in _number_paths(report["results"]):
        leaf = _schema_leaf(schema, schema["properties"]["results"], list(path))
        assert leaf is not None and leaf.get("type") in ("number", "integer"), path
        check_paths([Gate("", ".".join(path), "<", 0.0)], expected)
    r, proto = report["results"], report["protocol"]
    assert set(r["ood"]["patches"]["map"]) - {"mmc"} == {
        "max_prob", "neg_entropy", "max_logit", "energy", "mahalanobis", "rel_mahalanobis", "knn", "vim",
        "react", "odin",
    }  # fmt: skip
    assert set(r["ood"]["patches"]["temp"]) == {"mmc", "max_prob", "neg_entropy", "max_logit", "energy"}
    assert "neg_mutual_information" in r["ood"]["patches"]["glm-bridge-norm"]
    assert proto["ood"]["fit_data"]["spec"] == "digits:train"
    assert proto["ood"]["detectors"]["knn"]["fit_points"] == len(load_data("digits:train"))
    assert proto["temperature"]["data"]["spec"] == "digits:val" and proto["temperature"]["temperature"] > 0
    assert r["in_distribution"]["temp"]["nll"] != r["in_distribution"]["map"]["nll"]
    # temperature scaling never moves an argmax; every method carries the share that moved
    assert r["in_distribution"]["temp"]["argmax_changed_fraction"] == 0.0
    assert all(0 <= row["argmax_changed_fraction"] <= 1 for row in r["in_distribution"].values())
    lac = r["conformal"]["map"]["lac"]  # coverage on 80 test points, with its binomial interval
    assert lac["coverage_ci"][0] <= lac["coverage"] <= lac["coverage_ci"][1]
    assert lac["coverage_ci"][1] - lac["coverage_ci"][0] > 0.05
    assert proto["conformal"]["calibration_points"] == 80 and set(r["conformal"]["map"]) == {
        "lac", "aps", "aps-random", "raps",
    }  # fmt: skip
    assert {"probit", "sodpp", "bridge", "bridge-none", "bridge-norm", "map", "mc"} == set(r["link_fidelity"])
    assert "timings" in report and report["timings"]["score.odin"] > 0
    # the failing direction exits 1
    assert cli(*args, "--fail-if", "conformal.map.lac.coverage > 0.3").code == 1


def test_detectors_are_fitted_on_the_fitting_data_only(digits_posterior):
    """The report's detector AUROCs equal those of detectors fitted directly on the posterior's
    fitting data (digits:train) and applied to the test and OOD features: nothing is fitted on
    the scored sets, OOD or not."""
    from bayescli.evaluation import detectors as det
    from bayescli.evaluation.config import BaselineConfig, EvalConfig, parse_ood_scores
    from bayescli.evaluation.runner import load_ood, run_evaluation
    from bayescli.models.features import extract_features
    from bayescli.posterior.base import load_posterior

    post = load_posterior(digits_posterior)
    model = post.load_model()
    test = load_data("digits:test", limit=80)
    cfg = EvalConfig(
        methods=parse_methods("map"),
        ood=["patches"],
        ood_limit=40,
        baselines=BaselineConfig(
            ood_scores=parse_ood_scores("mahalanobis,rel-mahalanobis,knn,vim,react"), fidelity_inputs=0
        ),
    )
    report = run_evaluation({"post": post}, model, test, cfg)["results"]["ood"]["patches"]["map"]
    fit = extract_features(model, load_data("digits:train"))
    head = model.classifier.head
    w, b = head.weight.detach(), head.bias.detach()
    k = model.classifier.num_classes
    direct = {
        "mahalanobis": det.Mahalanobis.fit(fit.phi, fit.labels, k),
        "rel_mahalanobis": det.RelativeMahalanobis.fit(fit.phi, fit.labels, k),
        "knn": det.KNN.fit(fit.phi, 10, 10_000),
        "vim": det.ViM.fit(fit.phi, w, b),
        "react": det.ReAct.fit(fit.phi, w, b),
    }
    phi_in = extract_features(model, test).phi
    phi_out = extract_features(model, load_ood("patches", test, cfg)).phi
    for name, d in direct.items():
        expected = ood_metrics(d.score(phi_in), d.score(phi_out))["auroc"]
        assert_close(report[name]["auroc"], expected, atol=1e-12, what=f"{name} fitted on digits:train")


def test_fail_if_paths_are_checked_before_any_work(cli, tmp_path):
    """An unknown --fail-if path exits 2 before any posterior is read (here: one that does not
    exist), listing the paths the requested evaluation will write."""
    missing = tmp_path / "nowhere.safetensors"
    res = cli(
        "evaluate", "--posterior", missing, "--data", "digits:test", "--ood", "patches",
        "--methods", "map,glm-probit", "--fail-if", "ood.patches.glm-probit.knn.auroc < 0.5",
    )  # fmt: skip
    assert res.code == 2 and "--fail-if path 'ood.patches.glm-probit.knn.auroc'" in res.err
    assert "ood.patches.glm-probit.max_prob.auroc" in res.err and "nowhere" not in res.err
    # a suite that was not requested
    res = cli(
        "evaluate", "--posterior", missing, "--data", "digits:test", "--fail-if", "rotation.45.map.nll > 1"
    )
    assert res.code == 2 and "valid paths" in res.err
    # a valid path gets past the check (and then fails on the missing file)
    res = cli(
        "evaluate", "--posterior", missing, "--data", "digits:test", "--rotation", "0:90:45",
        "--fail-if", "rotation.45.map.nll > 1",
    )  # fmt: skip
    assert res.code == 2 and "--fail-if" not in res.err and "nowhere" in res.err


def test_a_detector_that_cannot_be_fitted_leaves_an_empty_cell(cli, digits_posterior, tmp_path, monkeypatch):
    """Mahalanobis fitted on constant features (a singular covariance even with the ridge): the
    report still comes out (exit 0), its mahalanobis cells are null with one warning, the other
    scores are reported, the report validates, and a gate on the empty cell fails."""
    from importlib.resources import files

    import jsonschema

    from bayescli.evaluation import detectors as det

    fit = det.Mahalanobis.fit.__func__
    monkeypatch.setattr(
        det.Mahalanobis,
        "fit",
        classmethod(lambda cls, phi, labels, k, ridge=1e-6: fit(cls, torch.ones_like(phi), labels, k, ridge)),
    )
    out = tmp_path / "r.json"
    args = [
        "evaluate", "--posterior", digits_posterior, "--data", "digits:test", "--limit", "60",
        "--methods", "map", "--ood", "patches", "--ood-limit", "30", "--fidelity-inputs", "0",
        "--ood-scores", "msp,mahalanobis,knn", "--out", out,
    ]  # fmt: skip
    res = cli(*args)
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    jsonschema.validate(
        report, json.loads(files("bayescli").joinpath("schemas/report.schema.json").read_text())
    )
    cell = report["results"]["ood"]["patches"]["map"]
    assert cell["mahalanobis"] is None and cell["knn"]["auroc"] > 0 and cell["max_prob"]["auroc"] > 0
    # (besides any OOD line on saturated max probabilities, which this small net has on 2%)
    lines = [w for w in report["warnings"] if not w.startswith("OOD ")]
    assert len(lines) == 1 and "mahalanobis could not be fitted" in lines[0]
    assert res.err.count("mahalanobis could not be fitted") == 1
    assert "failed" in report["protocol"]["ood"]["detectors"]["mahalanobis"]
    res = cli(*args, "--fail-if", "ood.patches.map.mahalanobis.auroc < 0.5")
    assert res.code == 1 and "no value" in res.err


def _fit(cli, ckpt, out, *extra):
    res = cli(
        "fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", ckpt, "--data", "digits:train",
        "--out", out, "--quiet", *extra,
    )  # fmt: skip
    assert res.code == 0, res.err
    return out


def _numbers(tree, prefix=()):
    """``{path: number}`` for every number under ``tree``."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _numbers(sub, (*prefix, key)).items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _numbers(sub, (*prefix, i)).items()}
    return {prefix: tree} if isinstance(tree, float | int) and not isinstance(tree, bool) else {}


def test_each_posterior_is_evaluated_with_its_own_preprocessing(cli, digits_ckpt, tmp_path):
    """Two posteriors of one checkpoint fitted with different --mean/--std: evaluated together,
    each one's numbers equal those of evaluating it alone (its inputs normalised as when it was
    fitted), and the report records each one's preprocessing."""
    a = _fit(cli, digits_ckpt, tmp_path / "a.safetensors")
    b = _fit(cli, digits_ckpt, tmp_path / "b.safetensors", "--mean", "0.3", "--std", "0.5")
    common = [
        "--data", "digits:test", "--limit", "90", "--methods", "map,glm-probit,glm-bridge",
        "--ood", "patches", "--ood-limit", "40", "--ood-scores", "msp,mi", "--rotation", "90",
        "--conformal", "0.2", "--fidelity-inputs", "32",
    ]  # fmt: skip
    reports = {}
    for name, posts in {"both": [a, b], "a": [a], "b": [b]}.items():
        out = tmp_path / f"{name}.json"
        res = cli("evaluate", *[x for p in posts for x in ("--posterior", p)], *common, "--out", out)
        assert res.code == 0, res.err
        reports[name] = json.loads(out.read_text())
    both = reports["both"]
    assert both["posteriors"]["b"]["preprocess"]["mean"] == [0.3]
    assert both["posteriors"]["b"]["preprocess"]["std"] == [0.5]
    assert [g["posteriors"] for g in both["protocol"]["preprocessing"]] == [["a"], ["b"]]
    assert both["protocol"]["methods"] == [
        "map",
        "a/glm-probit",
        "b/glm-probit",
        "a/glm-bridge",
        "b/glm-bridge",
    ]  # as one run orders them
    together = _numbers(both["results"])
    compared = 0
    for tag in ("a", "b"):
        alone = _numbers(reports[tag]["results"])
        for path, value in alone.items():
            # the alone run's names gain the TAG/ prefix in the joint report (map: A's recipe)
            if path[0] == "link_fidelity":
                joint = (path[0], f"{tag}/{path[1]}", *path[2:])
            elif "map" in path:
                if tag == "b":
                    continue
                joint = path
            else:
                joint = tuple(f"{tag}/{p}" if p in ("glm-probit", "glm-bridge") else p for p in path)
            assert joint in together, joint
            assert abs(together[joint] - value) <= 1e-6 * max(1.0, abs(value)), (tag, path)
            compared += 1
    assert compared > 100
    # the two recipes really give different predictives
    nll = both["results"]["in_distribution"]
    assert abs(nll["a/glm-probit"]["nll"] - nll["b/glm-probit"]["nll"]) > 1e-4


def test_overlap_of_data_specs():
    from bayescli.evaluation.baselines import default_val_spec, overlaps

    train = load_data("digits:train").info
    assert not overlaps(train, load_data("digits:val").info)
    assert overlaps(train, load_data("digits:train[:50]").info)
    assert overlaps(train, {"spec": "digits:train"})
    assert not overlaps(train, {"spec": "mnist:val"})
    assert overlaps({**train, "split_seed": 3}, {"spec": "digits:val"})  # another partition
    part = load_data("digits:val[:50]").info
    assert not overlaps(part, {"spec": "digits:val[50:]"}) and overlaps(part, {"spec": "digits:val[40:60]"})
    whole = {"spec": "npz:x.npz", "split": "all"}
    assert overlaps(whole, {"spec": "npz:x.npz:val"}) and overlaps(whole, {"spec": "npz:x.npz:train"})
    assert not overlaps(None, {"spec": "digits:val"})
    # the default validation data: the val split, else a disjoint train split, else val (flagged)
    assert default_val_spec("digits:train", {"p": train}) == "digits:val"
    val = load_data("digits:val").info
    assert default_val_spec("digits:val", {"p": val}) == "digits:train"
    assert default_val_spec("digits:val", {"p": val, "q": train}) == "digits:val"
    assert default_val_spec("npz:x.npz", {"p": whole}) == "npz:x.npz:val"


def test_temperature_tuned_on_fitting_data_is_flagged(cli, digits_posterior, digits_ckpt, tmp_path):
    """``temp`` with T tuned on data overlapping the fitting data: a warning, a line under the
    table and ``overlaps_fitting_data`` in the protocol; with a disjoint default split, none."""
    common = ["--data", "digits:test", "--limit", "60", "--methods", "map,temp", "--fidelity-inputs", "0"]
    out = tmp_path / "r.json"
    res = cli("evaluate", "--posterior", digits_posterior, *common, "--out", out)
    assert res.code == 0, res.err
    proto = json.loads(out.read_text())["protocol"]["temperature"]
    assert proto["data"]["spec"] == "digits:val" and proto["overlaps_fitting_data"] == []
    assert "tuned on fitting data" not in res.out + res.err
    # --val-data the fitting data itself
    res = cli(
        "evaluate", "--posterior", digits_posterior, *common, "--val-data", "digits:train", "--out", out
    )
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    assert report["protocol"]["temperature"]["overlaps_fitting_data"] == ["post"]
    assert "T tuned on fitting data" in res.out
    assert any("temp: T was tuned on digits:train" in w for w in report["warnings"])
    assert "temp: T was tuned on digits:train" in res.err
    # a posterior fitted on digits:val: T by default on the disjoint digits:train, not flagged
    post = tmp_path / "val.safetensors"
    res = cli(
        "fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt, "--data", "digits:val",
        "--out", post, "--quiet",
    )  # fmt: skip
    assert res.code == 0, res.err
    res = cli("evaluate", "--posterior", post, *common, "--out", out)
    assert res.code == 0, res.err
    report = json.loads(out.read_text())
    assert report["protocol"]["temperature"]["data"]["spec"] == "digits:train"
    assert report["protocol"]["temperature"]["overlaps_fitting_data"] == []
    assert not any("tuned" in w for w in report["warnings"])


def test_a_method_that_changes_more_than_half_a_percent_of_argmaxes_is_flagged():
    """Issue 23: a link that moves decisions (probit: accuracy 0.8335 → 0.8245) is flagged once,
    with the per-method share of inputs whose class differs from MAP's; 0.5 % is the bar."""
    from bayescli.evaluation.methods import MethodOutput
    from bayescli.evaluation.runner import argmax_changes

    logits = torch.zeros(1000, 3)
    logits[:, 0] = 1.0
    moved = torch.zeros(1000, 3)
    moved[:, 0] = 1.0
    moved[:9, 1] = 2.0  # 9 of 1000 inputs change class
    few = torch.zeros(1000, 3)
    few[:, 0] = 1.0
    few[:5, 2] = 2.0  # 5 of 1000: exactly 0.5 %, not above it
    outs = {
        name: MethodOutput(x.softmax(-1), {}, {})
        for name, x in {"map": logits, "glm-probit": moved, "glm-bridge": few}.items()
    }
    rows = {name: {"accuracy": 0.8} for name in outs}
    lines = argmax_changes(rows, outs, logits)
    assert rows["map"]["argmax_changed_fraction"] == 0.0
    assert rows["glm-probit"]["argmax_changed_fraction"] == pytest.approx(0.009)
    assert rows["glm-bridge"]["argmax_changed_fraction"] == pytest.approx(0.005)
    assert len(lines) == 1 and lines[0].startswith("glm-probit changes the predicted class of 0.90%")


def test_a_near_zero_variance_bridge_posterior_is_explained():
    """Issue 23: glm-bridge with mean α₀ 3.1e15 and MI ≈ 0 gets a warning naming the cause (logit
    variance ≈ 0: δ very large, the posterior is the MAP) and δ; an ordinary one gets none."""
    from types import SimpleNamespace

    from bayescli.evaluation.methods import MethodOutput, expand_methods
    from bayescli.evaluation.runner import degenerate_posteriors
    from bayescli.metrics.classification import near_zero_variance_warning

    line = near_zero_variance_warning("glm-bridge", 3.1e15, 0.0, 1e8)
    assert "logit variance is near zero" in line and "δ = 1e+08" in line and "not chosen on held-out" in line
    assert near_zero_variance_warning("glm-bridge", 50.0, 1e-7) is not None  # MI alone vanishes
    assert near_zero_variance_warning("glm-bridge", float("inf"), None) is not None
    assert near_zero_variance_warning("glm-bridge", 50.0, 0.05, 1.0) is None

    methods = expand_methods(parse_methods("map,glm-bridge"), ["post"], False)
    n = 10

    def outs(alpha0: float, mi: float) -> dict:
        bridge = {"alpha0": torch.full((n,), alpha0), "neg_mutual_information": torch.full((n,), -mi)}
        return {
            "map": MethodOutput(torch.full((n, 2), 0.5), {}, {}),
            "glm-bridge": MethodOutput(torch.full((n, 2), 0.5), bridge, {}),
        }

    post = {"post": SimpleNamespace(summary=lambda: {"prior_precision": 1e8}, meta={}, selection=None)}
    lines = degenerate_posteriors(methods, outs(3.1e15, 0.0), post)
    assert len(lines) == 1 and lines[0].startswith("glm-bridge: mean α₀ 3.1e+15") and "δ = 1e+08" in lines[0]
    assert "refit with a smaller prior precision" in lines[0]
    assert degenerate_posteriors(methods, outs(40.0, 0.02), post) == []
    # chosen on validation data: the MAP limit was the best there, so no advice to refit
    post["post"].selection = Selection.from_record({"validated": True, "map_point": True})
    (line,) = degenerate_posteriors(methods, outs(3.1e15, 0.0), post)
    assert "held-out selection chose the MAP limit" in line and "refit" not in line
    assert "MAP point" in line and "on 100.0% of the inputs" in line
    point = near_zero_variance_warning("glm-bridge", 1e46, 1e-15)
    assert "point mass" in point
