"""bayescli.models.hf: Hugging Face image classifiers from a local ``save_pretrained`` folder.

Tiny randomly initialised ViT / ResNet / ConvNeXt models are saved with ``save_pretrained``; the
network rebuilt from the folder's config, with the weights read outside transformers, must give the
original logits, and the image processor's recipe must reproduce the processor's own output.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from tolerance import assert_below, assert_close  # noqa: E402

import bayescli.models.hf  # noqa: E402
from bayescli.errors import BayescliError  # noqa: E402
from bayescli.models.classifier import last_linear_name  # noqa: E402
from bayescli.models.hf import (  # noqa: E402
    build_hf_network,
    hf_class_names,
    hf_folder_files,
    hf_preprocess,
    hf_state_dict,
)
from bayescli.models.preprocess import Preprocess  # noqa: E402
from bayescli.options import Interpolation  # noqa: E402

LABELS = [f"class-{i}" for i in range(3)]


def _config(arch: str):
    labels = {"id2label": dict(enumerate(LABELS)), "label2id": {n: i for i, n in enumerate(LABELS)}}
    if arch == "vit":
        return transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
            **labels,
        )
    if arch == "resnet":
        return transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], **labels)
    return transformers.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], **labels)


# arch → the module that is the classification head (an nn.Linear applied last)
HEADS = {"vit": "classifier", "resnet": "classifier.1", "convnext": "classifier"}


def _processor(arch: str):
    if arch == "vit":
        return transformers.ViTImageProcessor(
            size={"height": 32, "width": 32}, image_mean=[0.1, 0.2, 0.3], image_std=[0.4, 0.5, 0.6]
        )
    return transformers.ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=0.875)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(arch, format) → (folder, in-memory model)``; all saved up front (the first model
    built pays transformers' one-off import of its modelling code, ~2 s)."""
    folders: dict[tuple[str, str], tuple[Path, nn.Module]] = {}
    for arch, fmt in [
        ("vit", "safetensors"),
        ("resnet", "safetensors"),
        ("convnext", "safetensors"),
        ("vit", "bin"),
    ]:
        torch.manual_seed(0)
        model = transformers.AutoModelForImageClassification.from_config(_config(arch)).eval()
        folder = tmp_path_factory.mktemp(f"{arch}-{fmt}")
        model.save_pretrained(folder)
        _processor(arch).save_pretrained(folder)
        if fmt == "bin":
            # transformers 5 writes only safetensors; older releases wrote this pickle of the same keys.
            torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
            (folder / "model.safetensors").unlink()
        folders[arch, fmt] = (folder, model)
    return lambda arch, fmt="safetensors": folders[arch, fmt]


def _load_weights(net: nn.Module, weights: Path) -> None:
    # Stands in for bayescli.models.checkpoints.read_checkpoint, which load_classifier uses.
    if weights.suffix == ".safetensors":
        state = load_file(weights)
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    net.load_state_dict(hf_state_dict(net, state), strict=True)


