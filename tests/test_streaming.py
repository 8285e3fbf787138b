"""Streamed data and fitting: lazy sources, worker determinism, unreadable files, streamed = in-memory fit."""

from __future__ import annotations

import gc
import json
import re
import weakref
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from formats import write_cifar_binary, write_svhn
from tolerance import assert_close

from bayescli.data import load_data
from bayescli.data.corruptions import OfficialSource, corrupt, load_official
from bayescli.data.shifts import rotate
from bayescli.errors import BayescliError
from bayescli.io import load_tensors
from bayescli.models.features import FeatureStream, extract_features
from bayescli.models.preprocess import Preprocess
from bayescli.models.specs import load_classifier
from bayescli.posterior.curvature import CurvatureAccumulator
from bayescli.posterior.gaussian import augment
from bayescli.posterior.laplace import LaplacePosterior, fit_laplace
from bayescli.training.classifier import TrainConfig, save_checkpoint, train_classifier


def write_folder(root: Path, per_class: int = 12, seed: int = 0, sizes=((8, 8), (11, 9), (9, 13))) -> Path:
    """An ImageFolder tree of small RGB PNGs of a few sizes, two classes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c, cls in enumerate(("a", "b")):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = sizes[i % len(sizes)]
            pixels = rng.integers(0, 128, size=(h, w, 3)) + 127 * c  # class b is brighter
            Image.fromarray(pixels.astype(np.uint8)).save(root / cls / f"{i:03d}.png")
    return root


def break_files(root: Path) -> list[Path]:
    """Two unreadable files: bytes that are no image, and a PNG cut short."""
    garbage, truncated = root / "a" / "005.png", root / "b" / "002.png"
    garbage.write_bytes(b"this is not an image")
    truncated.write_bytes(truncated.read_bytes()[:60])
    return [garbage, truncated]


class CountingDecode:
    def __init__(self, monkeypatch) -> None:
        import bayescli.data.sources as sources

        self.calls, self.inner = 0, sources.decode_image
        monkeypatch.setattr(sources, "decode_image", self)

    def __call__(self, path: str) -> torch.Tensor:
        self.calls += 1
        return self.inner(path)


def test_imagefolder_lists_without_decoding_and_reads_one_batch_at_a_time(tmp_path, monkeypatch):
    root = write_folder(tmp_path / "imgs", per_class=20)
    count = CountingDecode(monkeypatch)
    data = load_data(f"imagefolder:{root}", limit=30, seed=1, preprocess=Preprocess(resize=8, crop=8))
    subset = data.subset(torch.arange(0, 30, 2))
    assert count.calls == 0 and len(data) == 30 and len(subset) == 15 and data.input_shape == (3, 8, 8)
    previous = None
    for k, (x, y) in enumerate(data.batches(8), start=1):
        # num_workers=0 reads nothing ahead: exactly the rows of the batches yielded so far
        assert count.calls == min(8 * k, 30) and x.shape[0] == len(y)
        if previous is not None:
            gc.collect()
            assert previous() is None, "an earlier batch is still referenced by the loader"
        previous = weakref.ref(x)
        del x, y
    again = load_data(f"imagefolder:{root}", limit=30, seed=1)
    assert torch.equal(again.index, data.index) and count.calls == 30  # seeded subset, no pixels read


def test_num_workers_do_not_change_batches(tmp_path):
    root = write_folder(tmp_path / "imgs", per_class=15)
    data = load_data(f"imagefolder:{root}", preprocess=Preprocess(resize=12, crop=10))
    shifted = data.map_inputs(partial(rotate, angle=30.0)).map_inputs(
        partial(corrupt, name="gaussian_noise", severity=3), seed=7
    )
    write_cifar_binary(tmp_path / "cifar", per_file=40)
    cifar = load_data("cifar10:train", root=tmp_path / "cifar", limit=50)
    for view in (shifted, cifar):
        serial = list(view.batches(7, num_workers=0))
        parallel = list(view.batches(7, num_workers=2))
        assert len(serial) == len(parallel) == -(-len(view) // 7)
        for (xs, ys), (xp, yp) in zip(serial, parallel, strict=True):
            assert torch.equal(xs, xp) and torch.equal(ys, yp)
    # random access reads the same values as the stream (the seeded shift uses the batch's first row)
    first, _ = serial[0]
    assert torch.equal(cifar.inputs(slice(0, 7)), first)


def test_cifar_and_svhn_roots_with_only_the_test_split(tmp_path):
    pixels = write_cifar_binary(tmp_path)
    for i in range(1, 6):
        (tmp_path / "cifar-10-batches-bin" / f"data_batch_{i}.bin").unlink()
    test = load_data("cifar10:test", root=tmp_path)
    stored = (test.inputs(slice(None)) * 255).round().to(torch.uint8)
    assert torch.equal(stored.reshape(len(test), -1), torch.from_numpy(pixels))
    with pytest.raises(BayescliError, match="data_batch_1.bin"):
        load_data("cifar10:train", root=tmp_path)

    write_cifar_binary(tmp_path, hundred=True, per_file=30)
    (tmp_path / "cifar-100-binary" / "train.bin").unlink()
    assert load_data("cifar100:test", root=tmp_path).y.tolist() == [i % 100 for i in range(30)]

    write_svhn(tmp_path / "svhn")
    (tmp_path / "svhn" / "train_32x32.mat").unlink()
    assert len(load_data("svhn:test", root=tmp_path / "svhn")) == 15
    with pytest.raises(BayescliError, match="train_32x32.mat"):
        load_data("svhn:val", root=tmp_path / "svhn")


def test_official_corruption_view_is_read_lazily_with_the_test_sets_preprocessing(tmp_path):
    write_cifar_binary(tmp_path, per_file=6)
    blocks = np.random.default_rng(1).integers(0, 256, size=(5 * 6, 32, 32, 3), dtype=np.uint8)
    np.save(tmp_path / "fog.npy", blocks)
    pre = Preprocess(resize=16)
    test = load_data("cifar10:test", root=tmp_path, preprocess=pre).subset(torch.tensor([1, 4, 5]))
    view = test.with_source(OfficialSource(tmp_path, "fog", 3, 6))
    expected = pre.pixels(load_official(tmp_path, "fog", 3, test.index, 6).float() / 255)
    assert torch.equal(view.inputs(slice(None)), expected) and torch.equal(view.y, test.y)


def test_unreadable_images_stop_or_are_skipped_and_recorded(tmp_path):
    root = write_folder(tmp_path / "imgs")
    bad = break_files(root)
    strict = load_data(f"imagefolder:{root}")
    with pytest.raises(BayescliError, match=re.escape(str(bad[0]))) as err:
        list(strict.batches(5, num_workers=2))
    assert "\n" not in str(err.value) and "--skip-unreadable" in str(err.value)

    data = load_data(f"imagefolder:{root}", skip_unreadable=True, num_workers=2)
    n_all, labels_all = len(data), data.y.clone()
    batches = list(data.batches(5))
    xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    assert len(xs) == len(ys) == n_all - 2 == len(data)
    assert data.info["unreadable"] == {"count": 2, "paths": sorted(str(p) for p in bad)}
    keep = torch.ones(n_all, dtype=torch.bool)
    keep[[5, 12 + 2]] = False  # a/005 and b/002 in the sorted listing
    assert torch.equal(ys, labels_all[keep]) and torch.equal(data.y, ys)
    # every later view of the source leaves them out without decoding them again
    assert len(data.subset(slice(None))) == n_all - 2 and torch.equal(data.take([0, 5])[1], ys[[0, 5]])


@pytest.fixture(scope="module")
def folder_model(tmp_path_factory) -> tuple[Path, Path]:
    """A small CNN trained (one epoch) on a clean image folder; a copy of the folder with two broken files."""
    base = tmp_path_factory.mktemp("folder")
    clean = write_folder(base / "clean")
    data = load_data(f"imagefolder:{clean}")  # every image resized to the first one's 8×8
    clf, meta = train_classifier("builtin:small-cnn", data, None, TrainConfig(epochs=1, seed=0))
    save_checkpoint(base / "cnn.safetensors", clf, meta)
    broken = write_folder(base / "broken")
    break_files(broken)
    return base / "cnn.safetensors", broken


def test_cli_unreadable_image_exits_2_naming_it_and_skip_records_it(cli, folder_model, tmp_path):
    ckpt, broken = folder_model
    post = tmp_path / "post.safetensors"
    args = [
        "fit-laplace",
        "--model",
        "builtin:small-cnn",
        "--checkpoint",
        ckpt,
        "--data",
        f"imagefolder:{broken}",
    ]
    args += ["--out", post, "--quiet", "--num-workers", "2"]
    res = cli(*args)
    assert (
        res.code == 2 and len(res.err.strip().splitlines()) == 1 and str(broken / "a" / "005.png") in res.err
    )
    assert not post.exists()

    res = cli(*args, "--skip-unreadable")
    assert res.code == 0, res.err
    _, meta = load_tensors(post)
    record = meta["data"]["unreadable"]
    assert record["count"] == 2 and str(broken / "b" / "002.png") in record["paths"]
    assert meta["n_data"] == 2 * 12 - 2

    pred = tmp_path / "pred.jsonl"
    res = cli("predict", "--posterior", post, "--data", f"imagefolder:{broken}", "--out", pred, "--quiet")
    assert res.code == 2 and "--skip-unreadable" in res.err and not pred.exists()
    res = cli(
        "predict", "--posterior", post, "--data", f"imagefolder:{broken}", "--out", pred, "--quiet",
        "--skip-unreadable",
    )  # fmt: skip
    assert res.code == 0, res.err
    lines = pred.read_text().splitlines()
    assert json.loads(lines[0])["data"]["unreadable"]["count"] == 2 and len(lines) == 1 + 22


def _features(n: int, d: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Linear]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, k)
    with torch.no_grad():
        head.weight.copy_(torch.randn(k, d, generator=gen) / d**0.5)
        head.bias.copy_(torch.randn(k, generator=gen))
    phi = torch.randn(n, d, generator=gen)
    labels = torch.distributions.Categorical(logits=head(phi)).sample()
    return phi, labels, head


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_streamed_fit_equals_in_memory_fit(structure):
    phi, labels, head = _features(1000, 20, 5, seed=0)
    cuts = [0, 37, 300, 301, 777, 1000]  # uneven batches, one of a single row
    stream = [(phi[a:b], labels[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    memory = LaplacePosterior.fit_last_layer(phi, labels, head, structure, batch_size=128)
    streamed = LaplacePosterior.fit_last_layer_stream(iter(stream), head, structure, batch_size=128)
    # Both sum the same 128-row chunks in the same order, so they agree exactly; 1e-6 relative is
    # the bound the streaming contract promises.
    for name, value in memory.tensors().items():
        assert_close(streamed.tensors()[name], value, rtol=1e-6, atol=1e-30, what=f"{structure} {name}")
    assert_close(streamed.log_likelihood, memory.log_likelihood, rtol=1e-6, what="log-likelihood")
    assert streamed.n_data == memory.n_data == 1000
    assert_close(streamed.optimise_prior_marglik(), memory.optimise_prior_marglik(), rtol=1e-6, what="δ")

    # independent oracle in float64: GGN formulas of DESIGN §3 evaluated directly
    x = augment(phi.double())
    w = torch.cat([head.weight, head.bias[:, None]], 1).detach().double()
    p = (x @ w.T).softmax(-1)
    log_lik = torch.log(p[torch.arange(1000), labels]).sum()
    # float32 features and weights: logits carry ~1e-7 relative error, summed over 1000 rows
    assert_close(streamed.log_likelihood, log_lik, rtol=1e-5, what="log-likelihood vs float64")
    if structure == "kron":
        G = torch.diag(p.sum(0)) - p.T @ p
        A = x.T @ x / 1000
        scale_g, scale_a = float(G.abs().max()), float(A.abs().max())
        assert_close(streamed.gaussian.G, G, atol=1e-5 * scale_g, what="G vs float64 (float32 sums of 1000)")
        assert_close(streamed.gaussian.A, A, atol=1e-5 * scale_a, what="A vs float64 (float32 sums of 1000)")
    else:
        h = (p - p.pow(2)).T @ x.pow(2)
        assert_close(streamed.gaussian.h, h, atol=1e-5 * float(h.abs().max()), what="diag vs float64")


def test_accumulator_regroups_rows_into_fixed_chunks():
    phi, labels, head = _features(300, 6, 3, seed=1)
    w = torch.cat([head.weight, head.bias[:, None]], 1).detach()
    whole = CurvatureAccumulator(w, "kron", batch_size=64)
    whole.update(augment(phi), labels)
    pieces = CurvatureAccumulator(w, "kron", batch_size=64)
    for a in range(0, 300, 50):
        pieces.update(augment(phi[a : a + 50]), labels[a : a + 50])
    a, b = whole.finish(), pieces.finish()
    assert (
        torch.equal(a.kron[0], b.kron[0])
        and torch.equal(a.kron[1], b.kron[1])
        and a.n_data == b.n_data == 300
    )
    assert whole.log_likelihood == pieces.log_likelihood
    unlabelled = CurvatureAccumulator(w, "diag", batch_size=64)
    unlabelled.update(augment(phi))
    assert unlabelled.finish().n_data == 300 and unlabelled.log_likelihood is None


def test_cli_fit_streams_the_same_posterior_as_an_in_memory_fit(cli, digits_ckpt, tmp_path):
    post_path, cache = tmp_path / "post.safetensors", tmp_path / "features"
    args = [
        "fit-laplace",
        "--model",
        "builtin:small-cnn",
        "--checkpoint",
        digits_ckpt,
        "--data",
        "digits:train",
    ]
    args += [
        "--hessian",
        "kron",
        "--prior-precision",
        "auto",
        "--batch-size",
        "100",
        "--out",
        post_path,
        "--quiet",
    ]
    res = cli(*args, "--feature-cache", cache, "--device", "cpu")  # the in-memory fit below is on the CPU
    assert res.code == 0, res.err
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    feats = extract_features(model, load_data("digits:train"), batch_size=100)
    memory = fit_laplace(model.classifier, feats.phi, feats.labels, structure="kron")
    tensors, meta = load_tensors(post_path)
    for name, value in memory.tensors().items():
        # same features (same batches) summed in the same 1024-row chunks: equal to the last bit
        assert_close(tensors[name], value, rtol=1e-6, atol=1e-6 * float(value.abs().max()), what=name)
    assert_close(meta["prior_precision"], memory.prior_precision, rtol=1e-6, what="δ")
    # the cache was written in shards and a second fit reads it back without the backbone
    assert (cache / "manifest.json").is_file() and list(cache.glob("shard-*.safetensors"))
    again = tmp_path / "again.safetensors"
    # on the CPU like the first fit: the same sums of the same features, so equal to the last bit
    # (--device auto picks a GPU where there is one; its float64 sums come in another order, 3e-14
    # apart relative on the emulated one)
    res = cli(*args[:-3], "--out", again, "--quiet", "--feature-cache", cache, "--json", "--device", "cpu")
    assert res.code == 0 and json.loads(res.out)["forward_seconds"] == 0.0
    assert torch.equal(load_tensors(again)[0]["kron_G"], tensors["kron_G"])


def test_feature_cache_shards_round_trip_and_an_interrupted_pass_leaves_nothing(
    digits_ckpt, tmp_path, monkeypatch
):
    import bayescli.models.features as features

    monkeypatch.setattr(features, "SHARD_BYTES", 40_000)  # ~70 rows of 128 + 10 floats per shard
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    data = load_data("digits:test", limit=300)
    cache = tmp_path / "cache"
    interrupted = FeatureStream(model, data, 32, cache=cache)
    for _ in interrupted:
        break
    del interrupted
    gc.collect()
    assert list(tmp_path.iterdir()) == []  # no cache and no temporary directory
    written = extract_features(model, data, 32, cache=cache)
    assert len(list(cache.glob("shard-*.safetensors"))) > 3
    stream = FeatureStream(model, data, 32, cache=cache)
    read = list(stream)
    assert stream.seconds == 0.0 and stream.n == 300
    assert torch.equal(torch.cat([b.phi for b in read]), written.phi)
    assert torch.equal(torch.cat([b.labels for b in read]), written.labels)
    assert stream.accuracy == float((written.logits.argmax(1) == written.labels).double().mean())


def test_evaluate_warns_when_map_accuracy_is_low(cli, digits_posterior, tmp_path):
    test = load_data("digits:test")
    x = test.inputs(slice(None)).numpy()
    np.savez(tmp_path / "wrong.npz", x=x, y=((test.y + 1) % 10).numpy())  # labels shifted by one class
    args = ["evaluate", "--posterior", digits_posterior, "--methods", "glm-probit", "--quiet"]
    res = cli(*args, "--data", f"npz:{tmp_path / 'wrong.npz'}")
    assert res.code == 0, res.err
    warnings = [line for line in res.err.splitlines() if line.startswith("warning: MAP accuracy")]
    assert len(warnings) == 1 and "wrong.npz" in warnings[0]
    res = cli(*args, "--data", "digits:test")
    assert res.code == 0 and "MAP accuracy" not in res.err


def test_channel_moments_stream_the_reference_statistics():
    data = load_data("digits:train")
    mean, std = data.channel_moments(rows=500, batch_size=64)
    x = data.inputs(slice(0, 500)).double()
    # float64 sums of 32,000 values in [0, 1] and Σx² − n·mean² with var ≈ 0.15: rounding ≲ 1e-13
    assert_close(mean, x.mean((0, 2, 3)), rtol=1e-10, what="streamed channel mean")
    assert_close(std, x.std((0, 2, 3)), rtol=1e-10, what="streamed channel std (unbiased)")
    flat = load_data("digits:train").map_inputs(partial(torch.flatten, start_dim=1), shape=(64,))
    mean_cols, _ = flat.channel_moments(rows=500)
    assert_close(mean_cols, x.flatten(1).mean(0), rtol=1e-10, atol=1e-12, what="per-column mean")
