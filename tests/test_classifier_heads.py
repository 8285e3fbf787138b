"""Networks whose output is not a logits tensor, and heads that are not a bare ``nn.Linear``.

Each network here is small enough for the file to run in seconds on a CPU; the checks compare what
:class:`bayescli.models.classifier.Classifier` exposes (``net``, ``forward``, ``features``, ``head``) with the
tensors the network computes itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tolerance import assert_below, assert_close
from torch import nn

from bayescli.data.base import ArrayData
from bayescli.errors import BayescliError
from bayescli.models.classifier import Classifier, find_head, last_linear_name
from bayescli.models.features import extract_features, logit_pass
from bayescli.models.specs import LoadedModel, ModelSpec
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.laplace import fit_laplace
from bayescli.predictive.links import apply_link

K, D = 3, 5


def _body() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, D), nn.Tanh())


@dataclass
class Out:
    hidden: torch.Tensor
    logits: torch.Tensor


class Structured(nn.Module):
    """Returns ``(logits, φ)``, ``{"features": φ, "logits": logits}`` or ``Out(φ, logits)``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.body, self.fc = kind, _body(), nn.Linear(D, K)
        self.unused = nn.Linear(D, 2)  # a layer whose output the network never returns

    def forward(self, x: torch.Tensor):
        h = self.body(x)
        z = self.fc(h)
        if self.kind == "tuple":
            return z, h
        if self.kind == "dict":
            return {"features": h, "logits": z}
        return Out(h, z)


class TwoHeads(nn.Module):
    """A dict with two ``[N, K]`` tensors: which one is the logits cannot be guessed."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.fc, self.aux_fc = _body(), nn.Linear(D, K), nn.Linear(D, K)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.body(x)
        return {"logits": self.fc(h), "aux": self.aux_fc(h)}


class FunctionalLogSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.fc = _body(), nn.Linear(D, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(self.body(x)), dim=1)


class PerClassScale(nn.Module):
    """Logits scaled per class after the head: not head(φ) plus a per-row constant."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.fc = _body(), nn.Linear(D, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x)) * torch.tensor([1.0, 2.0, 3.0])


