"""Penultimate features ``φ(x)`` and logits, streamed batch by batch, with an optional sharded cache.

The backbone runs once per input set; everything downstream (curvature, predictives, links)
works on the features, which stay on the backbone's device (a GPU keeps them; nothing goes back
to the host per batch: the finiteness check and the MAP-accuracy count are summed on the device
and read once at the end of a pass). :class:`FeatureStream` yields them batch by batch (fitting consumes them
so, and never holds them all); :func:`extract_features` collects one pass into :class:`Features`
for the commands that need every score at once (predict, evaluate); :func:`logit_pass` runs the whole
network without the last-layer split, for whole-network fits. A cache is a directory of
safetensors shards written while the batches stream and read back the same way, keyed by the
checkpoint's SHA-256, the head, the data provenance and the precision, so a stale cache is never
reused.

Precision (``LoadedModel.precision``, :class:`~bayescli.options.Precision`): at ``bf16``/``fp16``
the backbone's forward runs under ``torch.autocast`` (conv nets in channels_last for the pass),
and ``φ`` is cast to float32 before the head, so the MAP logits are ``head(φ)`` in float32, the
same map every last-layer predictive applies. The first batch's checks (head split, output kind)
always run in float32: they compare to a float32 tolerance.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bayescli.data import Data
from bayescli.devices import synchronize
from bayescli.errors import BayescliError, LowAccuracyWarning
from bayescli.io import load_tensors, save_tensors
from bayescli.metrics.classification import low_accuracy_warning, map_correct
from bayescli.models.specs import Classifier, LoadedModel
from bayescli.options import Precision
from bayescli.progress import track

CACHE_FORMAT = "bayescli-features/1"
SHARD_BYTES = 64 * 2**20  # rows of φ and logits buffered before a shard is written
AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def parse_precision(precision: Precision | str) -> Precision:
    """``"bf16"`` → :attr:`Precision.BF16 <bayescli.options.Precision>`; an unknown name is a
    :class:`~bayescli.errors.BayescliError` naming the choices."""
    try:
        return Precision(precision)
    except ValueError:
        names = ", ".join(p.value for p in Precision)
        raise BayescliError(f"unknown precision '{precision}'; use one of {names}") from None


def check_precision(precision: Precision | str, device: torch.device | str) -> Precision:
    """``precision`` as a :class:`~bayescli.options.Precision`, refused where it cannot run.

    ``fp16`` is refused on the CPU: CPU autocast accepts it, but without half-precision units it
    is no faster there, and float16's range (max 65504) can overflow activations that bf16
    (float32's exponent) keeps; on the CPU bf16 is the low-precision choice.
    """
    chosen = parse_precision(precision)
    if chosen is Precision.FP16 and torch.device(device).type == "cpu":
        raise BayescliError(
            "precision fp16 runs on CUDA devices only; on the CPU use bf16 (float32's exponent range) or fp32"
        )
    return chosen


def resolve_precision(requested: Precision | str | None, recorded: dict) -> Precision:
    """The precision of a pass for a posterior whose metadata is ``recorded``: ``requested`` when
    given, else the one it was fitted at (files written before precisions existed: fp32), the way
    its preprocessing is reused."""
    return parse_precision(requested if requested is not None else recorded.get("precision") or "fp32")


def require_last_layer_precision(precision: Precision | str, what: str) -> None:
    """Raise unless ``precision`` is fp32 for ``what``, a posterior over the whole network: such
    posteriors run the network themselves (their fit's and predictive's forwards and curvature)
    in float32, so a low-precision feature pass would only change the MAP logits beside them."""
    if Precision(precision) is not Precision.FP32:
        raise BayescliError(
            f"{what} runs the whole network itself in float32; precision {Precision(precision).value} "
            "applies to the feature pass of last-layer posteriors: use fp32 or subset 'last-layer'"
        )


def autocast(precision: Precision, device: torch.device) -> AbstractContextManager:
    """The autocast context of one backbone forward (fp32: none). Entered per batch, never across a
    ``yield``: autocast is thread-wide state and the consumer's maths must stay in float32."""
    if precision is Precision.FP32:
        return nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def _is_conv_net(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in module.modules())


@contextmanager
def backbone_layout(module: nn.Module, precision: Precision) -> Iterator[bool]:
    """channels_last weights for a conv net's low-precision pass (the layout tensor cores and
    oneDNN's bf16 kernels want), restored afterwards; yields whether inputs should follow. fp32
    passes and nets without 2-D convolutions are left untouched, so their numbers do not move."""
    params = [p for p in module.parameters() if p.dim() == 4]
    # a net its owner keeps in another layout is left alone: restoring would make it contiguous
    convert = (
        precision is not Precision.FP32 and _is_conv_net(module) and all(p.is_contiguous() for p in params)
    )
    if not convert:
        yield False
        return
    module.to(memory_format=torch.channels_last)
    try:
        yield True
    finally:
        module.to(memory_format=torch.contiguous_format)


def _to_layout(xb: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return xb.contiguous(memory_format=torch.channels_last) if channels_last and xb.dim() == 4 else xb


@dataclass
class Features:
    """``phi [N, D]``, MAP ``logits [N, K]`` and ``labels [N]`` (or ``None``), on the device of the
    pass that produced them."""

    phi: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor | None
    seconds: float = 0.0

    def __len__(self) -> int:
        return int(self.phi.shape[0])


def check_input_shape(model: LoadedModel, data: Data) -> None:
    """Raise if ``data`` cannot be fed to ``model`` (recorded input shape, or a failed probe)."""
    problem = model.input_problem(tuple(data.input_shape), data.spec)
    if problem is not None:
        raise BayescliError(problem)
    expected = model.metadata.get("input_shape")
    if expected and list(data.input_shape) != list(expected):
        raise BayescliError(
            f"{data.spec} has inputs of shape {list(data.input_shape)} but {model.spec} expects "
            f"{list(expected)}; use data of the shape the model was trained on"
        )


def _check_first_batch(
    check: Callable[[torch.Tensor], object], model: LoadedModel, data: Data, xb: torch.Tensor
) -> None:
    """Run a classifier check on two rows of the first batch ``xb`` (on a whole batch its extra
    forwards would cost a batch's time); a network that cannot take these inputs is a one-line error."""
    try:
        check(xb[:2])
    except RuntimeError as exc:
        raise BayescliError(
            f"{model.spec} cannot process inputs of shape {list(data.input_shape)} "
            f"({str(exc).splitlines()[0][:160]}); check --data and --model"
        ) from None


def cache_key(model: LoadedModel, data: Data) -> str:
    """Hex digest identifying (checkpoint bytes, head, data provenance and size, precision)."""
    ident = {"sha256": model.sha256, "head": model.classifier.head_name, "data": data.info, "n": len(data)}
    precision = Precision(model.precision)
    if precision is not Precision.FP32:  # fp32 keys as before: caches written until now stay valid
        ident["precision"] = precision.value
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class FeatureBatch:
    """One batch: ``phi [B, D]``, MAP ``logits [B, K]``, ``labels [B]`` or ``None`` (on the device)."""

    phi: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor | None


class _ShardWriter:
    """Buffers feature batches into ~``SHARD_BYTES`` shards in a temporary directory beside the cache,
    renamed into place by :meth:`commit` (so a failed or interrupted pass leaves no cache)."""

    def __init__(self, path: Path, meta: dict) -> None:
        if path.exists() and not (path / "manifest.json").is_file():
            raise BayescliError(f"{path} exists and is not a bayescli feature cache; choose another path")
        if not path.parent.is_dir():
            raise BayescliError(f"output directory {path.parent} does not exist; create it first")
        self.path, self.meta = path, meta
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        self.buffer: list[FeatureBatch] = []
        self.rows, self.shards = 0, []

    def add(self, batch: FeatureBatch) -> None:
        self.buffer.append(batch)
        self.rows += len(batch.phi)
        row_bytes = 4 * (batch.phi.shape[1] + batch.logits.shape[1]) + 8
        if self.rows * row_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        # the one place features leave the device: a shard written to disk (~64 MiB at a time)
        tensors = {
            "phi": torch.cat([b.phi for b in self.buffer]).cpu(),
            "logits": torch.cat([b.logits for b in self.buffer]).cpu(),
        }
        if self.buffer[0].labels is not None:
            tensors["labels"] = torch.cat([b.labels for b in self.buffer]).cpu()
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_tensors(self.tmp / name, tensors, {})
        self.shards.append(name)
        self.buffer, self.rows = [], 0

    def commit(self, extra: dict) -> None:
        self._flush()
        manifest = {**self.meta, **extra, "shards": self.shards}
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, default=str))
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


