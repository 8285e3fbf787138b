"""Hugging Face image classifiers from a local ``save_pretrained`` folder (``--model hf:PATH``).

The folder holds ``config.json``, the weights (``model.safetensors`` or ``pytorch_model.bin``) and
optionally ``preprocessor_config.json``. The network is built from the config alone
(``AutoModelForImageClassification.from_config``): transformers never reads the weights, so they go
through bayescli's own checkpoint reader like any other checkpoint, and nothing is fetched from the
Hub. A config or processor that names custom code (``auto_map``) is refused: remote code is never
run. The image processor's recipe is mapped onto :class:`~bayescli.models.preprocess.Preprocess`, with a
note for each step bayescli can only approximate.

transformers is imported inside the functions that need it, so importing this module (and every
command that does not use ``hf:``) stays free of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from bayescli.errors import BayescliError, require
from bayescli.models.preprocess import Preprocess
from bayescli.options import Interpolation

# In order of preference: safetensors cannot carry code, a .bin is a pickle (read weights-only).
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# PIL resampling codes as stored in ``resample``. LANCZOS, BOX and HAMMING have no counterpart
# in bayescli's resize and fall back to the nearest kind of filter (with a note).
_RESAMPLE = {
    0: ("NEAREST", Interpolation.NEAREST),
    1: ("LANCZOS", Interpolation.BICUBIC),
    2: ("BILINEAR", Interpolation.BILINEAR),
    3: ("BICUBIC", Interpolation.BICUBIC),
    4: ("BOX", Interpolation.BILINEAR),
    5: ("HAMMING", Interpolation.BILINEAR),
}
_EXACT_RESAMPLE = {0, 2, 3}

# Processors whose pipeline is the standard resize → centre crop → rescale → normalise (ConvNeXt's
# crop_pct resize is handled explicitly). Others may add steps bayescli does not know of.
_STANDARD_PROCESSORS = {
    "ViTImageProcessor",
    "DeiTImageProcessor",
    "BeitImageProcessor",
    "BitImageProcessor",
    "CLIPImageProcessor",
    "ConvNextImageProcessor",
}
# ConvNextImageProcessor warps to size × size instead of resize-and-crop from this size on.
_CONVNEXT_WARP_FROM = 384


@dataclass(frozen=True)
class HFFolder:
    """The files of a ``save_pretrained`` folder that bayescli reads."""

    root: Path
    config: Path
    weights: Path  # the checkpoint: read by bayescli.models.checkpoints, hashed into posterior files
    preprocessor: Path | None


def _read_json(path: Path, root: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise BayescliError(
            f"hf:{root}: {path.name} is not valid JSON ({exc.msg}, line {exc.lineno}); "
            "re-save the model with save_pretrained"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BayescliError(f"hf:{root}: cannot read {path.name} ({exc})") from None
    require(
        isinstance(data, dict),
        f"hf:{root}: {path.name} holds a JSON {type(data).__name__}, not an object; "
        "re-save the model with save_pretrained",
    )
    return data


def _refuse_remote_code(data: dict[str, Any], path: Path, root: Path) -> None:
    """``auto_map`` points transformers at Python files shipped with the model: never run them."""
    auto_map = data.get("auto_map")
    if auto_map:
        names = ", ".join(auto_map) if isinstance(auto_map, dict) else str(auto_map)
        raise BayescliError(
            f"hf:{root}: {path.name} names custom model code (auto_map: {names}), and remote code is "
            "not run; use an architecture that ships with transformers"
        )


def hf_folder_files(path: str | Path) -> HFFolder:
    """Locate and check the files of a ``save_pretrained`` folder.

    ``model.safetensors`` is preferred over ``pytorch_model.bin``. Raises :class:`BayescliError`
    when the folder or ``config.json`` is missing, a JSON file is malformed or names custom code,
    or there are no (unsharded) PyTorch weights.
    """
    root = Path(path)
    require(
        root.is_dir(),
        f"--model hf:{root}: no such folder; pass the folder written by save_pretrained",
    )
    config = root / "config.json"
    require(config.is_file(), f"hf:{root} has no config.json: save the model with save_pretrained")
    _refuse_remote_code(_read_json(config, root), config, root)
    preprocessor = root / "preprocessor_config.json"
    if preprocessor.is_file():
        _refuse_remote_code(_read_json(preprocessor, root), preprocessor, root)
    weights = next((root / n for n in WEIGHTS_FILES if (root / n).is_file()), None)
    if weights is None:
        shards = next((n for n in SHARD_INDEXES if (root / n).is_file()), None)
        # One checkpoint file is what posterior files hash and record; shards would be several.
        require(
            shards is None,
            f"hf:{root} holds sharded weights ({shards}), which bayescli does not read: re-save them "
            "in one file with save_pretrained(folder, max_shard_size='1000GB')",
        )
        raise BayescliError(
            f"hf:{root} has no model.safetensors or pytorch_model.bin: save it with save_pretrained"
        )
    return HFFolder(root, config, weights, preprocessor if preprocessor.is_file() else None)


def hf_class_names(path: str | Path) -> list[str] | None:
    """Class names from ``config.json``'s ``id2label``, in class-index order.

    ``None`` when there is no ``id2label`` or it holds only transformers' placeholders
    ``LABEL_0, LABEL_1, …`` (a model saved without names), so callers fall back to indices.
    """
    folder = hf_folder_files(path)
    id2label = _read_json(folder.config, folder.root).get("id2label")
    if not id2label:
        return None
    try:
        labels = {int(k): str(v) for k, v in id2label.items()}
    except (AttributeError, ValueError):
        labels = {}
    require(
        sorted(labels) == list(range(len(id2label))),
        f"hf:{folder.root}: config.json's id2label must map 0..K-1 to names, got keys "
        f"{list(id2label)[:5]}; fix or remove it",
    )
    names = [labels[i] for i in range(len(labels))]
    return None if names == [f"LABEL_{i}" for i in range(len(names))] else names


def _transformers(root: Path) -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise BayescliError(f"--model hf:{root} needs transformers: pip install 'bayescli[hf]'") from None
    return transformers


def _first_line(exc: Exception, limit: int = 160) -> str:
    """A transformers error cut to fit a one-line message (some list every known model type)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 1] + "…"