def _copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---------------------------------------------------------------------------------------------
# the folder and the network
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "fmt"),
    [("vit", "safetensors"), ("resnet", "safetensors"), ("convnext", "safetensors"), ("vit", "bin")],
)
def test_network_from_config_with_weights_read_outside_transformers_gives_the_original_logits(
    saved, arch, fmt
):
    folder, model = saved(arch, fmt)
    files = hf_folder_files(folder)
    assert files.weights.name == ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")
    net = build_hf_network(folder)
    _load_weights(net, files.weights)
    net.eval()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = net(x).logits, model(x).logits
    assert got.shape == (4, 3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", sorted(HEADS))
def test_head_is_the_last_linear_and_maps_its_input_to_the_logits(saved, arch):
    folder, model = saved(arch)
    head_name = HEADS[arch]
    head = dict(model.named_modules())[head_name]
    assert isinstance(head, nn.Linear)
    # bayescli's default head finder must pick the same module, so hf: models need no --head.
    assert last_linear_name(build_hf_network(folder)) == head_name
    captured: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(x).logits
        handle.remove()
        (phi,) = captured
        assert phi.shape == (5, head.in_features)
        assert_close(head(phi), logits, atol=1e-5, what=f"{arch} head(φ) vs logits")


def test_state_dict_renaming_touches_names_only(saved):
    folder, _ = saved("vit")
    net = build_hf_network(folder)
    state = load_file(folder / "model.safetensors")
    assert "vit.encoder.layer.0.attention.attention.query.weight" in state  # transformers 4's module names
    renamed = hf_state_dict(net, state)
    assert set(renamed) == set(net.state_dict())
    assert {id(t) for t in renamed.values()} == {id(t) for t in state.values()}


def test_state_dict_renaming_refuses_tensor_conversions(saved, monkeypatch):
    # transformers 5's loader can also fuse or split tensors (some language models need it).
    core = pytest.importorskip("transformers.core_model_loading", reason="transformers 5 renames on load")
    from transformers import conversion_mapping

    folder, _ = saved("vit")
    net = build_hf_network(folder)
    state = load_file(folder / "model.safetensors")
    split = core.WeightConverter("classifier.weight", ["classifier.a", "classifier.b"], [core.Chunk(dim=0)])
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda _net: [split])
    with pytest.raises(BayescliError) as exc:
        hf_state_dict(net, state)
    assert "'classifier.weight' needs transformers to convert its tensor" in _one_line(exc)


def test_num_classes_replaces_the_config_label_count(saved):
    folder, _ = saved("convnext")
    net = build_hf_network(folder, num_classes=7)
    assert net.classifier.out_features == 7


def test_network_is_float32_whatever_dtype_the_config_records(saved, tmp_path):
    folder = _copy_folder(saved("vit")[0], tmp_path / "half")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "float16"
    (folder / "config.json").write_text(json.dumps(config))
    assert {p.dtype for p in build_hf_network(folder).parameters()} == {torch.float32}


def test_safetensors_is_preferred_over_pytorch_model_bin(saved, tmp_path):
    folder = _copy_folder(saved("vit")[0], tmp_path / "both")
    (folder / "pytorch_model.bin").write_bytes(
        saved("vit", "bin")[0].joinpath("pytorch_model.bin").read_bytes()
    )
    files = hf_folder_files(folder)
    assert files.weights == folder / "model.safetensors"
    assert files.config == folder / "config.json"
    assert files.preprocessor == folder / "preprocessor_config.json"
    (folder / "preprocessor_config.json").unlink()
    assert hf_folder_files(folder).preprocessor is None
    assert hf_preprocess(folder) == (None, [])


def test_class_names_follow_the_integer_keys_of_id2label(saved, tmp_path):
    folder = _copy_folder(saved("vit")[0], tmp_path / "names")
    assert hf_class_names(folder) == LABELS
    config = json.loads((folder / "config.json").read_text())
    # Twelve classes written in reverse: neither file order nor string order ("10" < "2") is index order.
    config["id2label"] = {str(i): f"n{i}" for i in reversed(range(12))}
    (folder / "config.json").write_text(json.dumps(config))
    assert hf_class_names(folder) == [f"n{i}" for i in range(12)]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(3)}  # transformers' placeholders
    (folder / "config.json").write_text(json.dumps(config))
    assert hf_class_names(folder) is None
    config["id2label"] = {"0": "a", "2": "b"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(BayescliError, match="id2label must map 0..K-1"):
        hf_class_names(folder)


# ---------------------------------------------------------------------------------------------
# the image processor's recipe
# ---------------------------------------------------------------------------------------------


def _recipe(tmp_path: Path, processor) -> tuple[Preprocess, list[str]]:
    folder = tmp_path / "proc"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (folder / "model.safetensors").write_bytes(b"")  # never read by hf_preprocess
    processor.save_pretrained(folder)
    pre, notes = hf_preprocess(folder)
    assert pre is not None and pre.source == "hf"
    return pre, notes


def _noise(h: int, w: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, h, w), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)