class FeatureStream:
    """Passes of ``model``'s backbone over ``data``, yielding :class:`FeatureBatch` es in order.

    Each pass counts the inputs (``n``), MAP-correct predictions (``correct``, labelled data) and
    the seconds spent producing the batches (``seconds``; zero when read from the cache). The first
    batch verifies that ``head(features(x))`` reproduces the full forward pass; a non-finite
    feature anywhere ends the pass with an error after its last batch (checked on the device, read
    once). Batches are on ``device``, cached ones included. Memory: one batch (plus one cache shard
    of ≤ ``SHARD_BYTES`` when writing a cache). With ``whole_network`` (posteriors over all layers)
    a classifier whose logits are not linear in its head's weights yields ``phi [B, 0]`` and the
    network's own logits, and writes no cache.
    """

    def __init__(
        self,
        model: LoadedModel,
        data: Data,
        batch_size: int = 256,
        device: torch.device | str = "cpu",
        cache: str | Path | None = None,
        whole_network: bool = False,
    ) -> None:
        self.model, self.data, self.batch_size = model, data, batch_size
        self.whole_network = whole_network
        self.device = torch.device(device)
        self.precision = check_precision(model.precision, self.device)
        self.cache = Path(cache) if cache is not None else None
        self.key = cache_key(model, data)
        self._start()

    def _start(self) -> None:
        self.n, self.seconds, self.labelled = 0, 0.0, True
        self._correct = torch.zeros((), dtype=torch.float64, device=self.device)
        self._finite = torch.ones((), dtype=torch.bool, device=self.device)

    @property
    def correct(self) -> float:
        """MAP-correct predictions over the last pass (labelled data; multi-label: fractions of
        labels right, summed)."""
        return float(self._correct)

    @property
    def accuracy(self) -> float | None:
        """MAP accuracy over the last pass (``None`` for unlabelled data)."""
        return self.correct / self.n if self.labelled and self.n else None

    def _count(self, batch: FeatureBatch) -> None:
        self.n += len(batch.phi)
        self._finite &= torch.isfinite(batch.phi).all()
        if batch.labels is None:
            self.labelled = False
        else:
            self._correct += map_correct(batch.logits, batch.labels).sum()

    def _check_finite(self) -> None:
        if not bool(self._finite):
            raise BayescliError(
                f"{self.model.spec} produced non-finite features on {self.data.spec}; check the checkpoint"
            )

    def __iter__(self) -> Iterator[FeatureBatch]:
        self._start()
        manifest = _read_manifest(self.cache) if self.cache is not None else None
        if (
            manifest is not None
            and manifest.get("format") == CACHE_FORMAT
            and manifest.get("key") == self.key
        ):
            yield from self._read(manifest)
        else:
            yield from self._compute()

    def _read(self, manifest: dict) -> Iterator[FeatureBatch]:
        bad = manifest.get("unreadable_rows") or {}
        self.data.source.unreadable.update({int(r): tuple(v) for r, v in bad.items()})
        dev = self.device
        for name in manifest["shards"]:
            tensors, _ = load_tensors(self.cache / name)
            labels = tensors.get("labels")
            batch = FeatureBatch(
                tensors["phi"].to(dev), tensors["logits"].to(dev), None if labels is None else labels.to(dev)
            )
            self._count(batch)
            yield batch
        self._check_finite()
        if bad:
            self.data.info["unreadable"] = manifest["unreadable"]

    def _compute(self) -> Iterator[FeatureBatch]:
        check_input_shape(self.model, self.data)
        writer = None
        if self.cache is not None:
            meta = {"format": CACHE_FORMAT, "key": self.key, "checkpoint_sha256": self.model.sha256}
            meta["precision"] = self.precision.value
            writer = _ShardWriter(self.cache, {**meta, "data": self.data.info})
        clf = self.model.classifier.to(self.device).eval()
        data = self.data
        n_batches = (len(data) + self.batch_size - 1) // self.batch_size
        batches = track(data.batches(self.batch_size), n_batches, f"features {data.spec}")
        try:
            with backbone_layout(clf, self.precision) as channels_last:
                yield from self._batches(clf, batches, writer, channels_last)
            writer = None
        finally:
            if writer is not None:
                writer.discard()

    def _batches(
        self, clf: Classifier, batches: Iterator, writer: _ShardWriter | None, channels_last: bool
    ) -> Iterator[FeatureBatch]:
        """The pass itself (see :meth:`_compute`); commits ``writer`` after the last batch."""
        data, dev, low = self.data, self.device, self.precision is not Precision.FP32
        start = time.perf_counter()
        split = True
        for i, (xb, yb) in enumerate(batches):
            xb = xb.to(dev)
            if i == 0:
                if self.whole_network:
                    _check_first_batch(clf.check_output, self.model, data, xb)
                    split = clf.last_layer_exact
                if split:
                    _check_first_batch(clf.check_split, self.model, data, xb)
                elif writer is not None:  # no features to cache for a later last-layer fit
                    writer.discard()
                    writer = None
            with torch.inference_mode():
                if split and low:
                    with autocast(self.precision, dev):
                        phi = clf.features(_to_layout(xb, channels_last))
                    phi = phi.float()  # the head and all that follows see float32 φ
                    head = clf.head
                    logits = head(phi.to(head.weight.dtype))
                elif split:
                    phi = clf.features(xb)
                    logits = clf.head(phi)
                else:  # logits not linear in the head: whole-network posteriors need no φ
                    with autocast(self.precision, dev):
                        logits = clf(_to_layout(xb, channels_last))
                    phi = logits.new_zeros(len(xb), 0)
                batch = FeatureBatch(phi.float(), logits.float(), None if yb is None else yb.to(dev))
            self._count(batch)
            if writer is not None:
                writer.add(batch)
            self.seconds += time.perf_counter() - start
            yield batch
            start = time.perf_counter()
        synchronize(dev)
        self.seconds += time.perf_counter() - start
        self._check_finite()
        if writer is not None:
            skipped = {str(r): list(v) for r, v in data.unreadable.items()}
            writer.commit({"unreadable_rows": skipped, "unreadable": data.info.get("unreadable")})

    def pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(phi [B, D], labels [B] or None)`` per batch: what the streaming fit consumes."""
        for batch in self:
            yield batch.phi, batch.labels


@dataclass
class LogitPass:
    """What one pass of the whole network saw: inputs ``n``, MAP-``correct`` predictions (labelled
    data), whether all were ``labelled``, and the ``seconds`` it took."""

    n: int = 0
    correct: float = 0.0
    labelled: bool = True
    seconds: float = 0.0

    @property
    def accuracy(self) -> float | None:
        """MAP accuracy (``None`` for unlabelled data)."""
        return self.correct / self.n if self.labelled and self.n else None


def logit_pass(
    model: LoadedModel, data: Data, batch_size: int = 256, device: torch.device | str = "cpu"
) -> LogitPass:
    """Run the whole network over ``data`` once for its MAP accuracy, checking the inputs and the
    output (:meth:`~bayescli.models.classifier.Classifier.check_output`) on the first batch.

    For whole-network methods: unlike :class:`FeatureStream` it never needs the last-layer split,
    so it works when the logits are not linear in the head's weights. Memory: one batch.
    """
    check_input_shape(model, data)
    clf = model.classifier.to(device).eval()
    dev = torch.device(device)
    precision = check_precision(model.precision, dev)
    with backbone_layout(clf, precision) as channels_last:
        stats, correct, finite = _logit_batches(model, data, batch_size, dev, precision, channels_last)
    if not bool(finite):
        raise BayescliError(f"{model.spec} produced non-finite logits on {data.spec}; check the checkpoint")
    stats.correct = float(correct)
    return stats


def _logit_batches(
    model: LoadedModel,
    data: Data,
    batch_size: int,
    dev: torch.device,
    precision: Precision,
    channels_last: bool,
) -> tuple[LogitPass, torch.Tensor, torch.Tensor]:
    """:func:`logit_pass`'s loop: its stats, the MAP-correct count and the finiteness flag (both
    still on the device)."""
    clf = model.classifier
    correct = torch.zeros((), dtype=torch.float64, device=dev)
    finite = torch.ones((), dtype=torch.bool, device=dev)
    stats = LogitPass()
    n_batches = (len(data) + batch_size - 1) // batch_size
    start = time.perf_counter()
    for i, (xb, yb) in enumerate(track(data.batches(batch_size), n_batches, f"logits {data.spec}")):
        xb = xb.to(dev)
        if i == 0:
            _check_first_batch(clf.check_output, model, data, xb)
        with torch.inference_mode(), autocast(precision, dev):
            logits = clf(_to_layout(xb, channels_last))
        if precision is not Precision.FP32:
            logits = logits.float()
        stats.n += len(xb)
        finite &= torch.isfinite(logits).all()  # read once below, not per batch
        if yb is None:
            stats.labelled = False
        else:
            correct += map_correct(logits, yb).sum()
    synchronize(dev)
    stats.seconds = time.perf_counter() - start
    return stats, correct, finite


def extract_features(
    model: LoadedModel,
    data: Data,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    cache: str | Path | None = None,
    whole_network: bool = False,
) -> Features:
    """Run the backbone over ``data`` once and collect φ, logits and labels (``[N, ·]`` in memory).

    With ``cache`` (a directory), a matching cache is read instead, and a fresh one written
    otherwise (see :class:`FeatureStream`). Labels come with the batches, so they match the
    features even when unreadable images were skipped. ``whole_network`` (for posteriors over all
    layers): where the logits are not linear in the head's weights, ``phi`` is ``[N, 0]`` and the
    logits are the network's, instead of the last-layer split's error.

    On labelled data that is not :attr:`~bayescli.data.Data.shifted`, a MAP accuracy below 50% or
    within 2× of chance issues :class:`~bayescli.errors.LowAccuracyWarning` (the model is almost
    certainly fed wrongly: preprocessing, class order, head).
    """
    stream = FeatureStream(model, data, batch_size, device, cache, whole_network)
    batches = list(stream)
    if not batches:
        raise BayescliError(f"{data.spec} has no readable inputs")
    labels = None if not stream.labelled else torch.cat([b.labels for b in batches])
    accuracy = stream.accuracy
    if accuracy is not None and not data.shifted:
        message = low_accuracy_warning(
            accuracy, model.classifier.num_classes, data.spec, multilabel=model.likelihood == "bernoulli"
        )
        if message is not None:
            warnings.warn(LowAccuracyWarning(message, accuracy, data.spec), stacklevel=2)
    return Features(
        torch.cat([b.phi for b in batches]), torch.cat([b.logits for b in batches]), labels, stream.seconds
    )