def build_hf_network(path: str | Path, num_classes: int | None = None) -> nn.Module:
    """The ``AutoModelForImageClassification`` described by the folder's ``config.json``.

    Randomly initialised: read the weights from :attr:`HFFolder.weights` with bayescli's reader and
    rename them with :func:`hf_state_dict` before ``load_state_dict``.
    ``num_classes`` replaces the config's label count (``None`` keeps it). The network is float32
    whatever ``dtype`` the config records, as the rest of bayescli computes in float32; its
    forward returns an ``ImageClassifierOutput`` whose ``.logits`` are the class scores.
    """
    folder = hf_folder_files(path)
    transformers = _transformers(folder.root)
    # A local folder and local_files_only: transformers never contacts the Hub, and with
    # trust_remote_code=False it never imports code shipped with the model (auto_map is refused above).
    extra = {} if num_classes is None else {"num_labels": int(num_classes)}
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(folder.root), local_files_only=True, trust_remote_code=False, **extra
        )
    except (ValueError, KeyError, OSError) as exc:
        raise BayescliError(
            f"hf:{folder.root}: transformers {transformers.__version__} cannot read config.json "
            f"({_first_line(exc)}); upgrade transformers or re-save the model"
        ) from None
    try:
        net = transformers.AutoModelForImageClassification.from_config(config)
    except ValueError:
        raise BayescliError(
            f"hf:{folder.root} is a '{config.model_type}' model, which has no image-classification class "
            f"in transformers {transformers.__version__}; save an *ForImageClassification model"
        ) from None
    return net.float()


