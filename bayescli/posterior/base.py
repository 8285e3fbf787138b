"""One interface for every weight posterior (Laplace, MNVI, FSVI, Dirichlet fVI, …).

A posterior turns what the backbone produced into the currency of DESIGN §1, a
:class:`~bayescli.posterior.gaussian.LogitGaussian` per input:

* last-layer posteriors (``needs_inputs`` false) read penultimate features ``phi [N, D]``
  through :meth:`Posterior.logit_gaussian`;
* whole-network posteriors read pixel-space inputs ``x [N, ...]`` through
  :meth:`Posterior.logit_gaussian_inputs` (they need the classifier).

Every posterior is written to one file format — safetensors plus JSON metadata — whose
``method`` entry names the class that reads it back. :func:`load_posterior` dispatches on it
through the method registry (:mod:`bayescli.fitting.registry`, ``module:Class`` strings, so start-up
stays light); adding a method is one entry there.
"""

from __future__ import annotations

import copy
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from bayescli._version import __version__
from bayescli.errors import BayescliError
from bayescli.io import load_tensors, save_tensors
from bayescli.options import Link, Subset
from bayescli.posterior.selection import Selection

if TYPE_CHECKING:
    from bayescli.data import Data
    from bayescli.models.preprocess import PreprocessOverrides
    from bayescli.models.specs import Classifier, LoadedModel
    from bayescli.posterior.gaussian import LogitGaussian

FORMAT = "bayescli-posterior"
FORMAT_VERSION = 1

# Metadata keys every posterior file carries, written by Posterior.metadata().
COMMON_KEYS = frozenset({"format", "format_version", "bayescli_version", "method", "subset"})
# Metadata keys written from ``Posterior.selection`` (and read back into it).
SELECTION_KEYS = ("selection", "validated", "prior")


