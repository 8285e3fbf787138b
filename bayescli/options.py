"""User-facing options: enums, the trainer's settings and defaults.

Floor 1 and free of heavy imports, so the CLI builds its help without loading torch; library and
CLI modules import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class BridgeCorrection(str, Enum):
    """How the logit Gaussian is adjusted before eq. 7.

    * ``none``: eq. 7 on ``(μ, diag Σ)`` as in the paper.
    * ``zero-sum``: condition on ``1ᵀz = 0`` first (the logits' shift-invariance):
      ``μ ← μ − Σ1 (1ᵀμ)/(1ᵀΣ1)``, ``Σ ← Σ − Σ11ᵀΣ/(1ᵀΣ1)`` (the authors' official code).
    * ``norm``: ``zero-sum`` followed by rescaling with ``c = mean_k(Σ_kk)/√(K/2)``:
      ``μ ← μ/√c``, ``Σ_kk ← Σ_kk/c`` (the authors' later "bridge_norm").

    Default ``zero-sum``, measured with ``benchmarks/bridge.py`` (KL(p_true ‖ p_LB) on a simplex
    grid, μ = (−1, 2, −1)): on the seed's isotropic Gaussians 10·I / I / 0.1·I, ``none`` scores
    0.30 / 0.19 / 2.27 and ``zero-sum`` 0.40 / 0.25 / 3.38, but adding a common logit shift
    (I + 10·11ᵀ, the same softmax distribution as I) leaves ``zero-sum`` at 0.25 while ``none``
    degrades to 0.86. Last-layer posteriors carry exactly such shared variance (the bias
    direction), so the shift-invariant ``zero-sum`` is the default. ``norm`` is worst on all
    four (1.15 / 0.54 / 687 / 0.54).
    """

    NONE = "none"
    ZERO_SUM = "zero-sum"
    NORM = "norm"


DEFAULT_CORRECTION = BridgeCorrection.ZERO_SUM


class Predictive(str, Enum):
    GLM = "glm"
    BNN = "bnn"
    GGP = "ggp"


class GGPMode(str, Enum):
    MAP = "map"
    REFINED = "refined"


class Link(str, Enum):
    """How a logit Gaussian becomes probabilities: ``none``, ``probit`` and ``mc`` serve softmax
    and multi-label (sigmoid-per-class) posteriors alike; ``sodpp`` and ``bridge`` are softmax
    links, ``beta`` (a moment-matched Beta per label) is the multi-label one."""

    NONE = "none"
    PROBIT = "probit"
    SODPP = "sodpp"
    MC = "mc"
    BRIDGE = "bridge"
    BETA = "beta"


class Criterion(str, Enum):
    """What a validation set scores when a hyperparameter is chosen: NLL, ECE or Brier."""

    NLL = "nll"
    ECE = "ece"
    BRIER = "brier"


class Subset(str, Enum):
    LAST_LAYER = "last-layer"
    ALL = "all"


class HessianStructure(str, Enum):
    DIAG = "diag"
    KRON = "kron"
    FULL = "full"


class CurvatureType(str, Enum):
    GGN = "ggn"
    GGN_MC = "ggn-mc"
    EF = "ef"


class Precision(str, Enum):
    """The arithmetic of the backbone's feature pass.

    * ``fp32``: float32 throughout (the default; what every fit did before precisions existed).
    * ``bf16`` / ``fp16``: the backbone runs under ``torch.autocast`` in bfloat16 / float16, conv
      nets in channels_last; ``φ`` and the logits are cast to float32 before any head maths, the
      curvature sums stay float64 and the posterior maths is unchanged. ``fp16`` needs a CUDA
      device. Whole-network posteriors run the network themselves and take ``fp32`` only.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Backend(str, Enum):
    AUTO = "auto"
    CLOSED_FORM = "closed-form"
    BACKPACK = "backpack"


@dataclass
class TrainConfig:
    """Optimisation settings (recorded in the checkpoint)."""

    epochs: int = 20
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 1e-4
    seed: int = 0


# Methods `evaluate` compares when --methods is not given.
DEFAULT_METHODS = "map,glm-probit,glm-bridge"
# OOD scores `evaluate` reports when --ood-scores is not given (names as on the command line).
DEFAULT_OOD_SCORES = "msp,entropy,maxlogit,energy,mahalanobis,knn,alpha0,mi"
# The same for multi-label (bernoulli) posteriors: the sigmoid links and multi-label OOD scores.
MULTILABEL_METHODS = "map,glm-probit,glm-mc,glm-beta"
MULTILABEL_OOD_SCORES = "max-sigmoid,total-entropy,joint-energy,mi-sum,mi-max,knn"


class PreprocessPreset(str, Enum):
    """Where the input recipe comes from (see :mod:`bayescli.models.preprocess`)."""

    TIMM = "timm"
    TORCHVISION = "torchvision"
    IMAGENET = "imagenet"
    CIFAR = "cifar"
    NONE = "none"


class Interpolation(str, Enum):
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    NEAREST = "nearest"