class ReluAfterHead(nn.Module):
    """A non-linearity after the head inside an opaque forward: only a run can find it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.fc, self.act = _body(), nn.Linear(D, K), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(self.body(x)))


class ConvHead(nn.Module):
    """Conv features, then ``Dropout → Conv2d(C, K, 1) [→ ReLU] → AdaptiveAvgPool2d(1) → Flatten``
    (with the ReLU: SqueezeNet's classifier)."""

    def __init__(self, relu: bool = False, channels: int = 6) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.Tanh())
        tail = [nn.ReLU()] if relu else []
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Conv2d(channels, K, 1), *tail, nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _x(n: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def _images(n: int = 6, seed: int = 0) -> torch.Tensor:
    # random maps: the spatial mean and the spatial max of the head's input differ
    return torch.rand(n, 3, 5, 5, generator=torch.Generator().manual_seed(seed))


def _loaded(clf: Classifier) -> LoadedModel:
    return LoadedModel(clf, ModelSpec.parse("py:tests:net"), Path("net.safetensors"), "0" * 64)


def _data(x: torch.Tensor, seed: int = 1) -> ArrayData:
    y = torch.randint(0, K, (len(x),), generator=torch.Generator().manual_seed(seed))
    return ArrayData(x, y, [str(i) for i in range(K)])


# -- outputs that are not a tensor --------------------------------------------------------------


@pytest.mark.parametrize(("kind", "key"), [("tuple", 0), ("dict", "logits"), ("dataclass", "logits")])
def test_structured_output_yields_its_logits_element(kind, key):
    torch.manual_seed(0)
    net = Structured(kind).eval()
    clf = Classifier(net, find_head(net))
    x = _x()
    with torch.no_grad():
        h = net.body(x)
        z = net.fc(h)
        assert clf.check_output(x)["output"] == key
        # the same float32 ops on the same inputs: bit-identical
        assert torch.equal(clf(x), z) and torch.equal(clf.net(x), z)
        assert torch.equal(clf.features(x), h)
        assert_below(clf.check_split(x), 1e-6, what=f"split of a {kind} output")
    desc = clf.describe()
    assert desc["output_kind"] == "logits" and desc["last_layer_exact"] and desc["num_classes"] == K
    # whole-network methods see the logits through ``net``
    logits, jac = network_jacobian(clf.net, x)
    assert torch.equal(logits, z) and jac.shape == (len(x), K, sum(p.numel() for p in net.parameters()))


@pytest.mark.parametrize(("kind", "output", "key"), [("tuple", "0", 0), ("dict", "logits", "logits")])
def test_explicit_output_selects_the_element(kind, output, key):
    net = Structured(kind).eval()
    clf = Classifier(net, "fc", output=output)  # digits (as the command line gives them) mean an index
    x = _x()
    with torch.no_grad():
        assert torch.equal(clf(x), net.fc(net.body(x)))
    assert clf.describe()["output"] == key


def test_two_logit_shaped_outputs_are_ambiguous():
    net = TwoHeads().eval()
    with pytest.raises(BayescliError, match=r"'logits', 'aux'; pass --output"):
        Classifier(net, "fc").check_output(_x())
    clf = Classifier(net, "aux_fc", output="aux")
    with torch.no_grad():
        assert torch.equal(clf(_x()), net.aux_fc(net.body(_x())))
    assert_below(clf.check_split(_x()), 1e-6, what="split with the chosen element")


def test_output_without_logits_or_with_a_wrong_key_is_refused():
    net = Structured("tuple").eval()
    with pytest.raises(BayescliError, match=r"without a \[N, 2\] tensor .*--output"):
        Classifier(net, "unused").check_output(_x())
    with pytest.raises(BayescliError, match="out of range"):
        Classifier(net, "fc", output=2).check_output(_x())
    with pytest.raises(BayescliError, match="not an element"):
        Classifier(Structured("dict"), "fc", output="scores").check_output(_x())
    with pytest.raises(BayescliError, match="drop --output"):
        Classifier(nn.Sequential(nn.Linear(4, K)), "0", output=0).check_output(_x())


# -- log-probability outputs ----------------------------------------------------------------------


def _log_softmax_net(functional: bool) -> tuple[nn.Module, nn.Module]:
    """A network ending in a log-softmax and the module computing its pre-softmax logits (sharing
    its parameters, in the same order)."""
    torch.manual_seed(0)
    if functional:
        net = FunctionalLogSoftmax()
        logits = nn.Sequential(net.body, net.fc)
    else:
        net = nn.Sequential(nn.Linear(4, D), nn.Tanh(), nn.Linear(D, K), nn.LogSoftmax(dim=1))
        logits = net[:3]
    with torch.no_grad():
        net.get_submodule(find_head(net)).bias.add_(torch.tensor([3.0, -2.0, 0.5]))  # far from log p
    return net.eval(), logits


@pytest.mark.parametrize("functional", [False, True], ids=["LogSoftmax-module", "functional-log_softmax"])
def test_log_probability_output_serves_the_heads_logits(functional):
    net, pre_softmax = _log_softmax_net(functional)
    clf = Classifier(net, find_head(net))
    x = _x()
    with torch.no_grad():
        logp, z = net(x), pre_softmax(x)
        assert_below(clf.check_split(x), 1e-5, what="log-probabilities minus head(φ), per-row centred")
        assert clf.describe()["output_kind"] == "log-probabilities"
        logits = clf(x)
        # the head's own output, bit for bit (the forward stops at the head)
        assert torch.equal(logits, z) and torch.equal(clf.net(x), z)
        assert (logits - logp).abs().max() > 0.1  # the logits, not the log-probabilities
        assert_close(logits.softmax(1), logp.exp(), atol=1e-6, what="softmax(logits) = exp(log p)")
        assert_close(clf.head(clf.features(x)), z, atol=1e-6, what="head(φ) = logits")
    # whole-network methods linearise the logits, not log_softmax of them
    _, jac = network_jacobian(clf.net, x)
    _, expected = network_jacobian(pre_softmax, x)
    assert torch.equal(jac, expected)


def test_log_probabilities_over_a_conv1x1_head_give_its_pooled_logits():
    torch.manual_seed(0)
    net = nn.Sequential(ConvHead(), nn.LogSoftmax(dim=1)).eval()
    clf = Classifier(net, "0.classifier.1")
    x = _images()
    with torch.no_grad():
        assert_below(clf.check_split(x), 1e-5, what="conv head under a log-softmax")
        assert clf.describe()["output_kind"] == "log-probabilities"
        # the conv's output averaged over positions vs AdaptiveAvgPool2d: float32, logits ~1
        assert_close(clf(x), net[0](x), atol=1e-6, what="pooled head logits")


def test_all_layer_fit_of_a_log_probability_network_uses_the_logits():
    net, pre_softmax = _log_softmax_net(False)
    clf = Classifier(net, find_head(net))
    x = _x(30)
    post = fit_laplace(clf, batches=[(x, None)], subset="all", structure="full", prior_precision=1.0)
    lg = post.logit_gaussian_inputs(clf, x[:5])
    with torch.no_grad():
        assert torch.equal(lg.mean, pre_softmax(x[:5]))
    assert clf.describe()["output_kind"] == "log-probabilities"


def test_logits_network_keeps_the_users_module():
    net = nn.Sequential(nn.Linear(4, D), nn.Tanh(), nn.Linear(D, K)).eval()
    clf = Classifier(net, find_head(net))
    clf.check_split(_x())
    assert clf.net is net and clf.describe()["output_kind"] == "logits"


@pytest.mark.parametrize("probabilities", [True, False], ids=["softmax", "per-class-scale"])
def test_outputs_neither_logits_nor_log_probabilities_fail_the_split(probabilities):
    torch.manual_seed(0)
    if probabilities:
        clf = Classifier(nn.Sequential(nn.Linear(4, D), nn.Tanh(), nn.Linear(D, K), nn.Softmax(1)), "2")
    else:
        clf = Classifier(PerClassScale(), "fc")
    with pytest.raises(BayescliError, match="differs from the model's output") as err:
        clf.check_split(_x())
    assert ("outputs probabilities" in str(err.value)) == probabilities
    assert clf.describe()["output_kind"] is None and not clf.describe()["last_layer_exact"]


# -- heads that are not a bare Linear -----------------------------------------------------------


def test_conv1x1_head_is_an_exact_linear_head_on_pooled_features():
    torch.manual_seed(0)
    net = ConvHead().eval()
    clf = Classifier(net, find_head(net))
    conv = net.classifier[1]
    x = _images()
    with torch.no_grad():
        assert_below(clf.check_split(x), 1e-5, what="conv-head split")
        phi = clf.features(x)
        assert_close(phi, net.features(x).mean((2, 3)), atol=1e-7, what="φ = spatial mean")
        # mean over positions then a matrix product vs a 1×1 conv then the mean: float32, logits ~1
        assert_close(clf.head(phi), net(x), atol=1e-5, what="head(φ) = network output")
    head = clf.head
    assert isinstance(head, nn.Linear) and (head.in_features, head.out_features) == (6, K)
    assert torch.equal(head.weight, conv.weight[:, :, 0, 0]) and torch.equal(head.bias, conv.bias)
    assert clf.describe() == {
        "head": "classifier.1",
        "head_kind": "conv1x1-pool",
        "feature_dim": 6,
        "num_classes": K,
        "output": None,
        "output_kind": "logits",
        "last_layer_exact": True,
    }
    with torch.no_grad():  # shared storage: the linear head follows the conv
        conv.weight.mul_(2.0)
    assert torch.equal(clf.head.weight, conv.weight[:, :, 0, 0])
    clf.double()  # new tensors: the linear head is rebuilt from them
    assert clf.head.weight.dtype == torch.float64 and torch.equal(clf.head.weight, conv.weight[:, :, 0, 0])
    assert clf.net is net  # whole-network methods run the real conv


def test_sequential_classifier_uses_its_linear_layer():
    net = nn.Sequential(
        OrderedDict(
            features=nn.Sequential(nn.Linear(4, D), nn.Tanh()),
            classifier=nn.Sequential(nn.Dropout(0.2), nn.Linear(D, K)),
        )
    ).eval()
    assert find_head(net) == "classifier.1"
    clf = Classifier(net, "classifier.1")
    assert_below(clf.check_split(_x()), 1e-6, what="dropout → linear classifier")


class _Named(nn.Module):
    """A network with the given attribute layers applied in order (for find_head's conventions)."""

    def __init__(self, layers: dict[str, nn.Module], timm_head: str | None = None) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.timm_head = timm_head

    def get_classifier(self) -> nn.Module:
        if self.timm_head is None:
            raise TypeError("not a timm model")
        return self.get_submodule(self.timm_head)


@pytest.mark.parametrize(
    ("layers", "timm_head", "expected"),
    [
        # ``fc`` is the head even though a projection is registered after it
        ({"fc": nn.Linear(D, K), "proj": nn.Linear(D, 2)}, None, "fc"),
        (
            {"heads": nn.Sequential(OrderedDict(head=nn.Linear(D, K))), "aux": nn.Linear(D, 2)},
            None,
            "heads.head",
        ),
        ({"last_linear": nn.Linear(D, K), "x": nn.Linear(D, 2)}, None, "last_linear"),
        (
            {"head": nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, K)), "z": nn.Linear(D, 2)},
            None,
            "head.2",
        ),
        ({"out": nn.Linear(D, K), "fc": nn.Linear(D, 2)}, "out", "out"),  # timm's get_classifier first
        ({"classifier": nn.Identity(), "a": nn.Linear(D, K), "b": nn.Linear(K, K)}, None, "b"),  # fallback
        ({"a": nn.Conv2d(3, D, 3), "b": nn.Conv2d(D, K, 1)}, None, "b"),  # no Linear: the last 1×1 conv
    ],
)
def test_find_head_follows_torchvision_and_timm_conventions(layers, timm_head, expected):
    assert find_head(_Named(layers, timm_head)) == expected


