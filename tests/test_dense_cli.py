"""Segmentation through the CLI: train → inspect → fit-laplace → evaluate on tiny digit scenes, the
CLI's numbers against the library's and independent oracles, gates, and one-line refusals."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve
from tolerance import assert_close

from bayescli.cli.app import main
from bayescli.data.registry import load_segmentation
from bayescli.data.scenes import compose_scenes, save_scenes
from bayescli.evaluation.dense import evaluate_dense, select_dense_prior
from bayescli.models.dense import DenseClassifier
from bayescli.models.specs import load_classifier
from bayescli.posterior.base import load_posterior
from bayescli.posterior.dense_laplace import fit_dense_laplace

MODEL = "builtin:small-segnet"
DELTA = 0.5  # weak enough that the Laplace predictive differs from MAP


def run(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    """``train.npz`` (digit scenes 0–2 on 16×16) and ``test.npz`` (24×24, with a letter-like
    anomaly per scene: flipped digits of other rows), from scikit-learn's digits."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.images, dtype=torch.float32) / 16, torch.tensor(d.target)
    x, y = x[y < 3], y[y < 3]
    names = ["0", "1", "2"]
    root = tmp_path_factory.mktemp("scenes")
    train = compose_scenes(x[:200], y[:200], 120, seed=0, canvas=(16, 16), objects=(1, 1), class_names=names)
    test = compose_scenes(
        x[200:],
        y[200:],
        30,
        seed=1,
        canvas=(24, 24),
        objects=(1, 1),
        anomalies=x.flip(1)[200:],
        class_names=names,
    )
    save_scenes(train, root / "train.npz")
    save_scenes(test, root / "test.npz")
    return root


@pytest.fixture(scope="module")
def trained(scenes) -> Path:
    out = scenes / "seg.safetensors"
    code = run(
        "train",
        "--model",
        MODEL,
        "--data",
        f"seg:{scenes}/train.npz:train",
        "--out",
        out,
        "--epochs",
        15,
        "--lr",
        0.01,
        "--batch-size",
        16,
        "-q",
    )
    assert code == 0
    return out


@pytest.fixture(scope="module")
def fitted(scenes, trained) -> Path:
    out = scenes / "laplace.safetensors"
    code = run(
        "fit-laplace",
        "--model",
        MODEL,
        "--checkpoint",
        trained,
        "--data",
        f"seg:{scenes}/train.npz:train",
        "--prior-precision",
        DELTA,
        "--out",
        out,
        "-q",
    )
    assert code == 0
    return out


def dense_of(ckpt: Path) -> DenseClassifier:
    return DenseClassifier.from_classifier(load_classifier(MODEL, ckpt).classifier)


def test_seg_spec_splits_and_rows(scenes):
    whole = load_segmentation(f"seg:{scenes}/train.npz")
    parts = [load_segmentation(f"seg:{scenes}/train.npz:{s}") for s in ("train", "val", "test")]
    assert [len(p) for p in parts] == [84, 12, 24] and len(whole) == 120
    rows = torch.cat([p.x for p in parts]).flatten(1)
    assert len(torch.unique(rows, dim=0)) == len(torch.unique(whole.x.flatten(1), dim=0))  # a partition
    ranged = load_segmentation(f"seg:{scenes}/train.npz:val[2:5]")
    assert torch.equal(ranged.x, parts[1].x[2:5]) and torch.equal(ranged.mask, parts[1].mask[2:5])
    assert ranged.info["spec"].endswith("train.npz:val[2:5]")


def test_train_writes_a_segmentation_checkpoint(trained):
    from bayescli.io import peek_metadata

    meta = peek_metadata(trained)
    assert meta["task"] == "segmentation" and meta["ignore_index"] == 255 and meta["num_classes"] == 4
    assert meta["class_names"] == ["background", "0", "1", "2"]
    assert meta["val_data"]["spec"].endswith("train.npz:val")
    # the recorded pixel accuracy is the network's own over valid pixels of the training split
    train = load_segmentation(meta["data"]["spec"])
    dense = dense_of(trained)
    with torch.no_grad():
        pred = dense(next(train.batches(len(train)))[0]).argmax(1)
    valid = train.mask != 255
    assert meta["train_accuracy"] == pytest.approx(
        float((pred == train.mask)[valid].double().mean()), abs=1e-12
    )
    assert meta["train_loss"][-1] < 0.5 * meta["train_loss"][0]


