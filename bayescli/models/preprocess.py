"""Input preprocessing as part of the model: resize, centre crop (pixel space), then normalise.

A pretrained network expects its inputs prepared as in training. :class:`Preprocess` records that
recipe; :func:`resolve_preprocess` builds it from a preset (``timm``: the named model's pretrained
config; ``torchvision``: the named weights' transforms; ``imagenet``; ``cifar``; ``none``) and
explicit overrides. The pixel part (:meth:`Preprocess.pixels`: shorter side resized to ``resize``
with the aspect ratio kept, then a centre ``crop × crop``) runs on the data, before any shift
suite, so rotations, corruptions and FGSM act on what the model sees in pixel space; the
normalisation ``(x − mean)/std`` lives in the model wrapper. Posterior files record the recipe and
later commands reuse it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from bayescli.errors import BayescliError, ResizeWarning
from bayescli.options import Interpolation, PreprocessPreset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# CIFAR-10 training-set channel statistics (the true per-channel std, not the widely copied
# 0.2023/0.1994/0.2010, which is a std of per-image means).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


@dataclass(frozen=True)
class Preprocess:
    """``resize`` (shorter side, px), ``crop`` (square, px) in pixel space; ``mean``/``std`` per channel."""

    source: str = "none"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    resize: int | None = None
    crop: int | None = None
    interpolation: Interpolation = Interpolation.BILINEAR

    @property
    def changes_pixels(self) -> bool:
        return self.resize is not None or self.crop is not None

    def pixels(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, C, H, W]`` in [0, 1] → resized, centre-cropped ``[N, C, crop, crop]`` in [0, 1]."""
        if not self.changes_pixels:
            return x
        if x.dim() != 4:
            raise BayescliError(f"--resize/--crop need image inputs [N, C, H, W], got {list(x.shape)}")
        from torchvision.transforms.v2 import functional as tvf

        mode = getattr(tvf.InterpolationMode, self.interpolation.name)
        if self.resize is not None:
            x = tvf.resize(x.float(), [self.resize], interpolation=mode, antialias=True)
        if self.crop is not None:
            if min(x.shape[-2:]) < self.crop:
                raise BayescliError(
                    f"cannot centre-crop {self.crop} px from {tuple(x.shape[-2:])} images; "
                    f"set --resize ≥ {self.crop}"
                )
            x = tvf.center_crop(x, [self.crop])
        return x.clamp_(0.0, 1.0)

    def resize_warning(self, shape: tuple[int, ...], downsampling: bool = True) -> str | None:
        """A one-line warning when :meth:`pixels` scales images of ``shape`` (``[C, H, W]``) by more
        than 2× (up, or down with ``downsampling``), else ``None``: a recipe made for images of another
        size (an ImageNet preset on 32-px inputs) costs accuracy, and upsampling also time."""
        if self.resize is None or len(shape) != 3:
            return None
        side = min(int(shape[-2]), int(shape[-1]))
        factor = self.resize / side
        if 0.5 <= factor <= 2.0 or not (downsampling or factor > 1):
            return None
        how = f"upsamples them {factor:.1f}×" if factor > 1 else f"downsamples them {1 / factor:.1f}×"
        crop = f", then crops {self.crop} px" if self.crop is not None else ""
        return (
            f"the '{self.source}' preprocessing resizes {shape[-2]}×{shape[-1]} inputs to {self.resize} px "
            f"on the shorter side{crop}: it {how}, a recipe for images of another size; set --resize/--crop "
            "for these inputs, or --preprocess none"
        )

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The input shape ``[C, H, W]`` after :meth:`pixels` (worked out on one blank channel)."""
        if not self.changes_pixels:
            return tuple(shape)
        probe = torch.zeros(1, 1, *shape[1:]) if len(shape) == 3 else torch.zeros(1, *shape)
        return (shape[0], *self.pixels(probe).shape[-2:])

    def to_meta(self) -> dict:
        d = asdict(self)
        d["interpolation"] = self.interpolation.value
        return d

    @classmethod
    def from_meta(cls, meta: dict | None) -> Preprocess:
        if not meta:
            return cls()
        d = dict(meta)
        for key in ("mean", "std"):
            d[key] = tuple(d[key]) if d.get(key) is not None else None
        d["interpolation"] = Interpolation(d.get("interpolation", "bilinear"))
        return cls(**d)


def warn_resize(
    pre: Preprocess, shape: tuple[int, ...], downsampling: bool = True, stacklevel: int = 3
) -> None:
    """Issue :class:`~bayescli.errors.ResizeWarning` when ``pre`` scales ``shape`` by more than 2×."""
    message = pre.resize_warning(shape, downsampling)
    if message is not None:
        import warnings

        warnings.warn(ResizeWarning(message), stacklevel=stacklevel)


def _timm(model_name: str) -> Preprocess:
    import timm

    cfg = timm.get_pretrained_cfg(model_name)
    if cfg is None:
        raise BayescliError(
            f"timm has no pretrained config for '{model_name}'; pass --mean/--std/--resize/--crop"
        )
    size = int(cfg.input_size[-1])
    known = {i.value for i in Interpolation}
    interp = cfg.interpolation if cfg.interpolation in known else "bilinear"
    return Preprocess(
        f"timm:{model_name}",
        tuple(cfg.mean),
        tuple(cfg.std),
        int(math.floor(size / cfg.crop_pct)),
        size,
        Interpolation(interp),
    )


def _torchvision(model_name: str) -> Preprocess:
    import torchvision

    try:
        weights = torchvision.models.get_model_weights(model_name).DEFAULT
    except (ValueError, KeyError) as exc:
        raise BayescliError(
            f"torchvision has no weights for '{model_name}' ({exc}); pass --mean/--std"
        ) from None
    t = weights.transforms()
    return Preprocess(
        f"torchvision:{weights}",
        tuple(t.mean),
        tuple(t.std),
        int(t.resize_size[0]),
        int(t.crop_size[0]),
        Interpolation(t.interpolation.value),
    )


def resolve_preprocess(
    preset: PreprocessPreset | str | None,
    model_spec: str,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    resize: int | None = None,
    crop: int | None = None,
    interpolation: Interpolation | str | None = None,
) -> Preprocess | None:
    """The preset for ``model_spec`` (``kind:name``) with explicit values overriding it.

    Returns ``None`` when nothing was asked for: the checkpoint's own recipe (from ``bayescli
    train``) or none applies.
    """
    if preset is None and all(v is None for v in (mean, std, resize, crop, interpolation)):
        return None
    kind, _, name = model_spec.partition(":")
    preset = PreprocessPreset(preset) if preset is not None else PreprocessPreset.NONE
    if preset is PreprocessPreset.TIMM:
        if kind != "timm":
            raise BayescliError(f"--preprocess timm needs a timm:NAME model, not {model_spec}")
        base = _timm(name)
    elif preset is PreprocessPreset.TORCHVISION:
        if kind != "torchvision":
            raise BayescliError(f"--preprocess torchvision needs a torchvision:NAME model, not {model_spec}")
        base = _torchvision(name)
    elif preset is PreprocessPreset.IMAGENET:
        base = Preprocess("imagenet", IMAGENET_MEAN, IMAGENET_STD, 256, 224, Interpolation.BILINEAR)
    elif preset is PreprocessPreset.CIFAR:
        base = Preprocess("cifar", CIFAR_MEAN, CIFAR_STD)
    else:
        base = Preprocess("none")
    if (mean is None) != (std is None) and (base.mean is None):
        raise BayescliError("pass --mean and --std together")
    for name_, values in (("mean", mean), ("std", std)):
        if values is not None and (not values or (name_ == "std" and min(values) <= 0)):
            raise BayescliError(f"--{name_} needs one positive value per channel, got {values}")
    overrides = {
        k: v for k, v in {"mean": mean, "std": std, "resize": resize, "crop": crop}.items() if v is not None
    }
    if interpolation is not None:
        overrides["interpolation"] = Interpolation(interpolation)
    if overrides:
        base = replace(base, source=f"{base.source}+overrides", **overrides)
    return base


@dataclass(frozen=True)
class PreprocessOverrides:
    """Changes to a recorded recipe asked for at prediction time (``predict``/``evaluate``/
    ``topk``/``conformal`` ``--preprocess/--mean/--std/--resize/--crop/--interpolation``).

    A ``preset`` replaces the recipe as at fit time (:func:`resolve_preprocess`, the other values
    overriding it); without one, each value given replaces that part of the recorded recipe and the
    rest is kept: ``--resize 28`` feeds 16-px images to a net fitted on 28-px ones with the fit's
    own normalisation.
    """

    preset: PreprocessPreset | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    resize: int | None = None
    crop: int | None = None
    interpolation: Interpolation | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, f) is not None for f in self.__dataclass_fields__)

    def apply(self, base: Preprocess, model_spec: str) -> Preprocess:
        """``base`` (the recorded recipe) with these overrides; ``base`` itself when none are set."""
        if not self:
            return base
        if self.preset is not None:
            resolved = resolve_preprocess(
                self.preset, model_spec, self.mean, self.std, self.resize, self.crop, self.interpolation
            )
            assert resolved is not None  # a preset always resolves
            return resolved
        for name, values in (("mean", self.mean), ("std", self.std)):
            if values is not None and (not values or (name == "std" and min(values) <= 0)):
                raise BayescliError(f"--{name} needs one positive value per channel, got {values}")
        if base.mean is None and (self.mean is None) != (self.std is None):
            raise BayescliError("pass --mean and --std together (the recorded recipe has neither)")
        fields = ("mean", "std", "resize", "crop", "interpolation")
        given = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        if self.interpolation is not None:
            given["interpolation"] = Interpolation(self.interpolation)
        source = base.source if base.source.endswith("+overrides") else f"{base.source}+overrides"
        return replace(base, source=source, **given)

    def to_meta(self) -> dict:
        """The overrides as a report records them (unset ones omitted)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for key in ("preset", "interpolation"):
            if d[key] is not None:
                d[key] = PreprocessPreset(d[key]).value if key == "preset" else Interpolation(d[key]).value
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items() if v is not None}