def _assert_same_as_processor(processor, pre: Preprocess, image: torch.Tensor) -> None:
    """Our pixels + normalisation on [0, 1] inputs match the processor's output on 0-255 pixels.

    The processor resizes 8-bit pixels, rounding and clipping between its two separable passes,
    so single pixels of noise differ by up to ~25 levels (bicubic) but by ≤ 0.75 levels on average;
    a crop one pixel off, or a resize one pixel too big, differs by ~20 levels on average.
    """
    want = processor(image, return_tensors="pt")["pixel_values"]
    x = pre.pixels(image[None].float() / 255)
    std = torch.tensor(pre.std or (1.0,)).view(1, -1, 1, 1)
    if pre.mean is not None:
        x = (x - torch.tensor(pre.mean).view(1, -1, 1, 1)) / std
    assert x.shape == want.shape
    levels = (x - want).abs() * std * 255
    assert_below(levels.mean(), 2.0, what="mean difference from the processor, in 8-bit levels")


def test_vit_recipe_is_the_processors_mean_std_and_size(tmp_path):
    proc = transformers.ViTImageProcessor(
        size={"height": 40, "width": 40}, image_mean=[0.1, 0.2, 0.3], image_std=[0.4, 0.5, 0.6], resample=3
    )
    pre, notes = _recipe(tmp_path, proc)
    assert pre == Preprocess(
        "hf", tuple(proc.image_mean), tuple(proc.image_std), 40, 40, Interpolation.BICUBIC
    )
    assert len(notes) == 1 and "warps to 40×40" in notes[0]
    _assert_same_as_processor(proc, pre, _noise(56, 56))


def test_vit_non_square_target_becomes_its_shorter_side_with_a_note(tmp_path):
    proc = transformers.ViTImageProcessor(size={"height": 48, "width": 32})
    pre, notes = _recipe(tmp_path, proc)
    assert (pre.resize, pre.crop) == (32, 32)
    assert any("48×32" in n and "uses 32×32" in n for n in notes)


def test_convnext_crop_pct_resizes_to_size_over_crop_pct_then_crops_size(tmp_path):
    proc = transformers.ConvNextImageProcessor(
        size={"shortest_edge": 56},
        crop_pct=0.95,
        image_mean=[0.1, 0.2, 0.3],
        image_std=[0.4, 0.5, 0.6],
        resample=3,
    )
    pre, notes = _recipe(tmp_path, proc)
    # int(56 / 0.95) = int(58.9) = 58 px (truncated, not rounded), then a 56 px centre crop.
    assert pre == Preprocess("hf", (0.1, 0.2, 0.3), (0.4, 0.5, 0.6), 58, 56, Interpolation.BICUBIC)
    assert notes == []
    # 70×90 → 58×74: both crop margins are even (torchvision rounds half-pixel offsets, transformers
    # floors them), so the comparison is pixel-exact up to 8-bit rounding.
    _assert_same_as_processor(proc, pre, _noise(70, 90))


def test_convnext_from_384_warps_without_crop_pct(tmp_path):
    proc = transformers.ConvNextImageProcessor(size={"shortest_edge": 384}, crop_pct=0.5)
    pre, notes = _recipe(tmp_path, proc)
    assert (pre.resize, pre.crop) == (384, 384)
    assert any("warps to 384×384" in n for n in notes)
    _assert_same_as_processor(proc, pre, _noise(400, 400))


def test_shortest_edge_then_crop_size_as_in_clip_and_bit(tmp_path):
    proc = transformers.BitImageProcessor(
        size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, do_center_crop=True, resample=2
    )
    pre, notes = _recipe(tmp_path, proc)
    assert (pre.resize, pre.crop, pre.interpolation) == (40, 32, Interpolation.BILINEAR)
    assert pre.mean == tuple(proc.image_mean) and pre.std == tuple(proc.image_std)
    assert notes == []
    _assert_same_as_processor(proc, pre, _noise(50, 60))


