"""Dataset shift for evaluation: rotations and synthetic out-of-distribution inputs.

* ``rotate(x, angle)``: images ``[N, C, H, W]`` rotated counter-clockwise about the centre,
  bilinear, zero fill (Ovadia et al., 2019); multiples of 360° return ``x`` unchanged.
* ``synthetic_ood(spec, reference, n, seed)``: OOD sets that need no download and take the
  reference set's input shape — ``noise:uniform`` (U[0, 1] pixels), ``noise:gaussian``
  (per-channel mean and std of the reference data, clipped to [0, 1]) and ``patches`` (random
  crops of the natural photographs bundled with scikit-learn, resized to the input size and
  converted to its channel count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bayescli.data.base import ArrayData
from bayescli.errors import BayescliError

SYNTHETIC_OOD = ("noise:uniform", "noise:gaussian", "patches")


def rotate(x: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate images ``[N, C, H, W]`` by ``angle`` degrees (counter-clockwise)."""
    if x.dim() != 4:
        raise BayescliError(f"rotation needs image inputs [N, C, H, W], got {list(x.shape)}")
    if float(angle) % 360 == 0:
        return x
    from torchvision.transforms.functional import InterpolationMode
    from torchvision.transforms.functional import rotate as tv_rotate

    return tv_rotate(x, float(angle), interpolation=InterpolationMode.BILINEAR, fill=0.0)


def parse_angles(text: str) -> list[float]:
    """``START:STOP:STEP`` (inclusive of STOP) or ``a,b,c``."""
    try:
        if ":" in text:
            start, stop, step = (float(t) for t in text.split(":"))
            if step <= 0:
                raise ValueError
            count = int(round((stop - start) / step)) + 1
            return [start + i * step for i in range(max(count, 0))]
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise BayescliError(f"--rotation must look like 0:180:15 or 0,90,180; got '{text}'") from None


def _patches(reference: ArrayData, n: int, gen: torch.Generator) -> torch.Tensor:
    from sklearn.datasets import load_sample_images

    photos = [torch.tensor(img).permute(2, 0, 1).float() / 255 for img in load_sample_images().images]
    c, h, w = reference.input_shape
    out = []
    for _ in range(n):
        photo = photos[int(torch.randint(len(photos), (1,), generator=gen))]
        side = int(torch.randint(32, 129, (1,), generator=gen))
        top = int(torch.randint(photo.shape[1] - side + 1, (1,), generator=gen))
        left = int(torch.randint(photo.shape[2] - side + 1, (1,), generator=gen))
        out.append(photo[:, top : top + side, left : left + side])
    patches = torch.stack([F.interpolate(p[None], size=(h, w), mode="area")[0] for p in out])
    if c == 1:
        patches = (patches * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    elif c != 3:
        raise BayescliError(f"patches need 1- or 3-channel images, the data has {c} channels")
    return patches.clamp(0, 1)


def synthetic_ood(spec: str, reference: ArrayData, n: int, seed: int = 0) -> ArrayData:
    """``n`` synthetic OOD inputs shaped like ``reference``'s (see module docs)."""
    gen = torch.Generator().manual_seed(seed)
    shape = reference.input_shape
    if spec == "noise:uniform":
        x = torch.rand(n, *shape, generator=gen)
    elif spec == "noise:gaussian":
        ref = reference.inputs(slice(0, 5000))
        dims = [0, 2, 3] if ref.dim() == 4 else [0]
        mean, std = ref.mean(dims, keepdim=True), ref.std(dims, keepdim=True)
        x = (mean + std * torch.randn(n, *shape, generator=gen)).clamp(0, 1)
    elif spec == "patches":
        if len(shape) != 3:
            raise BayescliError("patches need image inputs [C, H, W]")
        x = _patches(reference, n, gen)
    else:
        raise BayescliError(f"unknown synthetic OOD '{spec}'; use one of {', '.join(SYNTHETIC_OOD)}")
    return ArrayData(x, None, reference.class_names, {"spec": spec, "n": n, "seed": seed, "synthetic": True})