def test_find_head_on_real_torchvision_models():
    import torchvision

    assert find_head(torchvision.models.squeezenet1_1(num_classes=10)) == "classifier.1"
    vit = torchvision.models.VisionTransformer(16, 8, 1, 2, 8, 16, num_classes=K)
    assert find_head(vit) == "heads.head"
    net = nn.Sequential(nn.Linear(4, D), nn.Tanh(), nn.Linear(D, K))
    assert find_head(net) == last_linear_name(net) == "2"  # a plain MLP: as before
    with pytest.raises(BayescliError, match="no nn.Linear or 1×1 Conv2d"):
        find_head(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))


def test_unsupported_head_layers_are_refused():
    with pytest.raises(BayescliError, match=r"Conv2d with a 3×3 kernel, not nn.Linear or a 1×1 Conv2d"):
        Classifier(nn.Sequential(nn.Conv2d(3, K, 3)), "0")
    with pytest.raises(BayescliError, match="not nn.Linear"):
        Classifier(nn.Sequential(nn.Linear(4, K), nn.LayerNorm(K)), "1")


# -- heads whose logits are not linear in their weights -----------------------------------------


def _refuses_last_layer(clf: Classifier, x: torch.Tensor, culprit: str) -> None:
    pattern = rf"ReLU '{culprit}' is applied between the head '.+' and the output; use --subset all"
    for use in (lambda: clf.features(x), lambda: clf.head, lambda: clf.check_split(x)):
        with pytest.raises(BayescliError, match=pattern):
            use()