@pytest.mark.parametrize(
    ("kwargs", "mean", "std"),
    [
        # 0-255 pixels normalised directly: mean/std in [0, 1] units are divided by 255
        ({"do_rescale": False, "image_mean": [127.5] * 3, "image_std": [63.75] * 3}, (0.5,) * 3, (0.25,) * 3),
        # pixels scaled to [0, 2] first
        (
            {"rescale_factor": 2 / 255, "image_mean": [1.0] * 3, "image_std": [0.5] * 3},
            (0.5,) * 3,
            (0.25,) * 3,
        ),
        ({"do_normalize": False}, None, None),
        ({"do_normalize": False, "do_rescale": False}, (0.0,), (1 / 255,)),
    ],
)
def test_rescale_and_normalise_map_to_mean_std_on_unit_pixels(tmp_path, kwargs, mean, std):
    proc = transformers.ViTImageProcessor(do_resize=False, **kwargs)
    pre, _ = _recipe(tmp_path, proc)
    assert (pre.resize, pre.crop) == (None, None)
    for got, want in ((pre.mean, mean), (pre.std, std)):
        assert (got is None) == (want is None)
        if want is not None:
            assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-12, atol=1e-15, what="mean/std")
    image = _noise(8, 8)
    want_pixels = proc(image, return_tensors="pt")["pixel_values"]
    x = image[None].float() / 255
    got_pixels = (x - torch.tensor(mean or (0.0,)).view(1, -1, 1, 1)) / torch.tensor(std or (1.0,)).view(
        1, -1, 1, 1
    )
    assert_below((got_pixels - want_pixels).abs().max() / want_pixels.abs().max(), 1e-5, what="pixels")


@pytest.mark.parametrize(
    ("code", "interpolation", "noted"),
    [(0, Interpolation.NEAREST, False), (1, Interpolation.BICUBIC, True), (4, Interpolation.BILINEAR, True)],
)
def test_pil_resample_codes(tmp_path, code, interpolation, noted):
    pre, notes = _recipe(tmp_path, transformers.BitImageProcessor(size={"shortest_edge": 40}, resample=code))
    assert pre.interpolation is interpolation
    assert any("resampling is approximated" in n for n in notes) == noted


def test_processors_outside_the_standard_pipeline_get_notes(tmp_path):
    pre, notes = _recipe(tmp_path, transformers.PoolFormerImageProcessor(crop_pct=0.9))
    assert (pre.resize, pre.crop) == (224, 224)
    assert any(n.startswith("PoolFormerImageProcessor was read as resize → centre crop") for n in notes)
    assert "crop_pct=0.9 of PoolFormerImageProcessor is not applied" in notes


def test_a_longest_edge_cap_is_noted(tmp_path):
    proc = transformers.BitImageProcessor(size={"shortest_edge": 40, "longest_edge": 60})
    pre, notes = _recipe(tmp_path, proc)
    assert pre.resize == 40
    assert notes == ["the longest_edge cap of 60 px is not applied"]


def test_a_size_bayescli_cannot_express_is_refused(tmp_path):
    with pytest.raises(BayescliError) as exc:
        _recipe(tmp_path, transformers.ViTImageProcessor(size={"max_height": 64, "max_width": 64}))
    assert "resizes by ['max_height', 'max_width'], which bayescli cannot express" in _one_line(exc)


