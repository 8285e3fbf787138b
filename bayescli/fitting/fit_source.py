"""What every method's ``fit`` receives: the model, its data, where to compute, and features once.

The method contract (:mod:`bayescli.fitting.registry`) is ``fit(source, settings) → Posterior``
for Laplace and every VI method alike. :class:`FitSource` bundles the loaded classifier, the
fitting data and optional validation data (pixel space, already preprocessed for this model),
the device and batch size, and computes each set's backbone features at most once: several
methods fitted on one source (``bayescli select``) share one backbone pass per set, and a
method never loads data by spec itself (extra sets such as FSVI's context pool or Dirichlet
fVI's index set arrive as :class:`~bayescli.data.Data` in its settings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from bayescli.data import Data
from bayescli.errors import BayescliError
from bayescli.metrics.classification import map_correct
from bayescli.models.features import Features, FeatureStream, extract_features, logit_pass
from bayescli.models.specs import Classifier, LoadedModel


@dataclass(eq=False)
class FitSource:
    """The inputs of a fit.

    * ``model``: the loaded classifier (network, head, preprocessing, provenance).
    * ``data``: labelled fitting data ``x [N, ...]``, ``y [N]`` (``[N, K]`` multi-label for a
      bernoulli model: the labels must match the model's likelihood).
    * ``val``: labelled held-out data for tuning, disjoint from ``data`` (or ``None``).
    * ``device``, ``batch_size``: where and how many inputs per backbone pass.
    * ``feature_cache``: a directory caching the fitting set's features (see
      :class:`~bayescli.models.features.FeatureStream`).
    """

    model: LoadedModel
    data: Data
    val: Data | None = None
    device: torch.device | str = "cpu"
    batch_size: int = 256
    feature_cache: Path | None = None
    _memo: dict[int, tuple[Data, Features]] = field(default_factory=dict, repr=False)
    _stream: FeatureStream | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.data.y is None:
            raise BayescliError(f"{self.data.spec} has no labels; fitting a posterior needs labelled data")
        if self.val is not None and self.val.y is None:
            raise BayescliError(f"{self.val.spec} has no labels; the validation data must be labelled")
        for data in (self.data, self.val):
            if data is not None:
                # which methods fit the model's likelihood is the registry's business (fitting.py)
                data.check_labels(self.num_classes, self.model.likelihood)

    @property
    def classifier(self) -> Classifier:
        return self.model.classifier

    @property
    def num_classes(self) -> int:
        return self.model.classifier.num_classes

    def features(self, data: Data | None = None) -> Features:
        """Backbone features of ``data`` (default: the fitting set), computed once per set.

        ``phi [N, D]``, ``logits [N, K]``, ``labels [N]`` on :attr:`device`. The fitting set goes
        through :attr:`feature_cache` when one is set.
        """
        data = self.data if data is None else data
        key = id(data)
        if key not in self._memo:
            cache = self.feature_cache if data is self.data else None
            feats = extract_features(self.model, data, self.batch_size, self.device, cache=cache)
            self._memo[key] = (data, feats)  # the Data is kept so its id stays unique
        return self._memo[key][1]

    def val_features(self) -> Features | None:
        """Features of the validation set (``None`` without one)."""
        return None if self.val is None else self.features(self.val)

    def stream(self) -> FeatureStream:
        """The fitting set's features batch by batch (one batch in memory; cached if configured).

        Streaming fits (Laplace) use it; once :meth:`features` holds the set, prefer that.
        """
        self._stream = FeatureStream(
            self.model, self.data, self.batch_size, self.device, cache=self.feature_cache
        )
        return self._stream

    def has_features(self, data: Data | None = None) -> bool:
        """Whether :meth:`features` already holds ``data``'s features (no backbone pass needed)."""
        return id(self.data if data is None else data) in self._memo

    def map_counts(self) -> tuple[float, int]:
        """``(MAP-correct, inputs)`` on the fitting set, from a pass already made where there was one
        (features or a finished stream), else one pass of the whole network (whole-network fits may
        never split features from the head)."""
        if self.has_features():
            feats = self.features()
            return float(map_correct(feats.logits, feats.labels).sum()), len(feats)
        if self._stream is not None and self._stream.n:
            return self._stream.correct, self._stream.n
        stats = logit_pass(self.model, self.data, self.batch_size, self.device)
        return stats.correct, stats.n

    @property
    def forward_seconds(self) -> float:
        """Seconds the backbone spent on the fitting set (0 when its features came from a cache)."""
        if self.has_features():
            return self.features().seconds
        return self._stream.seconds if self._stream is not None else 0.0
