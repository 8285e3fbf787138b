"""Segmentation networks: a dense (per-position) head and the features it reads.

A segmentation network maps images ``[N, C_in, H, W]`` to logits ``[N, K, H, W]``: a backbone gives a
feature map ``φ [N, C, h, w]``, a 1×1 ``Conv2d`` ``C → K`` (the *dense head*) gives ``W φ + b`` at
every position, and operations that act on every channel alike and linearly in space (bilinear or
nearest upsampling, cropping, padding) bring the result to the output's resolution ``H × W``. Call
those operations ``T`` (a linear map over positions, the same for every channel). Then

    network(x) = T(W̃ φ̃) = W̃ T(φ̃),   φ̃ = [φ; 1] ``[N, C+1, h, w]``,

so at each output pixel the logits are the head ``W̃ [K, C+1]`` applied to the *carried features*
``T(φ̃)`` at that pixel: a classification head with pixels as rows. :meth:`DenseClassifier.dense_features`
computes ``T(φ̃)`` exactly by running the network once with the head's output replaced by ``φ̃``
(``T`` treats the ``C+1`` channels as it would treat ``K``); the bias channel is carried too, so
whatever ``T`` does to a constant map (zero padding, say) the logits stay exactly ``W̃ T(φ̃)``.

Anything after the head that is not such a ``T`` — a ReLU, a softmax across channels, another conv —
makes the logits non-linear in the head's weights; :meth:`DenseClassifier.check_split` compares
``W̃ T(φ̃)`` with the network's output and refuses with the name of the first such operation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from bayescli.errors import BayescliError, require
from bayescli.models.classifier import (
    HEAD_ATTRIBUTES,
    SPLIT_TOLERANCE,
    Classifier,
    _choose,
    _conv_as_linear,
    _describe_elements,
    _element,
    _elements,
    _is_conv1x1,
    _run_to_head,
)

# Torch functions that act on every channel alike and linearly in space (or only read shapes): they
# may follow a dense head. Used to name the culprit when the split check fails, not as the check.
_SPATIAL_LINEAR = frozenset(
    {
        "interpolate",
        "upsample",
        "upsample_bilinear",
        "upsample_nearest",
        "pad",
        "dropout",
        "dropout2d",
        "__getitem__",
        "narrow",
        "contiguous",
        "view",
        "reshape",
        "clone",
        "to",
        "float",
        "double",
        "type",
        "squeeze",
        "unsqueeze",
        "size",
        "dim",
        "__get__",
        "__len__",
        "detach",
        "dtype",
        "shape",
    }
)


def find_dense_head(net: nn.Module) -> str:
    """Name of the dense head of a segmentation net: a 1×1 ``Conv2d``.

    Tried in order: timm's ``get_classifier()``, the attributes
    :data:`~bayescli.models.classifier.HEAD_ATTRIBUTES` (torchvision's ``classifier``, a container
    whose last 1×1 conv is the head) and Hugging Face's ``decode_head.classifier``; otherwise the last
    1×1 conv registered. ``nn.Linear`` layers are never dense heads (decoders use them inside).
    """
    modules = dict(net.named_modules())
    candidates: list[str] = []
    get_classifier = getattr(net, "get_classifier", None)
    if callable(get_classifier):
        try:
            found = get_classifier()
        except TypeError:  # a method of that name with another signature: not timm's
            found = None
        candidates += [n for n, m in modules.items() if n and m is found][:1]
    candidates += [name for name in (*HEAD_ATTRIBUTES, "decode_head.classifier") if name in modules]
    for name in candidates:
        inner = [f"{name}.{sub}".rstrip(".") for sub, m in modules[name].named_modules() if _is_conv1x1(m)]
        if inner:
            return inner[-1]
    convs = [n for n, m in modules.items() if _is_conv1x1(m)]
    require(bool(convs), "the model has no 1×1 Conv2d layer to use as dense head; pass --head NAME")
    return convs[-1]


def _choose_dense(out: Any, output: int | str | None, num_classes: int) -> int | str:
    """The key of the logits element ``[N, K, H, W]`` of a structured output (``output`` if given)."""
    if output is not None:
        return _choose(out, output, num_classes)
    fits = [
        key
        for key, v in _elements(out)
        if isinstance(v, torch.Tensor) and v.dim() == 4 and v.shape[1] == num_classes
    ]
    kind = type(out).__name__
    require(
        len(fits) <= 1,
        f"the model returns a {kind} with {len(fits)} [N, {num_classes}, H, W] tensors, "
        f"{', '.join(repr(k) for k in fits)}; pass --output INDEX|KEY to choose the logits",
    )
    require(
        bool(fits),
        f"the model returns a {kind} without a [N, {num_classes}, H, W] tensor ({_describe_elements(out)}); "
        "pass --output INDEX|KEY of the logits",
    )
    return fits[0]


class _FlowTracer(TorchFunctionMode):
    """Records the torch functions applied to tensors computed from the dense head's output, in order
    (their ``__name__``), during one forward pass."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.derived: dict[int, torch.Tensor] = {}  # id → tensor, kept alive so ids stay unique
        self.calls: list[str] = []
        self._handle = head.register_forward_hook(self._seed)

    def _seed(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        self.derived[id(out)] = out

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        result = func(*args, **(kwargs or {}))
        flat = list(args) + list((kwargs or {}).values())
        flat += [a for x in flat if isinstance(x, (list, tuple)) for a in x]
        if self.derived and any(isinstance(a, torch.Tensor) and id(a) in self.derived for a in flat):
            self.calls.append(getattr(func, "__name__", str(func)))
            outs = result if isinstance(result, (list, tuple)) else (result,)
            for o in outs:
                if isinstance(o, torch.Tensor):
                    self.derived[id(o)] = o
        return result


class DenseClassifier(nn.Module):
    """A segmentation network with its input normalisation, its logits ``[N, K, H, W]`` and a located
    dense head (module docs).

    ``output`` selects the logits among a tuple/list (index), dict (key, e.g. torchvision's ``"out"``)
    or dataclass output; by default the one ``[N, K, H, W]`` tensor. ``size``, when given, resizes the
    output bilinearly (``align_corners=False``) to ``(H, W)`` — the masks' resolution — as Hugging
    Face's segmentation losses do with logits at a quarter of the input's size; being linear in
    space, it is part of ``T``. Run :meth:`check_split` on a few inputs before fitting on
    :meth:`dense_features`.
    """

    def __init__(
        self,
        net: nn.Module,
        head_name: str | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        output: int | str | None = None,
        size: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.head_name = find_dense_head(net) if head_name is None else head_name
        modules = dict(net.named_modules())
        require(self.head_name in modules, f"no module named '{self.head_name}' in the model; see --head")
        layer = modules[self.head_name]
        if not _is_conv1x1(layer):
            conv = isinstance(layer, nn.Conv2d)
            kernel = f" with a {'×'.join(map(str, layer.kernel_size))} kernel" if conv else ""
            raise BayescliError(
                f"dense head '{self.head_name}' is a {type(layer).__name__}{kernel}, not a 1×1 Conv2d "
                "(stride 1, no padding or groups); pass --head NAME of the per-position classifier"
            )
        self.output = output
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self._resolved = False
        self._problem: str | None = None
        self.register_buffer("mean", torch.tensor(mean if mean else [0.0]))
        self.register_buffer("std", torch.tensor(std if std else [1.0]))

    @classmethod
    def from_classifier(
        cls, classifier: Classifier, head_name: str | None = None, size: tuple[int, int] | None = None
    ) -> DenseClassifier:
        """The segmentation net a :class:`~bayescli.models.classifier.Classifier` wraps (as
        :func:`~bayescli.models.specs.load_classifier` loads ``builtin:``, ``torchvision:``, ``py:``
        specs and their checkpoints), with its normalisation and ``--output``; the classification head
        it found is kept if it is a 1×1 conv (else :func:`find_dense_head`; ``head_name`` overrides)."""
        net = classifier.network
        if head_name is None:
            head_name = classifier.head_name
            if not _is_conv1x1(net.get_submodule(head_name)):
                head_name = find_dense_head(net)
        mean, std = classifier.mean.tolist(), classifier.std.tolist()
        dense = cls(net, head_name, mean, std, output=classifier.output, size=size)
        return dense.to(classifier.mean.device)

    def describe(self) -> dict:
        """JSON-ready facts: ``head`` (its name), ``head_kind`` ``"conv1x1-dense"``, ``feature_dim`` C,
        ``num_classes`` K, ``output`` (the selected element's index or key) and ``output_size``."""
        return {
            "head": self.head_name,
            "head_kind": "conv1x1-dense",
            "feature_dim": self.feature_dim,
            "num_classes": self.num_classes,
            "output": self.output,
        }

    # -- the parts --------------------------------------------------------------------------------

    @property
    def layer(self) -> nn.Conv2d:
        """The head as the network holds it (a 1×1 ``Conv2d``)."""
        return self.net.get_submodule(self.head_name)

    @property
    def num_classes(self) -> int:
        return int(self.layer.out_channels)

    @property
    def feature_dim(self) -> int:
        """``C``, the channels of the feature map the head reads."""
        return int(self.layer.in_channels)

    @property
    def head_bias(self) -> bool:
        return self.layer.bias is not None

    @property
    def head(self) -> nn.Linear:
        """The head as an ``nn.Linear`` ``C → K`` sharing the conv's weights (read-only views)."""
        return _conv_as_linear(self.layer)

    def weight_aug(self) -> torch.Tensor:
        """``W̃ = [W, b]`` ``[K, C+1]`` (``W`` ``[K, C]`` for a head without bias), detached."""
        w = self.layer.weight.detach().reshape(self.num_classes, self.feature_dim)
        b = self.layer.bias
        return torch.cat([w, b.detach()[:, None]], 1) if b is not None else w.clone()

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``(x − mean) / std`` per channel of images ``[N, C, H, W]``."""
        return (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)

    # -- forward ----------------------------------------------------------------------------------

    def _select(self, out: Any) -> torch.Tensor:
        """The logits element of the network's output; the first call settles which it is."""
        if not self._resolved:
            if isinstance(out, torch.Tensor):
                require(
                    self.output is None,
                    f"--output {self.output} was given but the model returns one tensor "
                    f"{list(out.shape)}; drop --output",
                )
            else:
                self.output = _choose_dense(out, self.output, self.num_classes)
            self._resolved = True
        z = out if self.output is None else _element(out, self.output)
        require(
            isinstance(z, torch.Tensor) and z.dim() == 4,
            f"the model's output {list(getattr(z, 'shape', []))} is not a [N, K, H, W] map; "
            "a segmentation net must return per-pixel logits",
        )
        if self.size is not None and tuple(z.shape[-2:]) != self.size:
            z = nn.functional.interpolate(z, size=self.size, mode="bilinear", align_corners=False)
        return z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, K, H, W]`` of pixel-space images ``x [N, C_in, H_in, W_in]``."""
        return self._select(self.net(self.normalise(x)))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The head's input ``φ [N, C, h, w]`` at the head's resolution; the forward stops there."""
        phi = _run_to_head(self.net, self.layer, self.normalise(x), output=False)
        require(phi is not None, f"the head '{self.head_name}' was never called in forward")
        return phi

    def dense_features(self, x: torch.Tensor, project: torch.Tensor | None = None) -> torch.Tensor:
        """The carried features ``T(φ̃) [N, C+1, H, W]`` (``T(φ) [N, C, H, W]`` for a head without
        bias) at the output's resolution: ``W̃ T(φ̃)`` at each pixel is the network's logits there.

        ``project [C+1, M]`` carries ``T(φ̃ᵀ project) [N, M, H, W]`` instead — the same as projecting
        ``T(φ̃)`` at every output pixel (``T`` commutes with any per-position linear map), at the
        head's resolution: ``(H·W)/(h·w)`` times fewer multiplications (a kron predictive's
        ``[W̃ᵀ | Q_A]``, say).

        One forward pass, with the head's output replaced by ``φ̃`` (or its projection). Raises if the
        operations after the head cannot carry that many channels (they depend on ``K``: not a
        ``T``), and refuses models :meth:`check_split` found non-linear.
        """
        require(self._problem is None, self._problem or "")
        rows = self.feature_dim + int(self.head_bias)
        require(
            project is None or (project.dim() == 2 and project.shape[0] == rows),
            f"a projection of the carried features must be [{rows}, M], got "
            f"{list(project.shape) if project is not None else None}",
        )
        if not self._resolved:
            with torch.no_grad():
                self.forward(x[:1])

        def carry(_module: nn.Module, args: tuple, _out: torch.Tensor) -> torch.Tensor:
            phi = args[0]
            phi = torch.cat([phi, torch.ones_like(phi[:, :1])], 1) if self.head_bias else phi
            if project is None:
                return phi
            return (phi.permute(0, 2, 3, 1) @ project.to(phi)).permute(0, 3, 1, 2)

        handle = self.layer.register_forward_hook(carry)
        try:
            carried = self.forward(x)
        except (RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BayescliError(
                f"the operations after the dense head '{self.head_name}' depend on its {self.num_classes} "
                f"output channels ({first}); last-layer methods need per-channel upsampling/cropping only"
            ) from None
        finally:
            handle.remove()
        want = rows if project is None else project.shape[1]
        require(
            carried.shape[1] == want,
            f"the operations after the dense head '{self.head_name}' change its channels "
            f"({want} in, {carried.shape[1]} out); last-layer methods need per-channel "
            "upsampling/cropping only",
        )
        return carried

    # -- checks -----------------------------------------------------------------------------------

    def check_split(self, x: torch.Tensor) -> float:
        """Verify on a few pixel-space images ``x [n, ...]`` that ``W̃ T(φ̃)`` reproduces the network's
        logits at every pixel; returns the max abs difference.

        Raises :class:`BayescliError` when it does not (to ``SPLIT_TOLERANCE`` times the logits' scale),
        naming the first operation applied to the head's output that is not linear in space and
        channel-wise (a module's or a torch function's name), and for non-finite outputs.
        """
        tracer = _FlowTracer(self.layer)
        with torch.no_grad():
            with tracer:
                full = self.forward(x)
            require(
                full.shape[1] == self.num_classes,
                f"the model's output {list(full.shape)} has {full.shape[1]} channels but the dense head "
                f"'{self.head_name}' has {self.num_classes}; pass --head NAME of the final 1×1 conv",
            )
            if not torch.isfinite(full).all():
                raise BayescliError(
                    "the model produces non-finite logits (NaN or inf) on these inputs; "
                    "check the checkpoint and the input scaling"
                )
            self._problem = None
            carried = self.dense_features(x)
            split = torch.einsum("kd,ndhw->nkhw", self.weight_aug().to(carried), carried)
        full64, split64 = full.double(), split.double()
        tol = SPLIT_TOLERANCE * max(1.0, full64.abs().max().item(), split64.abs().max().item())
        diff = (full64 - split64).abs().max().item()
        if diff <= tol:
            return diff
        culprits = [c for c in tracer.calls if c not in _SPATIAL_LINEAR]
        what = (
            f"'{culprits[0]}' is applied to the output of the dense head '{self.head_name}'"
            if culprits
            else f"an operation after the dense head '{self.head_name}' is not linear in space"
        )
        self._problem = (
            f"last-layer methods need logits that are linear in the head's weights, but {what} "
            f"(W̃·T(φ̃) differs from the output by {diff:.2e} > {tol:.1e}); use a model whose head is "
            "followed only by upsampling/cropping, or pass --head NAME"
        )
        raise BayescliError(self._problem)


def as_dense(
    classifier: Classifier, x: torch.Tensor, name: str = "the model", check_split: bool = True
) -> DenseClassifier:
    """The segmentation net ``classifier`` wraps, checked on pixel-space images ``x [n, ...]``:
    refuses, in one line, a network whose output holds no per-pixel logits ``[n, K, H, W]`` (a
    classifier) before looking for a dense head, then (``check_split``) a failed split
    (:meth:`DenseClassifier.check_split`)."""
    with torch.no_grad():
        out = classifier.network(classifier.normalise(x))
    maps = [v for _, v in _elements(out)] if not isinstance(out, torch.Tensor) else [out]
    if not any(isinstance(v, torch.Tensor) and v.dim() == 4 for v in maps):
        shape = list(out.shape) if isinstance(out, torch.Tensor) else _describe_elements(out)
        raise BayescliError(
            f"{name} is not a segmentation model: it returns {shape}, not per-pixel logits [N, K, H, W]; "
            "segmentation data (seg:) needs a segmentation checkpoint"
        )
    dense = DenseClassifier.from_classifier(classifier)
    if check_split:
        dense.check_split(x)
    return dense
