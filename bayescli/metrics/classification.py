"""Metric functions on predicted probabilities ``probs [N, K]`` and labels ``y [N]``.

Protocol (DESIGN §4, recorded in every report): NLL is the mean negative log-probability of the
true class, exact: from log-probabilities where the caller has them (:func:`log_probabilities`),
else from the float64 log of the probabilities, floored only where a probability underflowed to 0
(no cap: a confidently wrong input counts its full ``−log p``); Brier is Σ_k (p_k − y_k)²
averaged over inputs;
ECE uses 15 equal-width bins of the top-label confidence, right-closed ``(lo, hi]`` with
confidence 1.0 in the last bin; MCE is the largest bin gap of the same bins; adaptive ECE uses
15 equal-mass bins; classwise ECE bins each class's probability the same way and averages the
classes' ECEs; MMC is the mean max probability; entropy is in nats.

Every metric runs on the device of ``probs`` (labels are moved there); only its scalar result
comes back to the host.
"""

from __future__ import annotations

import math

import torch

from bayescli.errors import LowAccuracyWarning  # noqa: F401 - re-exported: the category of the warning below

ECE_BINS = 15
PROTOCOL = {
    "ece_bins": ECE_BINS,
    "ece_binning": "equal-width, right-closed, top-label confidence",
    "mce": "max bin gap, same bins as ece",
    "adaptive_ece": "15 equal-mass bins of top-label confidence",
    "classwise_ece": "15 equal-width bins per class probability, mean over classes",
    "brier": "sum over classes, mean over inputs",
    "nll": "mean -log p(y), exact (no clamp; an underflowed p = 0 counts as the smallest float64)",
    "entropy": "nats",
}


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of inputs whose arg-max class is the label."""
    return (probs.argmax(-1) == y.to(probs.device)).double().mean().item()


def map_correct(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How right MAP is on each input ``[N]`` (float64): 1 where the arg-max of ``logits [N, K]``
    is the label ``y [N]``, else 0; for multi-label ``y [N, K]`` the fraction of labels right (a
    label is predicted present where its logit is positive, i.e. its sigmoid exceeds ½), so the
    mean is the per-label accuracy ``bayescli train`` reports."""
    y = y.to(logits.device)
    if y.dim() == 2:
        return ((logits > 0) == y.bool()).double().mean(-1)
    return (logits.argmax(-1) == y).double()


def map_probabilities(logits: torch.Tensor, likelihood: str) -> torch.Tensor:
    """MAP's probabilities ``[N, K]`` from ``logits [N, K]``: a softmax over the classes, or a
    sigmoid per label for a ``bernoulli`` (multi-label) classifier."""
    return logits.sigmoid() if likelihood == "bernoulli" else logits.softmax(-1)


# The smallest positive float64: only a probability that underflowed to exactly 0 is raised to it
# (−log = 708 nats), so the NLL stays finite; every representable probability counts exactly.
PROB_TINY = torch.finfo(torch.float64).tiny


def log_probabilities(probs: torch.Tensor) -> torch.Tensor:
    """``log p`` ``[N, K]`` in float64 of ``probs [N, K]`` (a 0 counts as :data:`PROB_TINY`)."""
    return probs.double().clamp_min(PROB_TINY).log()


def map_log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """MAP's log-probabilities ``[N, K]`` (float64 log-softmax of ``logits [N, K]``): exact where
    the softmax saturates (a wrong class at margin 800 is −800, not ``log 0``)."""
    return logits.double().log_softmax(-1)


def nll(probs: torch.Tensor, y: torch.Tensor, log_probs: torch.Tensor | None = None) -> float:
    """Mean negative log-likelihood of the labels ``y [N]``: from ``log_probs [N, K]`` when given
    (exact at any confidence), else from ``probs [N, K]`` (:func:`log_probabilities`)."""
    logp = log_probabilities(probs) if log_probs is None else log_probs.double()
    return -logp.gather(1, y.to(logp.device).view(-1, 1)).mean().item()


