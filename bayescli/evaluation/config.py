"""What ``evaluate`` runs: the suites' options (:class:`EvalConfig`) and the baselines' options
(:class:`BaselineConfig`), shared by the runner and the baselines (recorded in the report's protocol)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from bayescli.data import Data
from bayescli.errors import BayescliError
from bayescli.evaluation.methods import Method
from bayescli.options import DEFAULT_OOD_SCORES, Precision

# OOD score name (as given in the options) → report key
SCORES = {
    "msp": "max_prob",
    "entropy": "neg_entropy",
    "alpha0": "alpha0",
    "mi": "neg_mutual_information",
    "maxlogit": "max_logit",
    "energy": "energy",
    "mahalanobis": "mahalanobis",
    "rel-mahalanobis": "rel_mahalanobis",
    "knn": "knn",
    "vim": "vim",
    "react": "react",
    "odin": "odin",
    # multi-label (bernoulli) classifiers: bayescli.metrics.multilabel.ood_scores
    "max-sigmoid": "max_sigmoid",
    "total-entropy": "neg_total_entropy",
    "joint-energy": "joint_energy",
    "mi-sum": "neg_mi_sum",
    "mi-max": "neg_mi_max",
}


def parse_ood_scores(text: str) -> list[str]:
    """``msp,energy,knn`` → report keys; unknown names are a usage error."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in SCORES]
    if bad or not names:
        raise BayescliError(f"unknown OOD score '{bad[0] if bad else text}'; choose from {', '.join(SCORES)}")
    return [SCORES[n] for n in names]


@dataclass
class BaselineConfig:
    """Options of the baselines (recorded in the report's protocol)."""

    ood_scores: list[str] = field(default_factory=lambda: parse_ood_scores(DEFAULT_OOD_SCORES))
    default_scores: bool = False  # not chosen by the user: the likelihood's own default applies
    fit_data: str | Data | None = None  # a spec, or data already loaded (the Python API's loaders)
    val_data: str | Data | None = None
    fit_cache: Path | None = None
    conformal: float | None = None
    fidelity_inputs: int = 32
    knn_k: int = 10
    knn_bank: int | None = 10_000
    ridge: float = 1e-6
    react_percentile: float = 90.0
    odin_temperature: float = 1000.0
    odin_epsilon: float = 0.0014


@dataclass
class EvalConfig:
    """What to run (a suite is skipped when its list is empty).

    ``ggp_data`` maps a posterior's tag to the labelled points its ``ggp-*`` methods fit the GP on
    (prepared with the posterior's recipe); a tag without an entry gets a seeded subset of
    ``ggp_points`` inputs of its recorded fitting data, loaded under ``data_root``.
    """

    methods: list[Method]
    default_methods: bool = False  # not chosen by the user: the likelihood's own default applies
    likelihood: str = "categorical"  # the posteriors' (bernoulli: multi-label, a sigmoid per class)
    ood: list[str] = field(default_factory=list)
    ood_limit: int | None = None
    rotations: list[float] = field(default_factory=list)
    corruptions: list[str] = field(default_factory=list)
    severities: list[int] = field(default_factory=list)
    corruption_root: Path | None = None
    epsilons: list[tuple[str, float]] = field(default_factory=list)
    samples: int = 1000
    ggp_points: int = 1000
    ggp_mode: str = "refined"
    ggp_data: dict[str, Data] = field(default_factory=dict)
    seed: int = 0
    batch_size: int = 256
    data_root: Path = Path("data")
    download: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: Precision | None = None  # of the feature passes; None: the one the posteriors record
    num_workers: int = 0
    skip_unreadable: bool = False
    baselines: BaselineConfig = field(default_factory=BaselineConfig)


def fidelity_runs(cfg: EvalConfig) -> bool:
    """Whether the link-fidelity check runs: softmax posteriors with a predictive method."""
    return (
        cfg.likelihood != "bernoulli"
        and bool(cfg.baselines.fidelity_inputs)
        and any(m.predictive is not None for m in cfg.methods)
    )
