"""Dense heads of segmentation nets: finding them, carried features, refusing non-linear tails.

Split tolerance: the nets run in float32 here, so ``W̃·T(φ̃)`` and the network's output differ by
float32 rounding of a C-term dot product (~1e-6 relative), under ``SPLIT_TOLERANCE`` (1e-5) the
check uses; the refusals differ by O(1).
"""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close
from torch import nn
from torch.nn import functional as F

from bayescli.errors import BayescliError
from bayescli.models.dense import DenseClassifier, find_dense_head
from bayescli.models.specs import ModelSpec, SmallSegNet, model_factory

K = 3


class Tail(nn.Module):
    """A backbone, a 1×1 head and a configurable tail after it."""

    def __init__(self, tail: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, stride=2))
        self.classifier = nn.Conv2d(4, K, 1)
        self.tail = tail
        self.post = nn.ReLU()
        self.bias_map = nn.Parameter(torch.randn(1, K, 1, 1))

    def forward(self, x: torch.Tensor):
        z = self.classifier(self.backbone(x))
        up = lambda t: F.interpolate(t, size=x.shape[-2:], mode="bilinear", align_corners=False)  # noqa: E731
        if self.tail == "relu-module":
            return up(self.post(z))
        if self.tail == "softmax":
            return up(z).softmax(1)
        if self.tail == "sigmoid":
            return torch.sigmoid(up(z))
        if self.tail == "channel-bias":
            return up(z) + self.bias_map
        if self.tail == "pad-crop":
            return F.pad(up(z), (2, 1, 1, 2))[:, :, 1:-1, 2:]
        if self.tail == "nearest":
            return F.interpolate(z, scale_factor=2, mode="nearest")
        if self.tail == "dict":
            return {"out": up(z), "aux": up(z.detach() * 0.5), "features": z.mean((2, 3))}
        if self.tail == "quarter":  # Hugging Face style: logits at the feature resolution
            return z
        raise AssertionError(self.tail)


X = torch.rand(2, 1, 11, 10)


def oracle_carried(net: Tail, x: torch.Tensor) -> torch.Tensor:
    """T(φ̃) by upsampling [φ, 1] with F.interpolate directly (what the tail does to the logits)."""
    with torch.no_grad():
        phi = net.backbone(x)
    phi_aug = torch.cat([phi, torch.ones_like(phi[:, :1])], 1)
    return F.interpolate(phi_aug, size=x.shape[-2:], mode="bilinear", align_corners=False)


def test_carried_features_are_the_upsampled_augmented_features():
    net = Tail("dict").eval()
    clf = DenseClassifier(net, output="out")
    assert clf.head_name == "classifier"
    diff = clf.check_split(X)
    assert diff < 1e-5
    with torch.no_grad():
        carried = clf.dense_features(X)
    assert_close(carried, oracle_carried(net, X), atol=1e-6, what="carried = interpolate([φ, 1])")
    # the mean commutes with the upsampling: upsampled low-res logits = W̃ T(φ̃) = the output
    with torch.no_grad():
        low = net.classifier(net.backbone(X))
        up = F.interpolate(low, size=X.shape[-2:], mode="bilinear", align_corners=False)
    split = torch.einsum("kd,ndhw->nkhw", clf.weight_aug(), carried)
    assert_close(split, up, atol=1e-5, what="head and upsampling commute")


def test_dict_output_needs_a_choice_when_ambiguous():
    with pytest.raises(BayescliError, match=r"2 \[N, 3, H, W\] tensors, 'out', 'aux'; pass --output"):
        DenseClassifier(Tail("dict").eval()).check_split(X)


@pytest.mark.parametrize(
    ("tail", "named"),
    [("relu-module", "'relu'"), ("softmax", "'softmax'"), ("sigmoid", "'sigmoid'")],
)
def test_nonlinear_tail_is_refused_naming_the_op(tail, named):
    clf = DenseClassifier(Tail(tail).eval())
    with pytest.raises(
        BayescliError, match=f"but {named} is applied to the output of the dense head 'classifier'"
    ):
        clf.check_split(X)
    with pytest.raises(BayescliError, match=named):  # and every later use refuses too
        clf.dense_features(X)


def test_channel_specific_tail_is_refused():
    with pytest.raises(BayescliError, match="depend on its 3 output channels"):
        DenseClassifier(Tail("channel-bias").eval()).check_split(X)


@pytest.mark.parametrize("tail", ["pad-crop", "nearest"])
def test_linear_tails_pass_exactly(tail):
    """Zero padding sends the bias to 0 outside the image: carrying the constant channel keeps it exact."""
    clf = DenseClassifier(Tail(tail).eval())
    assert clf.check_split(X) < 1e-5


def test_resize_to_mask_size_like_hugging_face():
    clf = DenseClassifier(Tail("quarter").eval(), size=(11, 10))
    assert clf.check_split(X) < 1e-5
    with torch.no_grad():
        assert clf(X).shape == (2, K, 11, 10)
        assert clf.dense_features(X).shape == (2, 5, 11, 10)