def hf_state_dict(net: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint ``state`` (read by bayescli) under the parameter names of ``net``.

    transformers 5 renames modules between releases but keeps the files in the original names:
    ``save_pretrained`` writes them, and ``from_pretrained`` renames on load (ViT's
    ``encoder.layer.0.attention.attention.query`` is ``layers.0.attention.q_proj``). This applies
    the same renaming rules, and the base-model prefix handling, to the keys only; no tensor is
    touched. With transformers 4, whose files use the module names, ``state`` is returned as is.
    Raises :class:`BayescliError` when a key would need one of transformers' tensor conversions
    (fused or split weights), which bayescli does not run.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: no renaming between files and modules
        return dict(state)
    transforms = get_model_conversion_mapping(net)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = net.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name, converted = rename_source_key(key, renamings, converters, net.base_model_prefix, expected)
        require(
            converted is None,
            f"checkpoint key '{key}' needs transformers to convert its tensor ({converted}), which bayescli "
            "does not run; this architecture is not supported by --model hf:",
        )
        out[name] = tensor
    return out


def _size(value: Any) -> dict[str, int]:
    """A processor's ``size``/``crop_size`` (a dict, or transformers 5's ``SizeDict``) without unset keys."""
    return {k: int(v) for k, v in dict(value or {}).items() if v is not None}


def _square_side(size: dict[str, int], what: str, notes: list[str]) -> int:
    """The side of a ``height × width`` target; non-square targets become their shorter side."""
    h, w = size["height"], size["width"]
    if h != w:
        notes.append(f"{what} is {h}×{w}; bayescli only crops squares and uses {min(h, w)}×{min(h, w)}")
    return min(h, w)


def hf_preprocess(path: str | Path) -> tuple[Preprocess | None, list[str]]:
    """The folder's image-processor recipe as a :class:`Preprocess` (source ``"hf"``) plus notes.

    ``(None, [])`` without ``preprocessor_config.json``. The processor is instantiated with
    ``AutoImageProcessor`` (local files only), so values the JSON leaves out take the processor
    class's defaults, as in transformers. Mapping, in processing order:

    * ``size`` (when ``do_resize``): ``{"shortest_edge": s}`` → ``resize=s``;
      ``{"height": h, "width": w}`` (a warp to h×w) → ``resize=crop=min(h, w)``, the same on square
      images; ConvNeXt's ``s < 384`` → ``resize=int(s / crop_pct)``, ``crop=s``, and ``s ≥ 384`` (a
      warp) → ``resize=crop=s``;
    * ``crop_size`` (when ``do_center_crop``) → ``crop``;
    * ``resample`` (a PIL code) → ``interpolation``;
    * ``image_mean``/``image_std`` (when ``do_normalize``) → ``mean``/``std``, divided by
      ``255 · rescale_factor`` (``255`` without ``do_rescale``) because bayescli feeds [0, 1] pixels.

    Each note names a step that is approximated: warps on non-square images, non-square targets,
    filters bayescli lacks, a ``longest_edge`` cap, processors outside the standard pipeline.
    Raises :class:`BayescliError` for sizes bayescli cannot express at all.
    """
    folder = hf_folder_files(path)
    if folder.preprocessor is None:
        return None, []
    transformers = _transformers(folder.root)
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(
            str(folder.root), local_files_only=True, trust_remote_code=False
        )
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise BayescliError(
            f"hf:{folder.root}: transformers {transformers.__version__} cannot read "
            f"preprocessor_config.json ({_first_line(exc)}); pass --mean/--std/--resize/--crop instead"
        ) from None
    # The slow (PIL) and fast (torchvision) variants share one recipe.
    kind = type(proc).__name__.removesuffix("Fast").removesuffix("Pil")
    notes: list[str] = []
    if kind not in _STANDARD_PROCESSORS:
        notes.append(
            f"{kind} was read as resize → centre crop → rescale → normalise; check that it adds no other step"
        )
    resize: int | None = None
    crop: int | None = None
    if getattr(proc, "do_resize", False):
        size = _size(proc.size)
        crop_pct = getattr(proc, "crop_pct", None)
        if kind == "ConvNextImageProcessor" and "shortest_edge" in size:
            side = size["shortest_edge"]
            if side < _CONVNEXT_WARP_FROM:
                # int(), not round(): transformers truncates side / crop_pct.
                resize, crop = int(side / crop_pct), side
            else:
                resize = crop = side
                notes.append(
                    f"{kind} warps to {side}×{side}; bayescli resizes the shorter side and centre-crops "
                    "(the same on square images)"
                )
        elif "shortest_edge" in size:
            resize = size["shortest_edge"]
            if "longest_edge" in size:
                notes.append(f"the longest_edge cap of {size['longest_edge']} px is not applied")
        elif "height" in size and "width" in size:
            resize = crop = _square_side(size, "the resize target", notes)
            notes.append(
                f"{kind} warps to {size['height']}×{size['width']} ignoring the aspect ratio; bayescli "
                "resizes the shorter side and centre-crops (the same on square images)"
            )
        else:
            raise BayescliError(
                f"hf:{folder.root}: preprocessor_config.json resizes by {sorted(size)}, which bayescli "
                "cannot express; pass --resize/--crop (and --mean/--std) instead"
            )
        if crop_pct is not None and kind != "ConvNextImageProcessor":
            notes.append(f"crop_pct={crop_pct} of {kind} is not applied")
    if getattr(proc, "do_center_crop", False) and proc.crop_size:
        crop_size = _size(proc.crop_size)
        require(
            "height" in crop_size and "width" in crop_size,
            f"hf:{folder.root}: preprocessor_config.json's crop_size {crop_size} has no height and width; "
            "pass --crop instead",
        )
        side = _square_side(crop_size, "crop_size", notes)
        crop = side if crop is None else min(crop, side)
    interpolation = Interpolation.BILINEAR
    resample = getattr(proc, "resample", None)
    if resample is not None and resize is not None:
        code = int(resample)
        require(
            code in _RESAMPLE,
            f"hf:{folder.root}: preprocessor_config.json has resample={code}, not a PIL filter code 0-5; "
            "fix it or pass --interpolation",
        )
        pil_name, interpolation = _RESAMPLE[code]
        if code not in _EXACT_RESAMPLE:
            notes.append(f"PIL {pil_name} resampling is approximated by {interpolation.value}")
    # transformers scales 0-255 pixels by rescale_factor before normalising; bayescli's pixels are
    # already in [0, 1], so mean and std are expressed in those units. JSON's 1/255 times 255 is
    # 1.0 in floating point, which keeps the usual mean/std exactly as stored.
    scale = 255.0 * (float(proc.rescale_factor) if getattr(proc, "do_rescale", False) else 1.0)
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    if getattr(proc, "do_normalize", False):
        mean = tuple(float(m) / scale for m in _per_channel(proc.image_mean))
        std = tuple(float(s) / scale for s in _per_channel(proc.image_std))
        require(
            len(mean) == len(std) and min(std) > 0,
            f"hf:{folder.root}: preprocessor_config.json needs image_mean and image_std of one length "
            f"with std > 0, got {list(proc.image_mean)} and {list(proc.image_std)}",
        )
    elif not math.isclose(scale, 1.0):
        mean, std = (0.0,), (1.0 / scale,)
    return Preprocess("hf", mean, std, resize, crop, interpolation), notes


def _per_channel(value: float | list[float] | tuple[float, ...]) -> tuple[float, ...]:
    """``image_mean``/``image_std`` may be one number for all channels."""
    return tuple(value) if isinstance(value, (list, tuple)) else (float(value),)