def test_inspect_says_dense(capsys, scenes, trained):
    assert (
        run(
            "inspect", "--model", MODEL, "--checkpoint", trained, "--data", f"seg:{scenes}/test.npz", "--json"
        )
        == 0
    )
    info = json.loads(capsys.readouterr().out)
    assert info["task"].startswith("segmentation")
    dense = info["dense"]
    assert dense["head"] == "classifier" and dense["num_classes"] == 4 and dense["feature_dim"] == 32
    assert dense["split_check"] == "ok" and dense["split_max_abs_diff"] < 1e-4
    test = load_segmentation(f"seg:{scenes}/test.npz")
    assert info["valid_pixels"] == test.valid_count() == int((test.mask != 255).sum())
    # without data the checkpoint's task and input shape suffice
    assert run("inspect", "--model", MODEL, "--checkpoint", trained, "--json") == 0
    assert json.loads(capsys.readouterr().out)["dense"]["split_check"] == "ok"


def test_fit_laplace_equals_the_library(scenes, trained, fitted):
    post = load_posterior(fitted)
    assert post.meta["task"] == "segmentation" and post.meta["dense"]["head"] == "classifier"
    train = load_segmentation(f"seg:{scenes}/train.npz:train")
    ref = fit_dense_laplace(dense_of(trained), train.batches(7), "kron", prior_precision=DELTA)
    assert post.n_data == ref.n_data == train.valid_count()
    for name, t in ref.tensors().items():
        # float32 sums of per-pixel outer products over other batchings: relative rounding ~1e-6
        assert_close(post.tensors()[name], t, rtol=1e-4, atol=1e-5 * float(t.abs().max()), what=name)
    assert post.prior_precision == DELTA


def test_fit_laplace_full_on_pixels_with_ignored_ones(scenes, trained):
    out, spec = scenes / "full.safetensors", f"seg:{scenes}/test.npz[:12]"
    args = ["--data", spec, "--hessian", "full", "--prior-precision", 2, "--out", out, "-q"]
    assert run("fit-laplace", "--model", MODEL, "--checkpoint", trained, *args) == 0
    post, data = load_posterior(out), load_segmentation(spec)
    assert post.meta["dense"]["ignore_index"] == 255 and data.valid_count() < data.mask.numel()
    ref = fit_dense_laplace(dense_of(trained), data.batches(5), "full", prior_precision=2.0)
    assert post.n_data == ref.n_data == data.valid_count()
    for name, t in ref.tensors().items():
        assert_close(post.tensors()[name], t, rtol=1e-4, atol=1e-5 * float(t.abs().max()), what=name)