def test_head_must_be_a_1x1_conv():
    with pytest.raises(BayescliError, match=r"dense head 'backbone.0' is a Conv2d with a 3×3 kernel"):
        DenseClassifier(Tail("nearest"), head_name="backbone.0")
    with pytest.raises(BayescliError, match="no 1×1 Conv2d"):
        find_dense_head(nn.Sequential(nn.Conv2d(1, 2, 3)))


def test_builtin_small_segnet():
    factory = model_factory(ModelSpec.parse("builtin:small-segnet"))
    net = factory(4, (3, 9, 12)).eval()
    assert isinstance(net, SmallSegNet)
    clf = DenseClassifier(net)
    assert (clf.head_name, clf.feature_dim, clf.num_classes) == ("classifier", 32, 4)
    x = torch.rand(2, 3, 9, 12)
    assert clf.check_split(x) < 1e-5
    with torch.no_grad():
        assert clf(x).shape == (2, 4, 9, 12)
        assert clf.features(x).shape == (2, 32, 5, 6)


def test_torchvision_deeplab_and_lraspp():
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large, lraspp_mobilenet_v3_large

    torch.manual_seed(0)
    deeplab = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=K, aux_loss=True)
    clf = DenseClassifier(deeplab.eval(), output="out")
    x = torch.rand(2, 3, 33, 40)
    assert clf.head_name == "classifier.4"
    assert clf.check_split(x) < 1e-5
    # LR-ASPP adds a second 1×1 head's output to this one's: not W̃·T(φ̃) of either alone
    lraspp = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=K).eval()
    clf = DenseClassifier(lraspp, output="out")
    assert clf.head_name == "classifier.high_classifier"
    with pytest.raises(
        BayescliError,
        match="after the dense head 'classifier.high_classifier' depend on its 3 output channels",
    ):
        clf.check_split(x)


def test_checkpoints_load_as_dense_classifiers(tmp_path):
    """A builtin checkpoint (with its normalisation) and a torchvision state dict, loaded by the
    classification loader and wrapped: the same logits as the network run by hand."""
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    from bayescli.io import save_tensors
    from bayescli.models.specs import load_classifier, small_segnet

    torch.manual_seed(0)
    net = small_segnet(4, (3, 9, 12)).eval()
    meta = {"model": "builtin:small-segnet", "num_classes": 4, "input_shape": [3, 9, 12]}
    meta["normalisation"] = {"mean": [0.5] * 3, "std": [0.25] * 3}
    save_tensors(tmp_path / "seg.safetensors", net.state_dict(), meta)
    clf = DenseClassifier.from_classifier(
        load_classifier("builtin:small-segnet", tmp_path / "seg.safetensors").classifier
    )
    x = torch.rand(2, 3, 9, 12)
    assert clf.check_split(x) < 1e-5
    with torch.no_grad():
        assert_close(clf(x), net((x - 0.5) / 0.25), atol=1e-6, what="builtin logits")

    tv = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=5).eval()
    torch.save(tv.state_dict(), tmp_path / "deeplab.pt")
    loaded = load_classifier(
        "torchvision:deeplabv3_mobilenet_v3_large",
        tmp_path / "deeplab.pt",
        model_args={"weights_backbone": None},
        output="out",
    )
    clf = DenseClassifier.from_classifier(loaded.classifier)
    assert (clf.head_name, clf.num_classes) == ("classifier.4", 5)  # class count read from the checkpoint
    x = torch.rand(2, 3, 33, 40)
    assert clf.check_split(x) < 1e-5
    with torch.no_grad():
        assert_close(clf(x), tv(x)["out"], atol=1e-6, what="torchvision logits")


def test_hugging_face_segformer_with_quarter_resolution_logits():
    """SegformerForSemanticSegmentation: a ModelOutput with ``logits`` at 1/4 of the input, head
    ``decode_head.classifier``; ``size`` brings the logits (and carried features) to the masks' size."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        num_attention_heads=[1, 1], decoder_hidden_size=16, num_labels=K, patch_sizes=[7, 3],
        strides=[4, 2], mlp_ratios=[2, 2],
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.SegformerForSemanticSegmentation(cfg).eval()
    clf = DenseClassifier(net, size=(32, 28))
    x = torch.rand(2, 3, 32, 28)
    assert clf.head_name == "decode_head.classifier"
    assert clf.check_split(x) < 1e-5 and clf.output == "logits"
    with torch.no_grad():
        carried = clf.dense_features(x)
        low = net(pixel_values=x).logits
    assert carried.shape == (2, 17, 32, 28) and low.shape == (2, K, 8, 7)
    up = F.interpolate(low, size=(32, 28), mode="bilinear", align_corners=False)
    assert_close(
        torch.einsum("kd,ndhw->nkhw", clf.weight_aug(), carried), up, atol=1e-5, what="Segformer logits"
    )