class Posterior(ABC):
    """A distribution over (some of) a classifier's weights, and its logit Gaussians.

    Subclasses set ``method`` (the file's ``method`` entry) and implement the predictive they
    support, :meth:`tensors`, :meth:`own_metadata` and :meth:`from_file`. ``meta`` holds the
    provenance shared by all methods (model spec, checkpoint path and sha256, preprocessing,
    data spec, class count, fit seconds, …), written verbatim into the file. ``selection`` is how
    the method's key setting was set (every fit sets it); only :meth:`metadata` writes it to the
    file, as the ``selection``, ``validated`` and (methods with a prior precision δ) ``prior``
    entries, and loading reads them back into it.
    """

    method: ClassVar[str]
    # the Python API's predict, installed by bayescli.api when it is imported (see predict())
    api_predict: ClassVar[Callable[..., object] | None] = None
    # a posterior whose native output is a Dirichlet α (its logit Gaussian is that Dirichlet's
    # Gaussian image): its predictive is the Dirichlet mean, the default link ``bridge``
    native_dirichlet: ClassVar[bool] = False
    # the likelihood of the classifier's outputs: ``categorical`` (softmax) or ``bernoulli`` (a
    # sigmoid per class, multi-label); the registry's ``likelihoods`` say which methods fit which
    likelihood: str = "categorical"
    subset: Subset
    meta: dict
    path: Path | None = None  # the file it was read from, if any
    model: LoadedModel | None = None  # the model it was fitted on or loaded with (Python API)
    fit_data: Data | None = None  # its fitting and validation sets, when fitted in this process
    val_data: Data | None = None
    selection: Selection | None = None

    @property
    def needs_inputs(self) -> bool:
        """Whether predictions need pixel-space inputs (whole-network posteriors) or features."""
        return self.subset is not Subset.LAST_LAYER

    @property
    def default_link(self) -> Link:
        """The link of this posterior's own predictive: the bridge (the Dirichlet mean) for a
        native-Dirichlet posterior, else probit."""
        return Link.BRIDGE if self.native_dirichlet else Link.PROBIT

    @property
    def label(self) -> str:
        """Short description for tables, e.g. ``laplace last-layer kron``."""
        return f"{self.method} {self.subset.value}"

    def summary(self) -> dict:
        """Scalar facts for summary tables and reports (method-specific)."""
        return {k: v for k, v in self.own_metadata().items() if isinstance(v, str | int | float | bool)}

    # -- predictives --------------------------------------------------------------------------

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """Logit Gaussian for last-layer features ``phi [N, D]`` → mean/var ``[N, K]``."""
        raise BayescliError(f"this {self.label} posterior predicts from inputs, not features")

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """Logit Gaussian for pixel-space inputs ``x [N, ...]`` (whole-network posteriors)."""
        raise BayescliError(f"this {self.label} posterior predicts from features, not inputs")

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """BNN predictive: logits ``[M, N, K]`` of the network at ``M`` weight draws."""
        raise BayescliError(f"{self.method} posteriors have no BNN predictive; use the glm predictive")

    def predict(self, data: object, **options: object) -> object:
        """Predictive probabilities on ``data`` (a DataLoader, ``(x, y)`` tensors, ``Data`` or a
        spec) → ``Prediction`` with ``probs [N, K]``, ``alpha``, ``logit_mean``/``logit_var [N, K]``.

        The Python API's convenience, :func:`bayescli.api.predict` (which holds the options). A
        prediction on raw data needs the feature and predictive layers above this one, so the API
        module installs itself here when imported (:data:`api_predict`); ``import bayescli`` and
        every top-level name import it.
        """
        if Posterior.api_predict is None:
            raise BayescliError(
                "Posterior.predict is the Python API's: import bayescli.api (bayescli.fit, bayescli.load "
                "and every top-level name do), or call bayescli.api.predict(posterior, data)"
            )
        return Posterior.api_predict(self, data, **options)

    # -- files --------------------------------------------------------------------------------

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The arrays the posterior file stores."""

    @abstractmethod
    def own_metadata(self) -> dict:
        """Method-specific metadata (hyperparameters, selection curves, …)."""

    @classmethod
    @abstractmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> Posterior:
        """Rebuild the posterior from what :meth:`save` wrote (``meta`` is the whole header)."""

    def metadata(self) -> dict:
        """The file's metadata: the common keys, :meth:`own_metadata`, ``meta`` and the entries
        :meth:`selection_metadata` derives from ``selection``."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "bayescli_version": __version__,
            "method": self.method,
            "subset": self.subset.value,
            **self.own_metadata(),
            **self.meta,
            **self.selection_metadata(),
        }

    def selection_metadata(self) -> dict:
        """The file entries of :attr:`selection`: ``selection`` (its record), ``validated`` and,
        where the selection describes a prior precision, ``prior`` (``value``: this posterior's δ,
        then the selection's ``prior`` block); empty without a selection."""
        sel = self.selection
        if sel is None:
            return {}
        out = {"selection": sel.record(), "validated": sel.validated}
        if sel.prior is not None:
            out["prior"] = {"value": float(self.prior_precision), **sel.prior}
        return out

    @property
    def prior_record(self) -> dict:
        """The file's ``prior`` entry (value, method, …): from :attr:`selection` or, for a posterior
        fitted outside a method's ``fit`` (or an older file), as ``meta`` holds it; ``{}`` if none."""
        return self.selection_metadata().get("prior") or self.meta.get("prior") or {}

    def save(self, path: str | Path) -> None:
        """Write tensors and metadata to ``.safetensors`` (atomically)."""
        save_tensors(path, self.tensors(), self.metadata())

    def to(self, device: torch.device | str) -> Posterior:
        """This posterior with every tensor on ``device``: the one place that moves a posterior.

        ``self`` when every tensor is already there (as ``Tensor.to``); otherwise the posterior
        rebuilt from its moved :meth:`tensors` and :meth:`metadata` by :meth:`from_file`, the
        path :func:`load_posterior` takes, so what it derives from them (eigendecompositions,
        Cholesky factors) is computed on ``device``. The model, fitting and validation sets, file
        path and ``meta`` are kept.
        """
        device = torch.device(device)
        if all(_on(t, device) for t in self.tensors().values()):
            return self
        post = _rebuild(type(self), self.tensors(), self.metadata(), self.path, device)
        post.meta = copy.deepcopy(self.meta)
        post.selection = copy.deepcopy(self.selection)
        post.model, post.fit_data, post.val_data = self.model, self.fit_data, self.val_data
        post.path = self.path
        return post

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> Posterior:
        """Read a posterior file onto ``device``; it must hold this class's method."""
        post = load_posterior(path, device)
        if not isinstance(post, cls):
            raise BayescliError(f"{path} holds a {post.method} posterior, not {cls.method}")
        return post

    @staticmethod
    def provenance(meta: dict, own_keys: set[str] | frozenset[str]) -> dict:
        """The shared provenance of a file header: everything but the common and ``own_keys``."""
        return {k: v for k, v in meta.items() if k not in COMMON_KEYS and k not in own_keys}

    # -- the model it belongs to --------------------------------------------------------------

    def load_model(
        self,
        checkpoint: str | Path | None = None,
        *,
        model: str | None = None,
        trust_model_code: bool = False,
        preprocess: PreprocessOverrides | None = None,
    ) -> LoadedModel:
        """Re-create the network the posterior was fitted on, verifying the checkpoint's hash.

        ``checkpoint`` overrides the recorded path (the hash must still match). The file's model
        spec is used as read unless it names ``py:`` code: that is imported only when ``model``
        names the same spec or ``trust_model_code`` is set (a shared file must not choose code to
        run). Recorded factory arguments are passed back under the rules for arguments from files.
        ``preprocess`` overrides parts of the recorded input recipe (e.g. ``resize`` for images of
        another size); the returned model's ``preprocess`` is the recipe used.
        """
        from bayescli.models.args import check_file_spec
        from bayescli.models.preprocess import Preprocess
        from bayescli.models.specs import load_classifier

        for key in ("model", "checkpoint", "checkpoint_sha256"):
            if key not in self.meta:
                raise BayescliError(f"the posterior file lacks '{key}'; refit it")
        where = getattr(self, "path", None) or "the posterior file"
        spec = check_file_spec(str(self.meta["model"]), model, trust_model_code, where)
        loaded = load_classifier(
            spec,
            checkpoint or self.meta["checkpoint"],
            self.meta.get("head"),
            self.meta["checkpoint_sha256"],
            self.meta.get("checkpoint_key"),
            Preprocess.from_meta(self.meta["preprocess"]) if self.meta.get("preprocess") else None,
            file_args=self.meta.get("model_args"),
            output=self.meta.get("output"),
            # a checkpoint saved elsewhere was declared multi-label at fit time (--likelihood); the
            # checkpoint hash above pins the file, so only a declaration is passed back, never a default
            likelihood=self.likelihood if self.likelihood != "categorical" else None,
            preprocess_overrides=preprocess,
        )
        if loaded.classifier.num_classes != self.meta.get("num_classes", loaded.classifier.num_classes):
            raise BayescliError(
                f"the posterior has {self.meta['num_classes']} classes but the model has "
                f"{loaded.classifier.num_classes}; use the matching checkpoint"
            )
        return loaded