def test_fit_laplace_chooses_delta_on_validation_pixels(capsys, scenes, trained):
    out = scenes / "val.safetensors"
    data = f"seg:{scenes}/train.npz:train"
    assert (
        run(
            "fit-laplace",
            "--model",
            MODEL,
            "--checkpoint",
            trained,
            "--data",
            data,
            "--hessian",
            "diag",
            "--out",
            out,
            "--json",
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["validation"].endswith("train.npz:val") and summary["prior_method"] == "val-nll"
    dense = dense_of(trained)
    ref = fit_dense_laplace(dense, load_segmentation(data).batches(16), "diag", prior_precision=1.0)
    best = select_dense_prior(ref, dense, load_segmentation(f"seg:{scenes}/train.npz:val").batches(16))
    assert summary["prior_precision"] == pytest.approx(best, rel=1e-12)


def test_evaluate_report_against_the_library_and_oracles(capsys, scenes, trained, fitted):
    report_path = scenes / "report.json"
    test_spec = f"seg:{scenes}/test.npz"
    code = run(
        "evaluate",
        "--posterior",
        fitted,
        "--data",
        test_spec,
        "--methods",
        "map,temp,glm-probit,glm-mc",
        "--samples",
        200,
        "--out",
        report_path,
        "--json",
        "--batch-size",
        7,
        "--val-data",  # T on pixels that include ignored (anomalous) ones
        f"{test_spec}[:10]",
    )
    assert code == 0
    report = json.loads(report_path.read_text())
    jsonschema.validate(
        report, json.loads(files("bayescli").joinpath("schemas/report.schema.json").read_text())
    )
    res = report["results"]
    test = load_segmentation(test_spec)
    dense, post = dense_of(trained), load_posterior(fitted)
    lib = evaluate_dense(post, dense, test.batches(5), links=("none", "probit"))
    for method, link in (("map", "none"), ("glm-probit", "probit")):
        got, want = res["in_distribution"][method], lib[link]
        assert got["pixels"] == want["pixels"] == test.valid_count()
        for key in ("pixel_accuracy", "mean_iou", "brier", "ece", "mmc"):
            assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, what=f"{method} {key}")
        assert_close(got["nll"], want["nll"], rtol=1e-5, what=f"{method} nll")
        assert list(got["iou"]) == ["background", "0", "1", "2"]
        assert_close([v or 0.0 for v in got["iou"].values()], [v or 0.0 for v in want["iou"]], atol=1e-6)
    assert res["in_distribution"]["glm-probit"]["nll"] != res["in_distribution"]["map"]["nll"]

    # anomaly segmentation of MAP's entropy against scikit-learn on the exact per-pixel scores
    x = next(test.batches(len(test)))[0]
    with torch.no_grad():
        p = dense(x).double().softmax(1)
    ent = -(p * p.clamp_min(1e-300).log()).sum(1).flatten().numpy()
    label = test.anomaly.flatten().numpy()
    cell = res["anomaly"][test_spec]["map"]
    assert cell["pixels"] == label.size and cell["anomalous"] == int(label.sum())
    bound = cell["entropy"]["error_bound"]
    assert_close(
        cell["entropy"]["auroc"], roc_auc_score(label, ent), atol=bound["auroc"] + 1e-9, what="auroc"
    )
    assert_close(
        cell["entropy"]["ap"], average_precision_score(label, ent), atol=bound["ap"] + 1e-9, what="ap"
    )
    fpr, tpr, _ = roc_curve(label, ent, drop_intermediate=False)
    exact = fpr[np.argmax(tpr >= 0.95)]
    assert exact - 1e-12 <= cell["entropy"]["fpr95"] <= exact + bound["fpr95"] + 1e-12
    assert set(res["anomaly"][test_spec]["glm-mc"]) >= {"mutual_information", "max_prob", "entropy"}
    assert (
        "energy" in res["anomaly"][test_spec]["map"]
        and "energy" not in res["anomaly"][test_spec]["glm-probit"]
    )

    # temperature: T minimises the validation pixels' NLL (checked against its neighbours)
    temp = report["protocol"]["temperature"]
    val = load_segmentation(temp["data"]["spec"])
    with torch.no_grad():
        z = dense(next(val.batches(len(val)))[0]).double()

    def nll(t: float) -> float:
        return float(torch.nn.functional.cross_entropy(z / t, val.mask, ignore_index=255))

    t = temp["temperature"]
    assert_close(temp["val_nll"], nll(t), rtol=1e-9, what="val nll at T")
    assert nll(t) <= min(nll(t * 1.02), nll(t / 1.02)) and temp["val_points"] == val.valid_count()
    assert val.valid_count() < val.mask.numel()
    with torch.no_grad():
        zt = dense(x).double() / t
    keep = test.mask != 255
    want = torch.nn.functional.cross_entropy(zt, test.mask, ignore_index=255)
    assert_close(res["in_distribution"]["temp"]["nll"], want, rtol=1e-6, what="temp test nll")
    acc = (zt.argmax(1) == test.mask)[keep].double().mean()
    assert_close(res["in_distribution"]["temp"]["pixel_accuracy"], acc, atol=1e-12, what="temp accuracy")


def test_gates_on_dense_numbers(capsys, scenes, fitted):
    test_spec = f"seg:{scenes}/test.npz"
    base = ["evaluate", "--posterior", fitted, "--data", test_spec, "--methods", "map,glm-probit", "-q"]
    assert (
        run(
            *base,
            "--fail-if",
            "in_distribution.glm-probit.mean_iou < 0",
            "--fail-if",
            "in_distribution.map.iou.background < 0.5",
        )
        == 0
    )
    code = run(*base, "--fail-if", f"anomaly.{test_spec}.glm-probit.entropy.auroc < 0.9999")
    err = capsys.readouterr().err
    assert code == 1 and "gate failed: anomaly." in err and "glm-probit.entropy.auroc" in err
    code = run(*base, "--fail-if", "in_distribution.glm-probit.accuracy < 0.5")
    err = capsys.readouterr().err
    assert code == 2 and "'in_distribution.glm-probit.accuracy' is not in what this evaluation reports" in err


def test_ood_anomaly_sets(capsys, scenes, fitted):
    test_spec, ood_spec = f"seg:{scenes}/test.npz", f"seg:{scenes}/test.npz[10:20]"
    out = scenes / "ood.json"
    args = ["--posterior", fitted, "--data", f"seg:{scenes}/train.npz:test", "--methods", "map,glm-probit"]
    assert run("evaluate", *args, "--ood", ood_spec, "--ood", test_spec, "--out", out, "-q") == 0
    anomaly = json.loads(out.read_text())["results"]["anomaly"]
    assert list(anomaly) == [ood_spec, test_spec]  # the test data (train scenes) has no anomaly masks
    ood = load_segmentation(ood_spec)
    assert anomaly[ood_spec]["map"]["pixels"] == ood.anomaly.numel()
    assert anomaly[ood_spec]["map"]["anomalous"] == int(ood.anomaly.sum())
    assert run("evaluate", *args, "--ood", f"seg:{scenes}/train.npz", "-q") == 2
    assert "has no 'anomaly' array" in one_line(capsys.readouterr().err)
    assert run("evaluate", *args, "--ood", ood_spec, "--ood-scores", "msp,mi", "--out", out, "-q") == 0
    cells = json.loads(out.read_text())["results"]["anomaly"][ood_spec]
    assert set(cells["map"]) == {"pixels", "anomalous", "max_prob"}  # mi: the mc link's only
    assert run("evaluate", *args, "--ood", ood_spec, "--ood-scores", "knn", "-q") == 2
    assert "unknown anomaly score 'knn' for segmentation" in one_line(capsys.readouterr().err)


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_input_exits_2_naming_the_cause(capsys, scenes, trained, digits_ckpt, tmp_path):
    fit = [
        "fit-laplace",
        "--model",
        MODEL,
        "--checkpoint",
        trained,
        "--out",
        tmp_path / "p.safetensors",
        "-q",
    ]
    train = load_segmentation(f"seg:{scenes}/train.npz")
    big = train.mask.numpy().copy()
    big[0, 0, 0] = 7  # a class the 4-class model does not have
    np.savez(tmp_path / "big.npz", x=train.x.numpy(), mask=big)
    assert run(*fit, "--data", f"seg:{tmp_path}/big.npz", "--prior-precision", 1) == 2
    assert "mask holds class 7 but the model has 4 classes" in one_line(capsys.readouterr().err)

    np.savez(tmp_path / "keys.npz", images=train.x.numpy(), labels=train.mask.numpy())
    assert run(*fit, "--data", f"seg:{tmp_path}/keys.npz") == 2
    assert "has no array 'x' (found: images, labels)" in one_line(capsys.readouterr().err)

    assert run(*fit, "--data", f"seg:{scenes}/train.npz", "--subset", "all") == 2
    assert "only --subset last-layer applies" in one_line(capsys.readouterr().err)
    assert run(*fit, "--data", f"seg:{scenes}/train.npz", "--resize", 32) == 2
    assert "--resize does not apply to segmentation data" in one_line(capsys.readouterr().err)

    # a classifier checkpoint with segmentation data: refused before any head is looked for
    small = torch.nn.functional.interpolate(train.x[:20].float(), size=(8, 8))[:, 0]
    np.savez(tmp_path / "small.npz", x=small.numpy(), mask=np.zeros((20, 8, 8), np.uint8))
    cnn = ["fit-laplace", "--model", "builtin:small-cnn", "--checkpoint", digits_ckpt]
    assert run(*cnn, "--out", tmp_path / "c.safetensors", "--data", f"seg:{tmp_path}/small.npz") == 2
    err = one_line(capsys.readouterr().err)
    assert "builtin:small-cnn is not a segmentation model: it returns [2, 10]" in err

    assert (
        run(
            "evaluate",
            "--posterior",
            scenes / "laplace.safetensors",
            "--data",
            f"seg:{scenes}/test.npz",
            "--rotation",
            "0:90:45",
        )
        == 2
    )
    assert "--rotation" in one_line(capsys.readouterr().err)


def test_a_torchvision_segmentation_checkpoint_goes_through(capsys, scenes, tmp_path):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = tv.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4, aux_loss=False
    )
    torch.save(net.state_dict(), tmp_path / "dl.pth")
    test = load_segmentation(f"seg:{scenes}/test.npz[:8]")
    np.savez(tmp_path / "rgb.npz", x=test.x.repeat(1, 3, 1, 1).numpy(), mask=test.mask.numpy())
    model = ["--model", "torchvision:deeplabv3_mobilenet_v3_large", "--checkpoint", tmp_path / "dl.pth"]
    model += ["--model-arg", "weights_backbone=None"]
    data = ["--data", f"seg:{tmp_path}/rgb.npz"]
    assert run("inspect", *model, *data, "--json") == 0
    dense = json.loads(capsys.readouterr().out)["dense"]
    assert dense["head"] == "classifier.4" and dense["output"] == "out" and dense["split_check"] == "ok"
    post = tmp_path / "dl.safetensors"
    assert run("fit-laplace", *model, *data, "--prior-precision", 1, "--out", post, "-q") == 0
    out = tmp_path / "dl.json"
    assert run("evaluate", "--posterior", post, *data, "--methods", "map,glm-probit", "--out", out, "-q") == 0
    report = json.loads(out.read_text())
    assert report["model"]["head"] == "classifier.4" and report["model"]["head_kind"] == "conv1x1-dense"
    assert report["results"]["in_distribution"]["map"]["pixels"] == test.valid_count()