def test_relu_between_head_and_output_refuses_last_layer_methods():
    net = ConvHead(relu=True).eval()
    clf = Classifier(net, find_head(net))  # constructing succeeds: whole-network methods can use it
    assert not clf.describe()["last_layer_exact"]
    _refuses_last_layer(clf, _images(), "classifier.2")
    assert clf.check_output(_images())["output_kind"] is None  # no last-layer verdict, no error


def test_squeezenet_refuses_last_layer_methods():
    import torchvision

    net = torchvision.models.squeezenet1_1(num_classes=10).eval()
    clf = Classifier(net, find_head(net))
    assert clf.describe()["head_kind"] == "conv1x1-pool" and clf.describe()["feature_dim"] == 512
    _refuses_last_layer(clf, torch.rand(2, 3, 64, 64), "classifier.2")


def test_nonlinearity_inside_an_opaque_forward_is_found_by_running_it():
    torch.manual_seed(0)
    clf = Classifier(ReluAfterHead().eval(), "fc")
    assert clf.describe()["last_layer_exact"]  # nothing to see before a forward
    with pytest.raises(BayescliError, match="ReLU 'act' is applied between the head 'fc'.*--subset all"):
        clf.check_split(_x(20))
    _refuses_last_layer(clf, _x(20), "act")