def test_unreadable_processor_configs_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    processor = tmp_path / "preprocessor_config.json"
    processor.write_text(json.dumps({"image_processor_type": "NoSuchImageProcessor"}))
    with pytest.raises(BayescliError) as exc:
        hf_preprocess(tmp_path)
    assert "cannot read preprocessor_config.json" in _one_line(exc) and len(str(exc.value)) < 400
    processor.write_text(json.dumps({"image_processor_type": "ViTImageProcessor", "resample": 9}))
    with pytest.raises(BayescliError) as exc:
        hf_preprocess(tmp_path)
    assert "resample=9, not a PIL filter code 0-5" in _one_line(exc)
    processor.write_text(
        json.dumps(
            {
                "image_processor_type": "ViTImageProcessor",
                "do_center_crop": True,
                "crop_size": {"longest_edge": 9},
            }
        )
    )
    with pytest.raises(BayescliError) as exc:
        hf_preprocess(tmp_path)
    assert "crop_size {'longest_edge': 9} has no height and width" in _one_line(exc)
    processor.write_text("[1, 2]")
    with pytest.raises(BayescliError) as exc:
        hf_preprocess(tmp_path)
    assert "preprocessor_config.json holds a JSON list, not an object" in _one_line(exc)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_missing_folder_config_or_weights(tmp_path):
    with pytest.raises(BayescliError) as exc:
        hf_folder_files(tmp_path / "nowhere")
    assert "no such folder" in _one_line(exc) and "save_pretrained" in str(exc.value)
    with pytest.raises(BayescliError) as exc:
        build_hf_network(tmp_path)
    assert "has no config.json" in _one_line(exc)
    (tmp_path / "config.json").write_text('{"model_type": "vit",')
    with pytest.raises(BayescliError) as exc:
        hf_folder_files(tmp_path)
    assert "config.json is not valid JSON" in _one_line(exc)
    (tmp_path / "config.json").write_text('{"model_type": "vit"}')
    with pytest.raises(BayescliError) as exc:
        hf_folder_files(tmp_path)
    assert _one_line(exc).endswith(
        "has no model.safetensors or pytorch_model.bin: save it with save_pretrained"
    )
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(BayescliError) as exc:
        hf_folder_files(tmp_path)
    assert "sharded weights (model.safetensors.index.json)" in _one_line(exc)


@pytest.mark.parametrize("file", ["config.json", "preprocessor_config.json"])
def test_custom_code_is_refused(saved, tmp_path, file):
    folder = _copy_folder(saved("vit")[0], tmp_path / "remote")
    data = json.loads((folder / file).read_text())
    data["auto_map"] = {"AutoModelForImageClassification": "modeling_evil.EvilModel"}
    (folder / file).write_text(json.dumps(data))
    for call in (hf_folder_files, build_hf_network, hf_preprocess, hf_class_names):
        with pytest.raises(BayescliError) as exc:
            call(folder)
        assert f"{file} names custom model code" in _one_line(exc)
        assert "remote code is not run" in str(exc.value)


def test_missing_transformers_names_the_extra(saved, monkeypatch):
    folder, _ = saved("vit")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    for call in (build_hf_network, hf_preprocess):
        with pytest.raises(BayescliError) as exc:
            call(folder)
        assert _one_line(exc) == f"--model hf:{folder} needs transformers: pip install 'bayescli[hf]'"
    # what needs only the JSON files still works
    assert hf_class_names(folder) == LABELS
    assert hf_folder_files(folder).weights.name == "model.safetensors"


def test_configs_transformers_cannot_build_as_an_image_classifier(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(
        tmp_path
    )
    with pytest.raises(BayescliError) as exc:
        build_hf_network(tmp_path)
    assert "is a 'bert' model, which has no image-classification class" in _one_line(exc)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(BayescliError) as exc:
        build_hf_network(tmp_path)
    assert "cannot read config.json" in _one_line(exc)


def test_bayescli_hf_imports_without_transformers(monkeypatch):
    # A fresh import with transformers made unimportable fails if bayescli.models.hf imports it at load time.
    original = sys.modules["bayescli.models.hf"]
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "bayescli.models.hf")
    monkeypatch.setattr(bayescli.models, "hf", original)  # the re-import rebinds it; restored afterwards
    fresh = importlib.import_module("bayescli.models.hf")
    assert fresh is not original and callable(fresh.build_hf_network)
