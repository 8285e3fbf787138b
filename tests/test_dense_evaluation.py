"""evaluate_dense: streamed over batches, per link, against the metrics of predictions made in one go."""

from __future__ import annotations

import torch
from tolerance import assert_close

from bayescli.evaluation.dense import evaluate_dense
from bayescli.metrics.segmentation import SegmentationMetrics
from bayescli.models.dense import DenseClassifier
from bayescli.models.specs import SmallSegNet
from bayescli.posterior.dense_laplace import fit_dense_laplace
from bayescli.predictive.dense import dense_predict

K = 3


def test_evaluate_dense_streams_what_one_pass_computes():
    torch.manual_seed(0)
    clf = DenseClassifier(SmallSegNet(1, K, width=4).eval())
    x = torch.rand(6, 1, 8, 9)
    mask = torch.randint(0, K, (6, 8, 9))
    mask[:, :, 0] = 255
    post = fit_dense_laplace(clf, [(x[:3], mask[:3])], structure="kron", prior_precision=0.3)
    report = evaluate_dense(post, clf, [(x[i : i + 2], mask[i : i + 2]) for i in range(0, 6, 2)])
    with torch.no_grad():
        logits, carried = clf(x), clf.dense_features(x)
    expected = {"none": logits.softmax(1), "probit": dense_predict(post, carried, "probit").probs}
    for link, probs in expected.items():
        ref = SegmentationMetrics(K)
        ref.update(mask, probs=probs)
        want, got = ref.compute(), report[link]
        assert got["pixels"] == want["pixels"] == 6 * 8 * 8
        for key in ("pixel_accuracy", "mean_iou", "brier", "ece"):
            assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, what=f"{link} {key}")
        # the report's NLL is from the link's float64 log-probabilities, the reference's from float32 probs
        assert_close(got["nll"], want["nll"], rtol=1e-5, what=f"{link} nll")
    assert report["probit"]["nll"] != report["none"]["nll"]
