"""The library call ``bayescli.evaluation.evaluate`` returns the report ``bayescli evaluate`` writes."""

import json

import pytest

from bayescli.data import load_data
from bayescli.errors import BayescliError
from bayescli.evaluation import evaluate
from bayescli.evaluation.evaluate import posterior_tags
from bayescli.io import to_json
from bayescli.posterior.base import load_posterior


def _differences(a: object, b: object, path: str = "") -> list[str]:
    """Paths where two JSON trees differ (numbers compared exactly: the same computation on the
    same inputs in one process must give the same bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in set(a) ^ set(b)]
        for k in set(a) & set(b):
            out += _differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} vs {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def test_library_report_equals_cli_report(cli, digits_posterior, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = [
        "evaluate", "--posterior", digits_posterior, "--data", "digits:test", "--limit", "120",
        "--methods", "map,temp,glm-probit,glm-bridge,ggp-probit", "--ggp-points", "60", "--samples", "50",
        "--ood", "patches", "--ood-limit", "40", "--ood-scores", "msp,energy,mahalanobis,knn,mi",
        "--rotation", "0:90:90", "--fgsm", "0,8/255", "--conformal", "0.2", "--fidelity-inputs", "16",
        "--fail-if", "in_distribution.map.accuracy < 0.5", "--seed", "3", "--out", out, "--json",
        "--device", "cpu",  # the library call below runs on the CPU; compared to the last bit
    ]  # fmt: skip
    res = cli(*args)
    assert res.code == 0, res.err
    written = json.loads(out.read_text())
    assert json.loads(res.out) == written  # --json prints the report it writes

    post = load_posterior(digits_posterior)
    model = post.load_model()
    data = load_data("digits:test", limit=120, seed=3, preprocess=model.preprocess)
    report = evaluate(
        [post],
        data,
        model=model,
        methods="map,temp,glm-probit,glm-bridge,ggp-probit",
        ggp_points=60,
        samples=50,
        ood=["patches"],
        ood_limit=40,
        ood_scores=["msp", "energy", "mahalanobis", "knn", "mi"],
        rotation="0:90:90",
        fgsm="0,8/255",
        conformal=0.2,
        fidelity_inputs=16,
        fail_if=["in_distribution.map.accuracy < 0.5"],
        seed=3,
        device="cpu",
    )
    assert capsys.readouterr() == ("", "")  # the library prints nothing (its warnings are in the report)
    ours = json.loads(to_json(report))
    assert set(ours["timings"]) == set(written["timings"])  # the same steps ran
    del ours["timings"], written["timings"]
    assert _differences(ours, written) == []
    assert set(ours["results"]) == {
        "in_distribution",
        "ood",
        "rotation",
        "fgsm",
        "conformal",
        "link_fidelity",
    }
    assert ours["gates"][0]["failed"] is False and ours["posterior_file"] == str(digits_posterior)
    assert ours["protocol"]["ggp"]["points"] == 60


def test_tags_options_and_errors(digits_posterior):
    post = load_posterior(digits_posterior)
    again = load_posterior(digits_posterior)
    assert list(posterior_tags([post, again])) == ["post", "post-2"]  # file stems, made unique
    other = load_posterior(digits_posterior)
    other.meta["checkpoint_sha256"] = "0" * 64
    with pytest.raises(BayescliError, match="different model"):
        posterior_tags([post, other])
    data = load_data("digits:test", limit=20)
    # gate paths and option values are checked before anything runs (no model is loaded here)
    with pytest.raises(BayescliError, match="valid paths"):
        evaluate([post], data, fail_if=["ood.svhn.map.mmc < 1"], device="cpu")
    with pytest.raises(BayescliError, match="unknown OOD score"):
        evaluate([post], data, ood_scores="msp,magic", device="cpu")