# -- fitting -------------------------------------------------------------------------------------


@pytest.mark.parametrize("net_kind", ["conv-head", "tuple-output"])
def test_last_layer_laplace_on_conv_head_and_tuple_output(net_kind):
    torch.manual_seed(0)
    if net_kind == "conv-head":
        net, x = ConvHead().eval(), _images(40)
        with torch.no_grad():
            expected = net(x)
    else:
        net, x = Structured("tuple").eval(), _x(40)
        with torch.no_grad():
            expected = net(x)[0]
    model = _loaded(Classifier(net, find_head(net)))
    feats = extract_features(model, _data(x), batch_size=16)
    # batches of 16 and one of 40 through the same float32 ops, logits of order 1
    assert_close(feats.logits, expected, atol=1e-5, what=f"MAP logits ({net_kind})")
    post = fit_laplace(model.classifier, phi=feats.phi, labels=feats.labels, structure="kron")
    lg = post.logit_gaussian(feats.phi)
    assert_close(lg.mean, expected, atol=1e-5, what=f"GLM mean = MAP logits ({net_kind})")
    var = lg.var
    assert torch.isfinite(var).all() and (var > 0).all() and post.prior_precision > 0


def test_all_layer_diag_laplace_on_a_nonlinear_head():
    torch.manual_seed(0)
    net = ConvHead(relu=True).eval()
    model = _loaded(Classifier(net, find_head(net)))
    data = _data(_images(24))
    with pytest.raises(BayescliError, match="--subset all"):
        extract_features(model, data)
    stats = logit_pass(model, data, batch_size=10)  # what fit-laplace --subset all runs first
    with torch.no_grad():
        map_logits = net(data.inputs(slice(None)))
    assert stats.n == 24 and stats.correct == int((map_logits.argmax(1) == data.y).sum())
    labelled_by_map = ArrayData(data.inputs(slice(None)), map_logits.argmax(1), data.class_names)
    assert logit_pass(model, labelled_by_map, batch_size=10).accuracy == 1.0
    post = fit_laplace(
        model.classifier, batches=data.batches(10), subset="all", structure="diag", prior_precision="auto"
    )
    assert post.gaussian.num_params == sum(p.numel() for p in net.parameters()) and post.n_data == 24
    x = data.inputs(slice(0, 8))
    lg = post.logit_gaussian_inputs(model.classifier, x)
    with torch.no_grad():
        assert torch.equal(lg.mean, net(x))  # MAP logits from the network itself
    probs = apply_link(lg, "probit", 100, torch.Generator().manual_seed(0)).probs
    assert torch.isfinite(probs).all()
    assert_close(probs.sum(1), torch.ones(8), atol=1e-6, what="probit probabilities sum to 1")
    # a logit whose ReLU is off at every position is 0 with a zero Jacobian; the others vary
    assert (lg.var >= 0).all() and (lg.var[lg.mean > 0] > 0).all()
