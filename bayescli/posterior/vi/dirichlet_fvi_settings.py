"""Dirichlet fVI's settings (VI-SPEC A3/A4) and the seed's τ rule: what
:func:`bayescli.posterior.vi.dirichlet_fvi.fit` and the from-scratch trainer read, validated on
construction. A module of its own so that the objective
(:mod:`~bayescli.posterior.vi.dirichlet_fvi_objective`) can take the settings without importing
the fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bayescli.data import Data
from bayescli.data.shifts import SYNTHETIC_OOD
from bayescli.errors import BayescliError, require
from bayescli.options import Subset
from bayescli.posterior.selection import Criterion

GAMMA = 1e-4  # label smoothing inside the KL [000:F]
FAMILIES = ("ensemble", "mfvi", "map", "dropout")
SEED_N = 60_000  # the training-set size [000]'s τ values were tuned at (MNIST)


def default_tau(num_classes: int) -> float:
    """τ = 1 for K ≤ 10, 0.1 for K ≤ 100 ([000:B.2]), 10/K beyond (VI-SPEC A4's extrapolation).

    These are the seed's values at ``N ≈ 60,000``; :func:`principled_tau` scales them to ``N``.
    """
    if num_classes <= 10:
        return 1.0
    return 0.1 if num_classes <= 100 else 10.0 / num_classes


def principled_tau(num_classes: int, n_data: int) -> float:
    """``default_tau(K)·N/60,000``: the KL weight per step ``τB/N`` the seed used, at ``N`` points."""
    return default_tau(num_classes) * n_data / SEED_N


def is_index_keyword(value: str) -> bool:
    """Whether ``index_data`` text is one the module generates itself (``rotate:…``, synthetic OOD)."""
    return value.startswith("rotate:") or value in SYNTHETIC_OOD


@dataclass
class DirichletFVIConfig:
    """Settings of a Dirichlet fVI fit (defaults from VI-SPEC A3/A4), validated on construction.

    * ``family``: ``ensemble`` | ``mfvi`` | ``map`` | ``dropout`` (module docs).
    * ``members``: ``M``, ensemble members / test-time samples of mfvi and dropout (1 for map).
    * ``tau``: KL temperature τ in ``ℓ = mean NLL + (τ/N) Σ_S KL``; 0 trains the weight-space
      counterpart. ``None``: post hoc, chosen on the validation data when there is some (and
      ``select`` is not False), else :func:`principled_tau` (module docs); from scratch,
      :func:`default_tau` (the seed's rule, unchanged).
    * ``beta``: prior concentration, a number (uniform ``Dir(β·1)``) or a comma list of ``K``.
    * ``dropout``: drop rate ``p`` of the dropout family.
    * ``index_data``: extra index points for the KL besides the batch: ``rotate:90,180`` (rotated
      copies of the batch, [000:4.3]), ``noise:uniform`` / ``noise:gaussian`` / ``patches``
      (synthetic inputs), or an unlabelled pool as :class:`~bayescli.data.Data` (a data spec
      string is the caller's to load: :meth:`data_specs`); pool points are drawn ``batch_size``
      per step. ``None`` = the batch only (the seed's default).
    * ``train_samples``: samples per step of mfvi and dropout; ``None`` = ``members`` for mfvi,
      1 for dropout (the seed's choice). Ensembles always use every member, map one.
    * ``init_scale``: ensemble members start ``init_scale·rms`` apart; mfvi's initial σ.
    * ``smoothing``: γ in ``f̃ = (1 − γ) f + γ/K`` inside the KL and the Dirichlet fit (numerical
      only: it keeps ``ln f̃`` finite; 0 makes MAP-fVI exactly label smoothing, test A-2).
    * ``subset``: ``last-layer`` (:func:`fit`; from-scratch training always trains the whole network).
    * ``epochs``, ``lr``, ``batch_size``, ``weight_decay``: Adam, constant learning rate, seeded
      shuffling (the seed's MNIST setting: lr 1e-3, B = 256, no weight decay for fVI). ``epochs``
      ``None``: 10, fewer post hoc at large ``N`` (about 128 steps, at least 2 epochs;
      :func:`~bayescli.posterior.vi.budget.head_epochs`); from scratch 10.
    * ``seed``: initialisation, batch order, masks and noise (also at prediction time).
    * ``select``: choose τ on the validation data. ``None`` (default): post hoc whenever
      validation data is given and ``tau`` is unset; from scratch never. ``True``: required (an
      error without validation data; from scratch, ``TAU_GRID``× :func:`default_tau`, one
      network each). ``False``: never.
    * ``select_by``: the validation score the choice minimises (``nll``, ``ece`` or ``brier``).
    * ``model_kwargs``: from scratch only, architecture arguments ``hidden=50,depth=2``.
    * ``normalisation``: from scratch only, ``data`` (per-channel mean/std of the training inputs)
      or ``pm1`` (pixels to [−1, 1], the seed's MNIST setting).
    """

    family: str = "ensemble"
    members: int = 10
    tau: float | None = None
    beta: float | str = 1.0
    dropout: float = 0.2
    index_data: str | Data | None = None
    train_samples: int | None = None
    init_scale: float = 0.1
    smoothing: float = GAMMA
    subset: Subset = Subset.LAST_LAYER
    epochs: int | None = None
    lr: float = 1e-3
    batch_size: int = 256
    weight_decay: float = 0.0
    seed: int = 0
    select: bool | None = None
    select_by: Criterion = Criterion.NLL
    model_kwargs: str = ""
    normalisation: str = "data"

    def __post_init__(self) -> None:
        try:
            self.subset = Subset(self.subset)
        except ValueError:
            raise BayescliError(f"subset must be 'last-layer' or 'all', got '{self.subset}'") from None
        require(self.family in FAMILIES, f"unknown family '{self.family}'; use one of {', '.join(FAMILIES)}")
        require(self.members >= 1, f"members must be at least 1, got {self.members}")
        require(self.family != "ensemble" or self.members >= 2, "an ensemble needs members >= 2; use map")
        require(self.tau is None or self.tau >= 0, f"tau must be >= 0, got {self.tau}")
        require(
            not (self.select and self.tau is not None),
            f"select=True chooses tau on validation data, but tau = {self.tau} is set; unset tau or select",
        )
        require(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        require(self.train_samples is None or self.train_samples >= 1, "train_samples must be >= 1")
        require(self.init_scale >= 0, f"init_scale must be >= 0, got {self.init_scale}")
        require(0 <= self.smoothing < 1, f"smoothing must be in [0, 1), got {self.smoothing}")
        require(
            (self.epochs is None or self.epochs >= 1) and self.batch_size >= 1,
            "epochs and batch_size must be >= 1",
        )
        require(self.lr > 0, f"lr must be positive, got {self.lr}")
        require(self.normalisation in ("data", "pm1"), "normalisation must be 'data' or 'pm1'")
        require(
            self.index_data is None or isinstance(self.index_data, str | Data),
            f"index_data must be a keyword, a data spec or Data, got {type(self.index_data).__name__}",
        )
        try:
            self.select_by = Criterion(self.select_by)
        except ValueError:
            options = ", ".join(c.value for c in Criterion)
            raise BayescliError(f"select_by must be one of {options}, got '{self.select_by}'") from None

    @property
    def num_samples(self) -> int:
        """``M`` at prediction time."""
        return 1 if self.family == "map" else self.members

    @property
    def step_samples(self) -> int:
        """Samples per training step."""
        if self.family in ("ensemble", "map"):
            return self.num_samples
        if self.train_samples is not None:
            return self.train_samples
        return self.members if self.family == "mfvi" else 1

    def data_specs(self) -> dict[str, str]:
        """``{setting: data spec}`` the caller must load and put back as :class:`~bayescli.data.Data`
        (``dataclasses.replace``) before :func:`fit`: ``index_data`` when it names a data set."""
        value = self.index_data
        return (
            {"index_data": value} if isinstance(value, str) and value and not is_index_keyword(value) else {}
        )

    def record(self) -> dict:
        """The settings as JSON values (a loaded ``index_data`` as its spec), for file metadata."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["select_by"] = self.select_by.value
        if isinstance(self.index_data, Data):
            out["index_data"] = self.index_data.spec
        return out