def posterior_class(method: str) -> type[Posterior]:
    """The class registered for ``method`` (imported on first use)."""
    from bayescli.fitting.registry import posterior_class_name

    module, _, name = posterior_class_name(method).partition(":")
    return getattr(importlib.import_module(module), name)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device`` (``cuda`` without an index: any CUDA device)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _rebuild(
    cls: type[Posterior],
    tensors: dict[str, torch.Tensor],
    meta: dict,
    path: Path | None,
    device: torch.device,
) -> Posterior:
    """``cls.from_file`` on ``tensors`` moved to ``device`` (:meth:`Posterior.to` and
    :func:`load_posterior` share it), its ``selection`` read back from the file's entries."""
    post = cls.from_file({k: v.to(device) for k, v in tensors.items()}, meta, path)
    post.selection, post.meta = read_selection(post.meta)
    return post


def read_selection(meta: dict) -> tuple[Selection | None, dict]:
    """The :class:`Selection` a file's metadata records and the metadata without the entries
    it is written as (:data:`SELECTION_KEYS`); ``(None, meta)`` for a file without a
    ``selection`` entry (its ``prior`` entry, if any, stays in the metadata)."""
    record = meta.get("selection")
    if not isinstance(record, dict):
        return None, meta
    prior = meta.get("prior")
    prior = {k: v for k, v in prior.items() if k != "value"} if isinstance(prior, dict) else None
    return Selection.from_record(record, prior), {k: v for k, v in meta.items() if k not in SELECTION_KEYS}


def load_posterior(path: str | Path, device: torch.device | str = "cpu") -> Posterior:
    """Read any posterior file, dispatching on its ``method`` entry, onto ``device`` (what the
    posterior derives from its tensors — eigendecompositions, Cholesky factors — is computed there)."""
    tensors, meta = load_tensors(path)
    if meta.get("format") != FORMAT:
        raise BayescliError(f"{path} is not a bayescli posterior file; create one with fit-laplace or fit-vi")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise BayescliError(
            f"{path} was written by a newer bayescli (format {meta['format_version']}); upgrade"
        )
    cls = posterior_class(str(meta.get("method", "laplace")))
    try:
        post = _rebuild(cls, tensors, meta, Path(path), torch.device(device))
    except (KeyError, ValueError) as exc:
        raise BayescliError(f"{path} is missing or has malformed entries ({exc}); refit it") from None
    post.path = Path(path)  # named in messages about the file (e.g. the model code it names)
    return post
