"""Dataset shift for evaluation: rotations and synthetic out-of-distribution inputs.

* ``rotate(x, angle)``: images ``[N, C, H, W]`` rotated counter-clockwise about the centre,
  bilinear, zero fill (Ovadia et al., 2019); multiples of 360° return ``x`` unchanged.
* ``synthetic_ood(spec, reference, n, seed)``: OOD sets that need no download and take the
  reference set's input shape — ``noise:uniform`` (U[0, 1] pixels), ``noise:gaussian``
  (per-channel mean and std of the first 5,000 reference inputs, clipped to [0, 1]) and
  ``patches`` (random crops of the natural photographs bundled with scikit-learn, resized to the
  input size and converted to its channel count). Inputs are generated item by item while
  iterating, each from a generator seeded by ``(seed, row)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bayescli.data.base import Data, Source
from bayescli.errors import BayescliError
from bayescli.numbers import parse_number

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
            start, stop, step = (parse_number(t, "--rotation") for t in text.split(":"))
            if step <= 0:
                raise ValueError
            count = int(round((stop - start) / step)) + 1
            return [start + i * step for i in range(max(count, 0))]
        return [parse_number(t, "--rotation") for t in text.split(",") if t.strip()]
    except (ValueError, BayescliError):
        raise BayescliError(f"--rotation must look like 0:180:15 or 0,90,180; got '{text}'") from None


class SyntheticSource(Source):
    """``n`` generated inputs of ``shape``; item ``i`` comes from its own generator seeded by
    ``(seed, i)``, so any row can be produced alone, in any worker, always the same."""

    def __init__(
        self,
        kind: str,
        n: int,
        shape: tuple[int, ...],
        seed: int,
        mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.n, self.shape, self.seed = kind, n, tuple(shape), seed
        self.mean, self.std, self.labels = mean, std, None
        self.photos: list[torch.Tensor] = []
        if kind == "patches":
            if len(self.shape) != 3:
                raise BayescliError("patches need image inputs [C, H, W]")
            if self.shape[0] not in (1, 3):
                raise BayescliError(
                    f"patches need 1- or 3-channel images, the data has {self.shape[0]} channels"
                )
            from sklearn.datasets import load_sample_images

            self.photos = [
                torch.tensor(img).permute(2, 0, 1).float() / 255 for img in load_sample_images().images
            ]

    def __len__(self) -> int:
        return self.n

    def load(self, row: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + row) % (2**63))
        if self.kind == "noise:uniform":
            return torch.rand(self.shape, generator=gen)
        if self.kind == "noise:gaussian":
            return (self.mean + self.std * torch.randn(self.shape, generator=gen)).clamp(0, 1)
        return self._patch(gen)

    def _patch(self, gen: torch.Generator) -> torch.Tensor:
        """A random square crop (32–128 px) of a bundled photograph, resized to the input size."""
        photo = self.photos[int(torch.randint(len(self.photos), (1,), generator=gen))]
        side = int(torch.randint(32, 129, (1,), generator=gen))
        top = int(torch.randint(photo.shape[1] - side + 1, (1,), generator=gen))
        left = int(torch.randint(photo.shape[2] - side + 1, (1,), generator=gen))
        crop = photo[None, :, top : top + side, left : left + side]
        patch = F.interpolate(crop, size=self.shape[1:], mode="area")[0]
        if self.shape[0] == 1:
            patch = (patch * torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)).sum(0, keepdim=True)
        return patch.clamp(0, 1)


def synthetic_ood(spec: str, reference: Data, n: int, seed: int = 0) -> Data:
    """``n`` synthetic OOD inputs shaped like ``reference``'s (see module docs), generated lazily."""
    if spec not in SYNTHETIC_OOD:
        raise BayescliError(f"unknown synthetic OOD '{spec}'; use one of {', '.join(SYNTHETIC_OOD)}")
    mean = std = None
    if spec == "noise:gaussian":
        shape = (-1, 1, 1) if len(reference.input_shape) == 3 else tuple(reference.input_shape)
        mean, std = (m.float().reshape(shape) for m in reference.channel_moments(5000))
    source = SyntheticSource(spec, n, reference.input_shape, seed, mean, std)
    info = {"spec": spec, "n": n, "seed": seed, "synthetic": True}
    return Data(source, reference.class_names, info, num_workers=reference.num_workers)
