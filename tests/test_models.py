import pytest
import torch
from safetensors.torch import save_file
from tolerance import assert_below, assert_close

from bayescli.errors import BayescliError
from bayescli.models.specs import ModelSpec, load_classifier, mlp, small_cnn


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_small_cnn_handles_image_sizes(shape):
    net = small_cnn(7, shape)
    assert net(torch.rand(2, *shape)).shape == (2, 7)


def test_mlp_flattens_inputs():
    assert mlp(4, (1, 8, 8))(torch.rand(3, 1, 8, 8)).shape == (3, 4)


def test_unknown_spec_kind():
    with pytest.raises(BayescliError, match="unknown model spec"):
        ModelSpec.parse("keras:resnet")


def _save(net, path):
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))


def test_builtin_checkpoint_split_and_normalisation(digits_ckpt):
    loaded = load_classifier("builtin:small-cnn", digits_ckpt)
    clf = loaded.classifier
    x = torch.rand(5, 1, 8, 8)
    # the split applies the same float32 ops to the same features: differences are a few ulps of
    # logits of order 1–10 (≲ 1e-6); 1e-5 is the library's own SPLIT_TOLERANCE scale
    assert_below(clf.check_split(x), 1e-5, what="feature/head split, small-cnn")
    assert clf.features(x).shape == (5, 128)
    assert clf.num_classes == 10 and loaded.class_names == [str(i) for i in range(10)]
    # normalisation lives in the wrapper: the raw net sees standardised inputs
    manual = clf.net((x - clf.mean.view(1, -1, 1, 1)) / clf.std.view(1, -1, 1, 1))
    # the same float32 ops in the same order; rtol 1e-5 is ≥ 100× float32 eps
    assert_close(clf(x), manual, rtol=1e-5, atol=1e-6, what="normalisation inside the wrapper")


def test_timm_checkpoint_class_count_from_head(tmp_path):
    import timm

    net = timm.create_model("resnet18", pretrained=False, num_classes=7)
    path = tmp_path / "r18.safetensors"
    _save(net, path)
    loaded = load_classifier("timm:resnet18", path)
    assert loaded.classifier.num_classes == 7 and loaded.classifier.head_name == "fc"
    x = torch.rand(2, 3, 32, 32)
    assert_below(loaded.classifier.check_split(x), 1e-5, what="feature/head split, resnet18")
    # identical weights and ops, float32: differences come only from kernel choice (≤ a few ulps)
    assert_close(loaded.classifier(x), net.eval()(x), atol=1e-6, what="timm wrapper vs bare net")


def test_torchvision_checkpoint_pt(tmp_path):
    import torchvision

    net = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=5)
    path = tmp_path / "mb.pt"
    torch.save(net.state_dict(), path)
    loaded = load_classifier("torchvision:mobilenet_v3_small", path)
    assert loaded.classifier.num_classes == 5
    assert loaded.classifier.head_name == "classifier.3"
    split = loaded.classifier.check_split(torch.rand(2, 3, 32, 32))
    assert_below(split, 1e-5, what="feature/head split, mobilenet_v3_small")


def test_py_factory_spec(tmp_path):
    from helpers_models import tiny_mlp

    path = tmp_path / "tiny.safetensors"
    _save(tiny_mlp(4), path)
    loaded = load_classifier("py:helpers_models:tiny_mlp", path)
    assert loaded.classifier.num_classes == 4
    assert loaded.classifier.features(torch.rand(3, 1, 8, 8)).shape == (3, 16)


def test_split_that_does_not_reproduce_forward_is_refused(tmp_path):
    from helpers_models import Scaled

    path = tmp_path / "scaled.safetensors"
    _save(Scaled(10), path)
    loaded = load_classifier("py:helpers_models:Scaled", path)
    with pytest.raises(BayescliError, match="differs from the model's output"):
        loaded.classifier.check_split(torch.rand(2, 1, 8, 8))


def test_head_override_must_be_linear(digits_ckpt):
    with pytest.raises(BayescliError, match="not nn.Linear"):
        load_classifier("builtin:small-cnn", digits_ckpt, head="0")


def test_mismatched_checkpoint_is_refused(tmp_path):
    import timm

    path = tmp_path / "r18.safetensors"
    _save(timm.create_model("resnet18", pretrained=False, num_classes=3), path)
    with pytest.raises(BayescliError, match="does not match timm:resnet34|no 2-D"):
        load_classifier("timm:resnet34", path)


def test_checkpoint_of_other_builtin_is_refused(digits_ckpt):
    with pytest.raises(BayescliError, match="trained as builtin:small-cnn"):
        load_classifier("builtin:mlp", digits_ckpt)


def test_hash_mismatch_is_refused(digits_ckpt):
    with pytest.raises(BayescliError, match="sha256"):
        load_classifier("builtin:small-cnn", digits_ckpt, expected_sha256="0" * 64)
