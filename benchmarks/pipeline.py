"""Whole pipeline: what GLM + probit adds to a real backbone's forward pass.

timm ``resnet18`` (random weights, ``pretrained=False``), 32×32 inputs, K = 10, 2,000 inputs.
The last-layer KFAC posterior is fitted on the same features (labels drawn from the model);
the predictive + link time is reported as a fraction of the plain forward pass.

Run: ``python benchmarks/pipeline.py``
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, setup_threads  # noqa: E402

from bayescli.data import ArrayData  # noqa: E402
from bayescli.models.features import extract_features  # noqa: E402
from bayescli.models.specs import load_classifier  # noqa: E402
from bayescli.posterior.laplace import LaplacePosterior  # noqa: E402
from bayescli.predictive.links import probit  # noqa: E402


def main() -> None:
    import timm

    torch.manual_seed(0)
    net = timm.create_model("resnet18", pretrained=False, num_classes=10)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "r18.safetensors"
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(ckpt))
        model = load_classifier("timm:resnet18", ckpt)
    data = ArrayData(torch.rand(2000, 3, 32, 32), None, [str(i) for i in range(10)], {"spec": "random"})
    feats = extract_features(model, data, batch_size=250)
    forward = best_of(lambda: extract_features(model, data, batch_size=250), repeat=2)
    labels = feats.logits.softmax(-1).multinomial(1).squeeze(1)
    post = LaplacePosterior.fit_last_layer(feats.phi, labels, model.classifier.head, "kron")
    post.optimise_prior_marglik()
    extra = best_of(lambda: probit(post.logit_gaussian(feats.phi)), repeat=5)
    print(f"# pipeline: timm resnet18, 2,000 inputs of 3×32×32, {setup_threads()}")
    share = 100 * extra / forward
    print(f"forward {forward:.3f}s | GLM+probit {1e3 * extra:.2f}ms | adds {share:.2f}% (target ≤ 5%)")


if __name__ == "__main__":
    main()