def brier(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Σ_k (p_k − 1[y=k])², averaged over inputs (range [0, 2])."""
    onehot = torch.nn.functional.one_hot(y.to(probs.device), probs.shape[-1]).double()
    return (probs.double() - onehot).pow(2).sum(-1).mean().item()


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Predictive entropy per input ``[N]`` (nats)."""
    p = probs.double()
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


def _top_and_rest(log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index [N], log Σ_{j≠top} p_j [N], log p_top [N])`` of ``log_probs [N, K]`` in float64,
    ``log p_top = −log1p(Σ_{j≠top} p_j / p_top)`` taken from the rest, so that it keeps its digits
    where ``p_top`` rounds to 1 (a float64 log-softmax rounds it to exactly 0 beyond ~37 nats)."""
    logp = log_probs.double()
    top, idx = logp.max(-1)
    rest = logp.scatter(-1, idx.unsqueeze(-1), -math.inf).logsumexp(-1)
    return idx, rest, -torch.log1p(torch.exp(rest - top))


def max_prob_logit(log_probs: torch.Tensor) -> torch.Tensor:
    """``log p_top − log(1 − p_top)`` ``[N]`` from ``log_probs [N, K]``: increasing in the max
    probability, so it ranks as max-prob does, but computed from the other classes' log-probabilities
    it still separates inputs whose max probability is 1.0 to float32 and float64 (up to ~700 nats)."""
    _, rest, log_top = _top_and_rest(log_probs)
    return log_top - rest


def entropy_of_log(log_probs: torch.Tensor) -> torch.Tensor:
    """Predictive entropy per input ``[N]`` (nats) from ``log_probs [N, K]``, in float64 without a
    floor and with the top class's ``log p`` from the rest (:func:`max_prob_logit`), so that a
    saturated input's entropy is its tiny true value, not exactly 0."""
    idx, _, log_top = _top_and_rest(log_probs)
    logp = log_probs.double().scatter(-1, idx.unsqueeze(-1), log_top.unsqueeze(-1))
    return -(logp.exp() * logp).nan_to_num(nan=0.0).sum(-1)  # a −∞ log counts 0·∞ = 0


def mmc(probs: torch.Tensor) -> float:
    """Mean max confidence."""
    return probs.max(-1).values.double().mean().item()


def _bins(probs: torch.Tensor, y: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-bin count, summed correctness and summed confidence ``([B], [B], [B])``."""
    conf, pred = probs.double().max(-1)
    idx = (torch.ceil(conf * bins) - 1).clamp(0, bins - 1).long()
    zeros = conf.new_zeros(bins)
    count = zeros.index_add(0, idx, torch.ones_like(conf))
    correct = zeros.index_add(0, idx, (pred == y.to(pred.device)).double())
    confidence = zeros.index_add(0, idx, conf)
    return count, correct, confidence


def ece(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error: Σ_b (n_b/N)·|acc_b − conf_b| over equal-width confidence bins."""
    _, correct, confidence = _bins(probs, y, bins)
    return ((correct - confidence).abs().sum() / len(y)).item()


def mce(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Maximum calibration error: ``max_b |acc_b − conf_b|`` over the non-empty equal-width bins."""
    count, correct, confidence = _bins(probs, y, bins)
    used = count > 0
    return ((correct[used] - confidence[used]).abs() / count[used]).max().item()


def adaptive_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> float:
    """ECE over equal-mass bins: inputs sorted by top-label confidence and cut into ``bins``
    groups whose sizes differ by at most one (the first ``N mod bins`` get the extra input)."""
    conf, pred = probs.double().max(-1)
    order = conf.argsort(stable=True)
    hit = (pred == y.to(pred.device)).double()[order]
    conf = conf[order]
    total = conf.new_zeros(())
    for part_conf, part_hit in zip(conf.tensor_split(bins), hit.tensor_split(bins), strict=True):
        total += (part_hit.sum() - part_conf.sum()).abs()  # an empty part adds 0
    return total.item() / len(y)


def classwise_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Classwise ECE (Kull et al. 2019): for each class ``k``, the equal-width-bin ECE of the
    probability ``p_k`` against the indicator ``1[y = k]`` over all inputs; mean over classes."""
    p = probs.double()
    n, k = p.shape
    idx = (torch.ceil(p * bins) - 1).clamp(0, bins - 1).long() + bins * torch.arange(k, device=p.device)
    onehot = torch.nn.functional.one_hot(y.to(p.device), k).double()
    zeros = p.new_zeros(k * bins)
    gap = zeros.index_add(0, idx.reshape(-1), (onehot - p).reshape(-1))  # Σ_bin (1[y=k] − p_k)
    return (gap.abs().sum() / (n * k)).item()


def classification_summary(
    probs: torch.Tensor, y: torch.Tensor | None, log_probs: torch.Tensor | None = None
) -> dict[str, float]:
    """Accuracy, NLL (from ``log_probs`` when given), Brier, ECE (when labels are known), MMC and
    mean entropy."""
    out: dict[str, float] = {}
    if y is not None:
        out |= {
            "accuracy": accuracy(probs, y),
            "nll": nll(probs, y, log_probs),
            "brier": brier(probs, y),
            "ece": ece(probs, y),
        }
    out |= {"mmc": mmc(probs), "entropy": entropy(probs).mean().item()}
    return out


def reliability(probs: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> dict[str, list[float]]:
    """Per-bin ``count``, mean ``confidence`` and ``accuracy`` (bins as in :func:`ece`)."""
    count, correct, confidence = _bins(probs, y, bins)
    safe = count.clamp_min(1)
    return {
        "count": count.tolist(),
        "confidence": (confidence / safe).tolist(),
        "accuracy": (correct / safe).tolist(),
    }


def selective(
    probs: torch.Tensor,
    y: torch.Tensor,
    coverages: tuple[float, ...] = (0.5, 0.8, 0.9),
    log_probs: torch.Tensor | None = None,
) -> dict[str, float]:
    """Accuracy on the most confident fraction of inputs, and the area under the risk–coverage
    curve ``AURC = (1/N) Σ_k risk(k most confident)`` (lower is better). Confidence is
    :func:`max_prob_logit` of ``log_probs [N, K]`` when given: it keeps ranking inputs whose float32
    top probability saturated at 1.0."""
    pred = probs.double().argmax(-1)
    conf = probs.double().max(-1).values if log_probs is None else max_prob_logit(log_probs)
    correct = (pred == y.to(pred.device)).double()[conf.argsort(descending=True)]
    n = len(correct)
    cum_acc = correct.cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)
    picks = [cum_acc[max(1, math.ceil(c * n)) - 1] for c in coverages]
    values = torch.stack([*picks, (1 - cum_acc).mean()]).tolist()
    out = {f"accuracy_at_{int(round(100 * c))}": v for c, v in zip(coverages, values, strict=False)}
    out["aurc"] = values[-1]
    return out


def _threshold_counts(score: torch.Tensor, positive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """True and false positives ``([T], [T])`` when every input scoring ≥ each distinct score is
    called positive, thresholds from the highest score down (tied scores form one threshold)."""
    order = score.argsort(descending=True, stable=True)
    s, hit = score[order], positive[order].double()
    last = torch.cat([torch.nonzero(s[1:] != s[:-1]).squeeze(1), s.new_tensor([len(s) - 1]).long()])
    tps = hit.cumsum(0)[last]
    return tps, (last + 1).double() - tps


def _average_precision(tps: torch.Tensor, fps: torch.Tensor) -> torch.Tensor:
    """``Σ_t (R_t − R_{t−1}) P_t`` over the thresholds (scikit-learn's step-wise definition)."""
    recall = tps / tps[-1]
    precision = tps / (tps + fps)
    return (torch.diff(recall, prepend=recall.new_zeros(1)) * precision).sum()


# A detection score whose pooled values tie more often than this gets its tied share reported:
# its AUROC then counts each tie as half right, so it measures the ties as much as the score.
TIE_REPORT = 0.01


def tied_fraction(score: torch.Tensor) -> float:
    """The share of ``score [N]`` whose value equals another entry's (0 when all differ)."""
    s = score.sort().values
    same = s[1:] == s[:-1]
    tied = torch.zeros_like(s, dtype=torch.bool)
    tied[1:] |= same
    tied[:-1] |= same
    return tied.double().mean().item() if len(s) else 0.0


def ood_metrics(score_in: torch.Tensor, score_out: torch.Tensor, curve_points: int = 101) -> dict:
    """Detection of OOD inputs by a score where *higher means in-distribution*.

    In-distribution is the positive class: AUROC, AUPR-in (average precision, in positive),
    AUPR-out (out positive, score negated), FPR at 95% TPR, and a down-sampled ROC curve. The
    definitions are scikit-learn's (``roc_curve`` with its collinear points dropped,
    ``roc_auc_score``, ``average_precision_score``), computed on the scores' device; and
    ``tied_fraction``, the share of the pooled scores that tie (above ``TIE_REPORT`` the AUROC
    measures the ties: a note says so).
    """
    if not len(score_in) or not len(score_out):
        raise ValueError(f"OOD metrics need both sets: {len(score_in)} in- and {len(score_out)} out-scores")
    s = torch.cat([score_in.double(), score_out.to(score_in.device).double()])
    positive = torch.cat(
        [torch.ones_like(score_in, dtype=torch.bool), torch.zeros_like(score_out, dtype=torch.bool)]
    )
    tps, fps = _threshold_counts(s, positive)
    aupr_in = _average_precision(tps, fps)
    aupr_out = _average_precision(*_threshold_counts(-s, ~positive))
    # a point is kept where the curve bends (scikit-learn's drop_intermediate); (0, 0) first
    bend = torch.logical_or(torch.diff(fps, 2) != 0, torch.diff(tps, 2) != 0)
    keep = (
        torch.cat([bend.new_ones(1), bend, bend.new_ones(1)]) if len(tps) > 2 else torch.ones_like(tps).bool()
    )
    zero = tps.new_zeros(1)
    fpr = torch.cat([zero, fps[keep]]) / fps[-1]
    tpr = torch.cat([zero, tps[keep]]) / tps[-1]
    auroc = torch.trapezoid(tpr, fpr)
    fpr95 = fpr[torch.nonzero(tpr >= 0.95)[0, 0]]
    auroc, aupr_in, aupr_out, fpr95 = torch.stack([auroc, aupr_in, aupr_out, fpr95]).tolist()
    fpr, tpr = fpr.tolist(), tpr.tolist()
    picks = sorted(
        {int(round(i)) for i in torch.linspace(0, len(fpr) - 1, min(curve_points, len(fpr))).tolist()}
    )
    out = {
        "auroc": auroc,
        "aupr_in": aupr_in,
        "aupr_out": aupr_out,
        "fpr95": fpr95,
        "roc": {"fpr": [fpr[i] for i in picks], "tpr": [tpr[i] for i in picks]},
    }
    out["tied_fraction"] = tied_fraction(s)
    return out


def tie_note(where: str, scores: dict[str, float], float32_max_prob: dict[str, float]) -> str:
    """One line for OOD set ``where``: the reported scores ``{"METHOD SCORE": share}`` whose values
    tie, and the methods ``{METHOD: share}`` whose float32 max probability ties (saturates)."""

    def shares(by_name: dict[str, float]) -> str:
        return ", ".join(
            f"{name} {share:.1%}" for name, share in sorted(by_name.items(), key=lambda kv: -kv[1])
        )

    parts = []
    if scores:
        parts.append(
            f"tied scores ({shares(scores)} of the pooled inputs): a tie ranks half right, so such an "
            "AUROC measures the ties; prefer a score that still separates them (max_logit, energy)"
        )
    if float32_max_prob:
        parts.append(
            f"max probability saturated at 1.0 in float32 ({shares(float32_max_prob)} of the pooled "
            "inputs tie): max_prob "
            "is ranked by log-odds from the log-probabilities, but one computed on float32 "
            "probabilities would be an artefact of those ties"
        )
    return f"OOD {where}: " + "; ".join(parts)


def low_accuracy_warning(acc: float, num_classes: int, where: str, multilabel: bool = False) -> str | None:
    """A warning when accuracy is below 50% or, with more than two classes, within 2× of chance
    (``1/K``), else ``None``; for a multi-label model (``acc`` the per-label accuracy of
    :func:`map_correct`) when it is below 50%, a coin flip per label.

    A pretrained model that scores this low on its own kind of data is almost always fed wrongly
    (preprocessing, class order, wrong head), and every uncertainty number after it is meaningless.
    With two classes 2× chance is 100%, so there only below-chance accuracy warns.
    """
    chance = 0.5 if multilabel else 1.0 / num_classes
    if acc >= 0.5 and (multilabel or num_classes <= 2 or acc > 2 * chance):
        return None
    what = "per-label MAP accuracy" if multilabel else "MAP accuracy"
    return (
        f"{what} on {where} is {acc:.1%} (chance {chance:.1%}): check the preprocessing "
        "(--preprocess / --mean --std --resize --crop), the class order of the data, and the head (--head)"
    )


# A Dirichlet this precise (or this little mutual information) is a point mass: the Gaussian it
# stands for has logit variances ≈ 0.
ALPHA0_DEGENERATE = 1e8
MI_DEGENERATE = 1e-6


def near_zero_variance_warning(
    method: str,
    mean_alpha0: float,
    mean_mi: float | None,
    prior_precision: float | None = None,
    chose_map: bool | None = None,
    chosen: str | None = None,
    saturated: float | None = None,
) -> str | None:
    """A warning when a bridge method's mean Dirichlet precision ``α₀`` is astronomically large
    (> 1e8, or not finite) or its mean mutual information vanishes (< 1e-6), else ``None``.

    Either the posterior's logit variances are ≈ 0 (a very large prior precision δ, or a point
    mass such as temperature scaling): its predictive is the MAP network's, and ``α₀``, MI and the
    epistemic scores carry no information; or the net's logit margins dwarf a real variance on
    confident inputs, whose Dirichlets are then point masses. The selection record tells them
    apart, not the size of ``α₀``: ``chose_map`` is ``True`` where held-out selection chose MAP
    (its grid's MAP end or fallback; no advice to refit), ``False`` where it chose ``chosen`` (e.g.
    ``"prior_precision = 25.9"``) inside its grid, ``None`` where the setting was not validated.
    ``saturated``: the share of inputs with ``α₀`` > 1e8, named when given.
    """
    big = not math.isfinite(mean_alpha0) or mean_alpha0 > ALPHA0_DEGENERATE
    flat = mean_mi is not None and mean_mi < MI_DEGENERATE
    if not (big or flat):
        return None
    mi = "" if mean_mi is None else f", mean mutual information {mean_mi:.3g}"
    share = "" if saturated is None else f" (α₀ > {ALPHA0_DEGENERATE:.0e} on {saturated:.1%} of the inputs)"
    head = f"{method}: mean α₀ {mean_alpha0:.3g}{mi}{share}"
    if chose_map is False:
        what = f" ({chosen})" if chosen else ""
        return (
            f"{head}: the Dirichlet is a point mass where the net's logit margins dwarf the posterior's "
            f"logit variance; held-out selection chose a value{what} short of the MAP limit, so the "
            "posterior keeps its variance: α₀ and MI rank only the less confident inputs"
        )
    if chose_map:
        return (
            f"{head}: held-out selection chose the MAP limit (no setting beat MAP on validation data), "
            "so the posterior is the MAP point; its uncertainty scores (α₀, MI) say nothing (rank it by "
            "its probabilities, not by those scores)"
        )
    if prior_precision is not None:
        cause = f" at δ = {prior_precision:.3g}, not chosen on held-out data"
        advice = "refit with a smaller prior precision, or choose it on validation data"
    else:
        cause = ": the posterior is (nearly) a point mass"
        advice = "use a posterior with logit variance for epistemic scores"
    return (
        f"{head}: the posterior's logit variance is near zero next to the net's logit margins{cause}; "
        f"its uncertainty scores (α₀, MI) say little ({advice})"
    )
