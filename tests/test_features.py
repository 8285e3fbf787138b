import torch
from tolerance import assert_close

from bayescli.data import load_data
from bayescli.models.features import extract_features
from bayescli.models.specs import load_classifier


def test_features_reproduce_logits_and_cache_is_keyed(digits_ckpt, tmp_path):
    model = load_classifier("builtin:small-cnn", digits_ckpt)
    data = load_data("digits:test", limit=64)
    cache = tmp_path / "cache.safetensors"
    feats = extract_features(model, data, batch_size=16, cache=cache)
    assert feats.phi.shape == (64, 128) and feats.logits.shape == (64, 10)
    # float32 logits of order 10 computed by the same head in batches of 16 vs 64: a few ulps
    # (≲ 1e-6); 1e-5 leaves a margin of about 10×
    assert_close(model.classifier.head(feats.phi), feats.logits, atol=1e-5, what="head(φ) = logits")
    with torch.no_grad():
        full = model.classifier(data.inputs(slice(None)))
        assert_close(full, feats.logits, atol=1e-5, what="forward = cached logits")
    again = extract_features(model, data, cache=cache)
    assert again.seconds == 0.0 and torch.equal(again.phi, feats.phi)
    other = load_data("digits:test", limit=64, seed=1)  # different rows: the cache is stale
    fresh = extract_features(model, other, cache=cache)
    assert fresh.seconds > 0 and not torch.equal(fresh.phi, feats.phi)
