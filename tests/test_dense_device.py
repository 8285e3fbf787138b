"""The dense Laplace fit and predictive keep their maths on the device (emulated CUDA, see
``tests/emulated_cuda.py``): the same numbers as the CPU run (same kernels, same draws) and no host
read per batch (a 4× longer stream of batches makes exactly as many reads)."""

from __future__ import annotations

import torch
from emulated_cuda import emulated_cuda
from tolerance import assert_close

from bayescli.models.dense import DenseClassifier
from bayescli.models.specs import SmallSegNet
from bayescli.posterior.dense_laplace import fit_dense_laplace
from bayescli.predictive.dense import dense_predict

K = 3


def _setup() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = SmallSegNet(1, K, width=4).eval()
    x = torch.rand(8, 1, 6, 7)
    mask = torch.randint(0, K, (8, 6, 7))
    mask[:, 0] = 255
    return net, x, mask


def _fit(net, x, mask, device: str, per_batch: int):
    clf = DenseClassifier(net).to(device)
    batches = [(x[i : i + per_batch], mask[i : i + per_batch]) for i in range(0, len(x), per_batch)]
    post = fit_dense_laplace(clf, batches, structure="kron", prior_precision=0.5)
    with torch.no_grad():
        carried = clf.dense_features(x.to(device))
    return post, dense_predict(post, carried, link="probit")


def test_dense_fit_and_predict_on_the_device_equal_cpu_and_read_nothing_per_batch():
    net, x, mask = _setup()
    cpu_post, cpu_pred = _fit(net, x, mask, "cpu", 1)
    reads = {}
    with emulated_cuda() as stats:
        for per_batch in (4, 1):  # 2 and 8 batches
            stats.reset()
            post, pred = _fit(net, x, mask, "cuda", per_batch)
            reads[per_batch] = stats.host_reads
            assert post.gaussian.G.is_cuda and pred.probs.is_cuda
            G, A, probs = post.gaussian.G.cpu(), post.gaussian.A.cpu(), pred.probs.cpu()
    # the emulated device runs the CPU's kernels: exact up to the order of batch sums (float64)
    assert_close(G, cpu_post.gaussian.G, rtol=1e-12, atol=1e-12, what="device G")
    assert_close(A, cpu_post.gaussian.A, rtol=1e-12, atol=1e-12, what="device A")
    assert_close(probs, cpu_pred.probs, atol=1e-7, what="device probit probabilities")
    assert reads[1] > 0  # the counter sees this code (the split check reads a few scalars)
    assert reads[4] == reads[1], f"host reads {reads}: 2 vs 8 batches\n{stats.report()}"


def test_dense_evaluation_on_the_device_equals_cpu_and_reads_nothing_per_batch():
    """evaluate_dense with a kron posterior (the projected predictive) and MAP, probit and bridge."""
    from bayescli.evaluation.dense import evaluate_dense

    net, x, mask = _setup()
    links = ("none", "probit", "bridge")

    def run(device: str, per_batch: int) -> dict:
        clf = DenseClassifier(net).to(device)
        post = fit_dense_laplace(clf, [(x, mask)], structure="kron", prior_precision=0.5)
        batches = [(x[i : i + per_batch], mask[i : i + per_batch]) for i in range(0, len(x), per_batch)]
        return evaluate_dense(post, clf, batches, links=links)

    cpu = run("cpu", 1)
    reads, reports = {}, {}
    with emulated_cuda() as stats:
        for per_batch in (4, 1):
            stats.reset()
            reports[per_batch] = run("cuda", per_batch)
            reads[per_batch] = stats.host_reads
    assert reads[4] == reads[1], f"host reads {reads}: 2 vs 8 batches\n{stats.report()}"
    for link in links:
        for key in ("pixel_accuracy", "mean_iou", "nll", "brier", "ece"):
            assert_close(reports[1][link][key], cpu[link][key], rtol=1e-12, atol=1e-15, what=f"{link} {key}")
