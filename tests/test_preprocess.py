"""Input recipes: presets against timm's and torchvision's own configs, resize/crop, reuse downstream."""

import json
import math

import numpy as np
import pytest
import torch
from tolerance import assert_close

from bayescli.errors import BayescliError
from bayescli.models.preprocess import CIFAR_MEAN, Preprocess, resolve_preprocess
from bayescli.options import Interpolation


@pytest.mark.parametrize("name", ["resnet18", "vit_base_patch16_224", "efficientnet_b0"])
def test_timm_preset_equals_timms_resolved_data_config(name):
    import timm
    from timm.data import create_transform, resolve_data_config

    cfg = resolve_data_config({}, model=timm.create_model(name, pretrained=False))
    pre = resolve_preprocess("timm", f"timm:{name}")
    assert pre.mean == tuple(cfg["mean"]) and pre.std == tuple(cfg["std"])
    assert pre.crop == cfg["input_size"][-1] and pre.interpolation.value == cfg["interpolation"]
    resize = create_transform(**cfg).transforms[0]  # timm's own eval pipeline: Resize, CenterCrop, …
    assert pre.resize == (resize.size if isinstance(resize.size, int) else resize.size[0])
    assert pre.resize == math.floor(pre.crop / cfg["crop_pct"])


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v3_small"])
def test_torchvision_preset_reproduces_the_weights_transforms(name):
    import torchvision

    transforms = torchvision.models.get_model_weights(name).DEFAULT.transforms()
    pre = resolve_preprocess("torchvision", f"torchvision:{name}")
    x = torch.rand(2, 3, 300, 260, generator=torch.Generator().manual_seed(0))
    ours = (pre.pixels(x) - torch.tensor(pre.mean)[:, None, None]) / torch.tensor(pre.std)[:, None, None]
    theirs = transforms(x)
    assert ours.shape == theirs.shape == (2, 3, pre.crop, pre.crop)
    # the same resize kernel in float32 on values in [0, 1]; our clamp to [0, 1] after the
    # antialiased resize changes overshoots of at most ~1e-2 at sharp edges of the random image
    # (bilinear has no overshoot, so no clamp acts): 1e-5 covers float32 rounding of the normalisation
    assert_close(ours, theirs, atol=1e-5, what="torchvision transforms")


def test_fixed_presets_and_overrides():
    imnet = resolve_preprocess("imagenet", "builtin:mlp")
    assert (imnet.resize, imnet.crop, imnet.mean) == (256, 224, (0.485, 0.456, 0.406))
    cifar = resolve_preprocess("cifar", "timm:resnet18")
    assert cifar.mean == CIFAR_MEAN and not cifar.changes_pixels
    over = resolve_preprocess("imagenet", "x:y", mean=(0.5,) * 3, std=(0.25,) * 3, crop=200)
    assert over.mean == (0.5,) * 3 and over.crop == 200 and over.resize == 256 and "overrides" in over.source
    assert resolve_preprocess(None, "timm:resnet18") is None
    with pytest.raises(BayescliError, match="--mean and --std together"):
        resolve_preprocess(None, "x:y", mean=(0.5,))
    with pytest.raises(BayescliError, match="needs a timm:NAME model"):
        resolve_preprocess("timm", "torchvision:resnet50")
    with pytest.raises(BayescliError, match="positive value"):
        resolve_preprocess(None, "x:y", mean=(0.5,), std=(0.0,))


def test_resize_keeps_the_aspect_ratio_and_crops_the_centre():
    x = torch.zeros(1, 1, 40, 80)
    x[..., 16:24, 36:44] = 1.0  # an 8×8 square at the centre
    out = Preprocess(resize=20, crop=20, interpolation=Interpolation.NEAREST).pixels(x)
    assert out.shape == (1, 1, 20, 20)
    # shorter side 40 → 20 halves everything: the square becomes 4×4 at rows 8–11, cols 8–11 of the
    # 20×40 image, and the centre crop keeps columns 10–29, so it lands at columns −2…1 → 8–11 − 10
    expected = torch.zeros(20, 20)
    expected[8:12, 8:12] = 1.0
    assert torch.equal(out[0, 0], expected)
    with pytest.raises(BayescliError, match="cannot centre-crop"):
        Preprocess(crop=50).pixels(x)


def test_meta_round_trip():
    pre = resolve_preprocess("imagenet", "x:y", interpolation="bicubic")
    assert Preprocess.from_meta(json.loads(json.dumps(pre.to_meta()))) == pre


def test_recipe_is_recorded_and_reused_by_predict(cli, tmp_path):
    """16×16 inputs, a net for 8×8: fit with --resize 8 --mean --std; predict needs no flags."""
    from helpers_models import tiny_mlp

    torch.manual_seed(0)
    net = tiny_mlp(3).eval()
    ckpt = tmp_path / "m.pt"
    torch.save(net.state_dict(), ckpt)
    x = torch.rand(60, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    np.savez(tmp_path / "d.npz", x=x.numpy(), y=(np.arange(60) % 3))
    post = tmp_path / "p.safetensors"
    res = cli(
        "fit-laplace", "--model", "py:helpers_models:tiny_mlp", "--checkpoint", ckpt,
        "--data", f"npz:{tmp_path / 'd.npz'}", "--resize", "8", "--mean", "0.5", "--std", "0.25",
        "--interpolation", "bicubic", "--prior-precision", "1", "--out", post, "--json", "--device", "cpu",
    )  # fmt: skip
    assert res.code == 0, res.err
    assert json.loads(res.out)["preprocess"] == "none+overrides"
    pred = tmp_path / "pred.safetensors"
    res = cli(
        "predict", "--posterior", post, "--model", "py:helpers_models:tiny_mlp",
        "--data", f"npz:{tmp_path / 'd.npz'}", "--link", "none", "--save-logits", "--out", pred, "--quiet",
        "--device", "cpu",  # compared with the net run in-process on the CPU
    )  # fmt: skip
    assert res.code == 0, res.err
    from safetensors.torch import load_file
    from torchvision.transforms.v2 import functional as tvf

    small = tvf.resize(x, [8], interpolation=tvf.InterpolationMode.BICUBIC, antialias=True).clamp(0, 1)
    with torch.no_grad():
        logits = net((small - 0.5) / 0.25)
    # the GLM logit mean is the MAP net's output on the same preprocessed inputs (float32 forward)
    assert_close(load_file(str(pred))["logit_mean"], logits, atol=1e-5, what="logits on the recipe")


def test_imagefolder_images_of_different_sizes_are_resized_each_at_its_own_aspect(tmp_path):
    from PIL import Image

    from bayescli.data import load_data

    for cls, (w, h) in {"a": (40, 20), "b": (20, 60)}.items():
        (tmp_path / cls).mkdir()
        arr = (np.random.default_rng(len(cls) + w).random((h, w, 3)) * 255).astype(np.uint8)
        Image.fromarray(arr).save(tmp_path / cls / "img.png")
    pre = Preprocess(resize=16, crop=16)
    data = load_data(f"imagefolder:{tmp_path}", preprocess=pre)
    x = data.inputs(slice(None))
    assert x.shape == (2, 3, 16, 16)
    from torchvision.transforms.v2 import functional as tvf

    for i, cls in enumerate("ab"):
        img = torch.from_numpy(np.array(Image.open(tmp_path / cls / "img.png"))).permute(2, 0, 1)
        direct = tvf.center_crop(tvf.resize(img[None].float() / 255, [16], antialias=True), [16]).clamp(0, 1)
        assert_close(x[i], direct[0], atol=1e-6, what=f"image {cls}")
