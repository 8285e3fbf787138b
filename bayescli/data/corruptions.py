"""The 15 corruptions of CIFAR-10-C and ImageNet-C (Hendrycks & Dietterich, 2019), seeded and batched.

``corrupt(x, name, severity, generator)`` maps pixel-space images ``[N, C, H, W]`` in [0, 1]
to corrupted images in [0, 1], for any ``C`` (1 or 3) and any size. Two parameter sets, chosen
by the image size ``S = min(H, W)`` (:func:`parameter_set`):

* ``"cifar10-c"`` (``S < 64``): the severities of ``make_cifar_c.py``. Spatial parameters are in
  pixels of a 32-px image and are scaled by ``max(1, S/32)``, so images of 32 px and smaller
  (MNIST's 28, digits' 8) get the CIFAR values; the elastic warp scales with ``S/32``.
* ``"imagenet-c"`` (``S ≥ 64``): the severities of ``make_imagenet_c.py``, whose spatial
  parameters are in pixels of a 224-px image and are scaled by ``S/224``.

Fog adds the diamond-square plasma fractal of the reference: map size the power of two ≥ the
image (32 for CIFAR) in the CIFAR setting; in the ImageNet setting the reference's 256-px map
(which a 224-px image crops) resampled by ``S/224``, so the fog has the ImageNet-C scale
relative to the image at every size.

Where the original needs what cannot be shipped or reproduced exactly, this module says so
(``APPROXIMATIONS``): ``frost`` blends a procedural ice texture instead of the six frost photos;
``motion_blur``/``snow`` use a one-sided Gaussian-weighted line kernel instead of ImageMagick's;
``glass_blur`` replaces the sequential local swaps by a vectorised random local gather;
``zoom_blur``/``snow`` zoom with bilinear grid sampling instead of ``scipy.ndimage.zoom``;
``elastic_transform`` resamples once for the affine warp and the displacement field together.
Outputs stay floating point (the reference saves uint8 images). As in the original,
``elastic_transform``'s severities trade a large random affine warp
(severity 1) for local elastic distortion (severity 5), so its pixel change does not grow.

``load_official`` reads pre-computed sets: CIFAR-10-C / CIFAR-100-C (``ROOT/NAME.npy``,
``[5·n, 32, 32, 3]`` uint8, severity ``s`` in rows ``(s−1)·n … s·n``) and the MNIST-C layout
(``ROOT/NAME/test_images.npy``, one block, or five blocks stacked the same way).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bayescli.data.base import Source
from bayescli.errors import BayescliError

CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
    "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
    "jpeg_compression",
)  # fmt: skip

APPROXIMATIONS = {
    "frost": "procedural ice texture instead of the original frost photographs",
    "motion_blur": "one-sided Gaussian-weighted line kernel instead of ImageMagick's motion blur",
    "snow": "snow streaks blurred with a line kernel instead of ImageMagick's motion blur; "
    "bilinear zoom instead of scipy.ndimage.zoom",
    "glass_blur": "vectorised random local gather instead of sequential pixel swaps",
    "zoom_blur": "bilinear zoom (torch grid sampling) instead of scipy.ndimage.zoom",
    "elastic_transform": "affine warp and elastic displacement in one bilinear resampling "
    "(reflection border) instead of cv2.warpAffine followed by map_coordinates",
}

IMAGENET_MIN_SIZE = 64  # images with min(H, W) ≥ this get the ImageNet-C parameters
REFERENCE_SIZE = {"cifar10-c": 32, "imagenet-c": 224}  # the size the spatial parameters are in pixels of
_FOG_MAPSIZE = 256  # make_imagenet_c.py's plasma map, cropped to 224 px there

# Severity tables, transcribed from make_cifar_c.py and make_imagenet_c.py (severities 1..5).
# zoom_blur: (stop, step) of the zoom factors arange(1, stop, step); elastic_transform:
# (alpha, sigma, affine) in pixels of the reference size (ImageNet-C writes 244 for 224 and
# keeps it); snow: (loc, scale, zoom, threshold, blur radius, blur sigma, blend).
PARAMETERS: dict[str, dict[str, list]] = {
    "cifar10-c": {
        "gaussian_noise": [0.04, 0.06, 0.08, 0.09, 0.10],
        "shot_noise": [500, 250, 100, 75, 50],
        "impulse_noise": [0.01, 0.02, 0.03, 0.05, 0.07],
        "defocus_blur": [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)],
        "glass_blur": [(0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)],
        "motion_blur": [(6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)],
        "zoom_blur": [(1.06, 0.01), (1.11, 0.01), (1.16, 0.01), (1.21, 0.01), (1.26, 0.01)],
        "snow": [
            (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
            (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
            (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
            (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
            (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
        ],
        "frost": [(1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)],
        "fog": [(0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)],
        "brightness": [0.05, 0.1, 0.15, 0.2, 0.3],
        "contrast": [0.75, 0.5, 0.4, 0.3, 0.15],
        "elastic_transform": [
            (32 * 0, 32 * 0, 32 * 0.08),
            (32 * 0.05, 32 * 0.2, 32 * 0.07),
            (32 * 0.08, 32 * 0.06, 32 * 0.06),
            (32 * 0.1, 32 * 0.04, 32 * 0.05),
            (32 * 0.1, 32 * 0.03, 32 * 0.03),
        ],
        "pixelate": [0.95, 0.9, 0.85, 0.75, 0.65],
        "jpeg_compression": [80, 65, 58, 50, 40],
    },
    "imagenet-c": {
        "gaussian_noise": [0.08, 0.12, 0.18, 0.26, 0.38],
        "shot_noise": [60, 25, 12, 5, 3],
        "impulse_noise": [0.03, 0.06, 0.09, 0.17, 0.27],
        "defocus_blur": [(3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)],
        "glass_blur": [(0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)],
        "motion_blur": [(10, 3), (15, 5), (15, 8), (15, 12), (20, 15)],
        "zoom_blur": [(1.11, 0.01), (1.16, 0.01), (1.21, 0.02), (1.26, 0.02), (1.31, 0.03)],
        "snow": [
            (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
            (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
            (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
            (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
            (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
        ],
        "frost": [(1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)],
        "fog": [(1.5, 2), (2, 2), (2.5, 1.7), (2.5, 1.5), (3, 1.4)],
        "brightness": [0.1, 0.2, 0.3, 0.4, 0.5],
        "contrast": [0.4, 0.3, 0.2, 0.1, 0.05],
        "elastic_transform": [
            (244 * 2, 244 * 0.7, 244 * 0.1),
            (244 * 2, 244 * 0.08, 244 * 0.2),
            (244 * 0.05, 244 * 0.01, 244 * 0.02),
            (244 * 0.07, 244 * 0.01, 244 * 0.02),
            (244 * 0.12, 244 * 0.01, 244 * 0.02),
        ],
        "pixelate": [0.6, 0.5, 0.4, 0.3, 0.25],
        "jpeg_compression": [25, 18, 15, 10, 7],
    },
}


def parameter_set(height: int, width: int) -> str:
    """``"imagenet-c"`` for images with ``min(height, width) ≥ 64``, else ``"cifar10-c"``."""
    return "imagenet-c" if min(height, width) >= IMAGENET_MIN_SIZE else "cifar10-c"


def _check(name: str, severity: int) -> None:
    if name not in CORRUPTIONS:
        raise BayescliError(f"unknown corruption '{name}'; choose from {', '.join(CORRUPTIONS)} or all")
    if severity not in range(1, 6):
        raise BayescliError(f"severity must be 1..5, got {severity}")


def _pad_index(length: int, pad: int, mode: str) -> torch.Tensor:
    """Source index ``[length + 2·pad]`` of each position of an axis padded by ``pad`` on both sides.

    ``mirror`` reflects about the edge pixels (``c b | a b c | b a``, OpenCV's REFLECT_101),
    ``reflect`` about the edges (``b a | a b c | c b``, scipy's ``reflect``), ``nearest`` repeats
    the edge pixel; pads longer than the axis reflect again, as scipy and OpenCV do.
    """
    i = torch.arange(-pad, length + pad)
    if mode == "nearest" or length == 1:
        return i.clamp(0, length - 1)
    if mode == "mirror":
        j = i.remainder(2 * length - 2)
        return torch.where(j < length, j, 2 * length - 2 - j)
    j = i.remainder(2 * length)
    return torch.where(j < length, j, 2 * length - 1 - j)


def _pad(x: torch.Tensor, pad: int, mode: str) -> torch.Tensor:
    """Pad the last two axes of ``x [..., H, W]`` by ``pad`` (see :func:`_pad_index`)."""
    h, w = x.shape[-2:]
    x = x.index_select(-2, _pad_index(h, pad, mode))
    return x.index_select(-1, _pad_index(w, pad, mode))


def _filter(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Correlate every channel with ``kernel [k, k]`` (or per-image ``[N, k, k]``), mirror-padded.

    Mirror padding (OpenCV's default border) is what ``cv2.filter2D`` uses in the reference.
    """
    n, c, h, w = x.shape
    k = kernel.shape[-1]
    pad = k // 2
    xp = _pad(x, pad, "mirror")
    if kernel.dim() == 2:
        weight = kernel.to(x)[None, None].expand(c, 1, k, k)
        return F.conv2d(xp, weight, groups=c)
    weight = kernel.to(x)[:, None].repeat_interleave(c, 0)  # [N·C, 1, k, k]
    out = F.conv2d(xp.reshape(1, n * c, h + 2 * pad, w + 2 * pad), weight, groups=n * c)
    return out.reshape(n, c, h, w)


def _blur_matrix(length: int, sigma: float, mode: str, truncate: float) -> torch.Tensor:
    """The 1-D Gaussian blur of an axis of ``length`` samples as a matrix ``[length, length]``.

    ``B[i, j] = Σ_t g(t) · [pad(i + t) = j]`` with ``g(t) ∝ exp(−t²/2σ²)`` on
    ``|t| ≤ ⌊truncate·σ + ½⌋`` (scipy.ndimage's support) and ``pad`` the boundary ``mode``;
    as a matrix the blur costs ``O(length)`` per pixel whatever the kernel width.
    """
    radius = int(truncate * sigma + 0.5)
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    g = torch.exp(-0.5 * (t / sigma) ** 2)
    g = g / g.sum()
    src = _pad_index(length, radius, mode).unfold(0, 2 * radius + 1, 1)  # [length, 2r+1]
    rows = torch.arange(length)[:, None].expand_as(src)
    b = torch.zeros(length, length, dtype=torch.float64)
    b.index_put_((rows, src), g.expand_as(src).clone(), accumulate=True)
    return b


def _gaussian_blur(x: torch.Tensor, sigma: float, mode: str, truncate: float) -> torch.Tensor:
    """Separable Gaussian blur of ``x [N, C, H, W]`` per channel (``skimage.filters.gaussian``)."""
    if sigma <= 0:
        return x
    h, w = x.shape[-2:]
    bh = _blur_matrix(h, sigma, mode, truncate).to(x)
    bw = _blur_matrix(w, sigma, mode, truncate).to(x)
    return bh @ x @ bw.T


def _line_kernels(
    n: int, radius: float, sigma: float, lo: float, hi: float, gen: torch.Generator
) -> torch.Tensor:
    """One-sided motion kernels ``[n, k, k]`` along random angles in ``[lo, hi]`` degrees."""
    r = max(1, int(math.ceil(radius)))
    k = 2 * r + 1
    angles = torch.empty(n).uniform_(lo, hi, generator=gen) * math.pi / 180
    steps = torch.linspace(0, radius, 4 * r + 1)
    weights = torch.exp(-(steps**2) / (2 * sigma**2))
    kernels = torch.zeros(n, k, k)
    for i, a in enumerate(angles):
        xs, ys = r + steps * torch.cos(a), r - steps * torch.sin(a)
        x0, y0 = xs.floor().long().clamp(0, k - 1), ys.floor().long().clamp(0, k - 1)
        x1, y1 = (x0 + 1).clamp(max=k - 1), (y0 + 1).clamp(max=k - 1)
        fx, fy = xs - x0, ys - y0
        for xi, yi, wt in (
            (x0, y0, (1 - fx) * (1 - fy)),
            (x1, y0, fx * (1 - fy)),
            (x0, y1, (1 - fx) * fy),
            (x1, y1, fx * fy),
        ):
            kernels[i].index_put_((yi, xi), weights * wt, accumulate=True)
    return kernels / kernels.sum((1, 2), keepdim=True)


def _clipped_zoom(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Zoom into the centre by ``factor`` (bilinear, output the input's size)."""
    theta = torch.tensor([[1 / factor, 0.0, 0.0], [0.0, 1 / factor, 0.0]], dtype=x.dtype)
    grid = F.affine_grid(theta.expand(len(x), 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _plasma(n: int, mapsize: int, decay: float, gen: torch.Generator) -> torch.Tensor:
    """Diamond-square fractals ``[n, mapsize, mapsize]`` in [0, 1] (the reference ``plasma_fractal``).

    ``mapsize`` is a power of two; the map is periodic. Starting from ``m[0, 0] = 0``, each octave
    (step ``s`` = mapsize, mapsize/2, …, 2) sets the centre of every square of corners ``s`` apart,
    then the midpoint of every edge (its two corners and two neighbouring centres), to the mean
    of its four neighbours plus ``w·U(−w, w)``; ``w`` starts at 100 and is divided by ``decay``
    after each octave, so octave ``k`` has amplitude ``100²/decay^{2k}``. The map is then
    min-max normalised to [0, 1].
    """
    if mapsize & (mapsize - 1) or mapsize < 2:
        raise ValueError(f"mapsize must be a power of two ≥ 2, got {mapsize}")
    m = mapsize
    maps = torch.zeros(n, m, m, dtype=torch.float64)
    step, wibble = m, 100.0

    def perturbed(mean: torch.Tensor) -> torch.Tensor:
        return mean + wibble * torch.empty_like(mean).uniform_(-wibble, wibble, generator=gen)

    while step >= 2:
        half = step // 2
        corners = maps[:, 0:m:step, 0:m:step]
        down = torch.roll(corners, -1, 1)
        square = (corners + down + torch.roll(corners, -1, 2) + torch.roll(down, -1, 2)) / 4
        maps[:, half:m:step, half:m:step] = perturbed(square)
        centres = maps[:, half:m:step, half:m:step]
        # edge midpoints on corner rows: corners left/right, centres below/above
        d1 = (corners + torch.roll(corners, -1, 2) + centres + torch.roll(centres, 1, 1)) / 4
        maps[:, 0:m:step, half:m:step] = perturbed(d1)
        # edge midpoints on centre rows: corners above/below, centres right/left
        d2 = (corners + torch.roll(corners, -1, 1) + centres + torch.roll(centres, 1, 2)) / 4
        maps[:, half:m:step, 0:m:step] = perturbed(d2)
        step = half
        wibble /= decay
    lo = maps.amin((1, 2), keepdim=True)
    hi = maps.amax((1, 2), keepdim=True)
    return (maps - lo) / (hi - lo).clamp_min(1e-12)


def _pow2_at_least(size: int) -> int:
    return 1 << max(1, math.ceil(math.log2(max(size, 2))))


def _fog_layer(n: int, h: int, w: int, decay: float, params: str, gen: torch.Generator) -> torch.Tensor:
    """The fog of ``n`` images ``[n, 1, h, w]`` in [0, 1]: a crop of a plasma fractal.

    CIFAR-10-C: a map of the image's size (power of two ≥ it: 32 at 32 px), cropped.
    ImageNet-C: the reference 256-px map for 224-px images, resampled by ``min(h, w)/224``
    (none at 224 px), cropped; larger maps where an elongated image needs them.
    """
    if params == "cifar10-c":
        return _plasma(n, _pow2_at_least(max(h, w)), decay, gen)[:, None, :h, :w].float()
    s = min(h, w) / REFERENCE_SIZE["imagenet-c"]
    mapsize = max(_FOG_MAPSIZE, _pow2_at_least(math.ceil(max(h, w) / s)))
    maps = _plasma(n, mapsize, decay, gen)[:, None].float()
    side = max(h, w, round(mapsize * s))
    if side != mapsize:
        maps = F.interpolate(maps, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
    return maps[:, :, :h, :w]


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:
        return x
    w = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype).view(1, 3, 1, 1)
    return (x * w).sum(1, keepdim=True)


def _snow(x: torch.Tensor, c: tuple, s: float, gen: torch.Generator) -> torch.Tensor:
    n, _, h, w = x.shape
    layer = torch.randn(n, 1, h, w, generator=gen) * c[1] + c[0]
    layer = _clipped_zoom(layer, c[2])
    layer = torch.where(layer < c[3], torch.zeros_like(layer), layer).clamp(0, 1)
    layer = _filter(layer, _line_kernels(n, c[4] * s, c[5] * s, -135, -45, gen))
    x = c[6] * x + (1 - c[6]) * torch.maximum(x, _gray(x) * 1.5 + 0.5)
    return x + layer + torch.rot90(layer, 2, (2, 3))


def _frost(x: torch.Tensor, c: tuple, gen: torch.Generator) -> torch.Tensor:
    n, ch, h, w = x.shape
    # Ice: a rough fractal (slow decay keeps fine octaves), sharpened into crystal-like ridges,
    # tinted light blue.
    base = _plasma(n, _pow2_at_least(max(h, w)), 1.3, gen)[:, None, :h, :w].float()
    ridges = (1 - (2 * base - 1).abs()) ** 4
    tint = torch.tensor([0.85, 0.9, 1.0])[:ch].view(1, ch, 1, 1) if ch == 3 else torch.ones(1, ch, 1, 1)
    return c[0] * x + c[1] * ridges * tint


def _elastic(x: torch.Tensor, c: tuple, gen: torch.Generator) -> torch.Tensor:
    """Random affine warp of the reference's three points by ``U(−c[2], c[2])`` pixels, then a
    displacement field ``c[0]·G_{c[1]} * U(−1, 1)`` (Gaussian-blurred, reflect, truncate 3)."""
    n, _, h, w = x.shape
    alpha, sigma, affine = c
    size = min(h, w)
    centre = torch.tensor([w / 2, h / 2])
    sq = size // 3
    pts1 = torch.stack([centre + sq, torch.stack([centre[0] + sq, centre[1] - sq]), centre - sq])  # [3, 2]
    thetas = []
    for _ in range(n):
        pts2 = pts1 + torch.empty(3, 2).uniform_(-affine, affine, generator=gen)
        src = torch.cat([pts2, torch.ones(3, 1)], 1)
        # inverse map (output pixel -> input pixel): pts2 -> pts1
        m = torch.linalg.solve(src, pts1).T  # [2, 3] in pixel coordinates
        thetas.append(m)
    theta = torch.stack(thetas)
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
    )
    grid_px = torch.stack([xs, ys, torch.ones_like(xs)], -1)  # [h, w, 3]
    src_px = torch.einsum("nij,hwj->nhwi", theta, grid_px)  # [n, h, w, 2]
    if alpha > 0 and sigma > 0:
        noise = torch.empty(n, 2, h, w).uniform_(-1, 1, generator=gen)
        disp = _gaussian_blur(noise, sigma, "reflect", 3.0) * alpha  # [n, 2, h, w] (dx, dy)
        src_px = src_px + disp.permute(0, 2, 3, 1)
    grid = torch.stack([2 * src_px[..., 0] / max(w - 1, 1) - 1, 2 * src_px[..., 1] / max(h - 1, 1) - 1], -1)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=True)


def _jpeg(x: torch.Tensor, quality: int) -> torch.Tensor:
    from PIL import Image

    out = []
    for img in (x.clamp(0, 1) * 255).round().to(torch.uint8):
        arr = img.permute(1, 2, 0).numpy()
        pil = (
            Image.fromarray(arr[..., 0], mode="L") if arr.shape[2] == 1 else Image.fromarray(arr, mode="RGB")
        )
        buf = io.BytesIO()
        pil.save(buf, "JPEG", quality=quality)
        back = np.asarray(Image.open(io.BytesIO(buf.getvalue())), dtype=np.uint8)
        back = back[..., None] if back.ndim == 2 else back
        out.append(torch.from_numpy(back.copy()).permute(2, 0, 1))
    return torch.stack(out).float() / 255


def _disk(radius: float, alias_blur: float) -> torch.Tensor:
    """The reference's anti-aliased disk kernel ``[k, k]``.

    The indicator of ``x² + y² ≤ r²`` on the integer grid ``|x|, |y| ≤ max(8, ⌈r⌉)``, normalised
    to sum 1, then Gaussian-blurred (σ = ``alias_blur``, 3×3 kernel for ``r ≤ 8`` else 5×5,
    mirror border), as ``cv2.GaussianBlur`` does in ``make_*_c.py``; cropped to its nonzero
    support, which changes no filtered value.
    """
    span = max(8, math.ceil(radius))
    t = torch.arange(-span, span + 1, dtype=torch.float64)
    yy, xx = torch.meshgrid(t, t, indexing="ij")
    disk = ((xx**2 + yy**2) <= radius**2).double()
    disk /= disk.sum()
    half = 1 if radius <= 8 else 2
    g = torch.exp(-0.5 * (torch.arange(-half, half + 1, dtype=torch.float64) / alias_blur) ** 2)
    g = g / g.sum()
    blurred = F.conv2d(_pad(disk[None, None], half, "mirror"), torch.outer(g, g)[None, None])[0, 0]
    nz = (blurred != 0).any(0).nonzero()
    r = int(max(span - nz.min(), nz.max() - span))
    return blurred[span - r : span + r + 1, span - r : span + r + 1].float()


def _box_resize_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """PIL's ``BOX`` resampling of one axis as a matrix ``[n_out, n_in]``.

    Output pixel ``i`` (centre ``c = (i + ½)·r``, ``r = n_in/n_out``) averages the input pixels
    ``j`` with ``(j + ½ − c)/max(r, 1) ∈ (−½, ½]`` among ``⌊c ∓ max(r, 1)/2 + ½⌋`` (PIL's box
    filter and its rounded support): those whose centres fall in the output pixel's footprint;
    for ``r < 1`` the input pixel under its centre.
    """
    scale = n_in / n_out
    fscale = max(scale, 1.0)
    support = 0.5 * fscale
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        centre = (i + 0.5) * scale
        lo, hi = max(int(centre - support + 0.5), 0), min(int(centre + support + 0.5), n_in)
        j = torch.arange(lo, hi, dtype=torch.float64)
        u = (j - centre + 0.5) / fscale
        m[i, lo:hi] = ((u > -0.5) & (u <= 0.5)).double()
    return m / m.sum(1, keepdim=True)


def _pixelate(x: torch.Tensor, c: float) -> torch.Tensor:
    """Box-downsample to ``⌊c·H⌋ × ⌊c·W⌋`` and box-upsample back (PIL ``BOX`` both ways)."""
    h, w = x.shape[-2:]
    sh, sw = max(1, int(h * c)), max(1, int(w * c))
    down_h, down_w = _box_resize_matrix(h, sh).to(x), _box_resize_matrix(w, sw).to(x)
    up_h, up_w = _box_resize_matrix(sh, h).to(x), _box_resize_matrix(sw, w).to(x)
    return (up_h @ down_h) @ x @ (up_w @ down_w).T


def _brightness(x: torch.Tensor, c: float) -> torch.Tensor:
    """HSV value ``V = max_c x`` raised to ``min(V + c, 1)`` at fixed hue and saturation: RGB
    scales by ``V'/V``; black (``V = 0``, saturation undefined, taken as 0) turns grey ``c``."""
    v = x.amax(1, keepdim=True)
    return torch.where(v > 0, x * (v + c).clamp(0, 1) / v.clamp_min(1e-12), torch.full_like(x, c))


def corrupt(x: torch.Tensor, name: str, severity: int, generator: torch.Generator) -> torch.Tensor:
    """Apply corruption ``name`` at ``severity`` (1–5) to ``x [N, C, H, W]`` in [0, 1].

    The parameter set is :func:`parameter_set` of the image size; spatial parameters are
    scaled from the set's reference size (see the module docstring).
    """
    _check(name, severity)
    h, w = x.shape[-2:]
    params = parameter_set(h, w)
    c = PARAMETERS[params][name][severity - 1]
    ratio = min(h, w) / REFERENCE_SIZE[params]
    s = max(1.0, ratio) if params == "cifar10-c" else ratio
    x = x.float()
    g = generator
    if name == "gaussian_noise":
        out = x + c * torch.randn(x.shape, generator=g)
    elif name == "shot_noise":
        out = torch.poisson(x * c, generator=g) / c
    elif name == "impulse_noise":
        u = torch.rand(x.shape, generator=g)
        salt = torch.rand(x.shape, generator=g) < 0.5
        out = torch.where(u < c, salt.float(), x)
    elif name == "defocus_blur":
        out = _filter(x, _disk(c[0] * s, c[1] * s))
    elif name == "glass_blur":
        sigma, delta, iters = c[0] * s, max(1, round(c[1] * s)), c[2]
        # skimage.filters.gaussian's defaults in the reference: nearest border, truncate 4
        out = _gaussian_blur(x, sigma, "nearest", 4.0)
        n = len(x)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        for _ in range(iters):
            dy = torch.randint(-delta, delta, (n, 1, h, w), generator=g)
            dx = torch.randint(-delta, delta, (n, 1, h, w), generator=g)
            yy, xx = (ys + dy).clamp(0, h - 1), (xs + dx).clamp(0, w - 1)
            flat = (yy * w + xx).expand(-1, x.shape[1], -1, -1).reshape(n, x.shape[1], -1)
            out = out.reshape(n, x.shape[1], -1).gather(2, flat).reshape(x.shape)
        out = _gaussian_blur(out, sigma, "nearest", 4.0)
    elif name == "motion_blur":
        out = _filter(x, _line_kernels(len(x), c[0] * s, c[1] * s, -45, 45, g))
    elif name == "zoom_blur":
        factors = np.arange(1, c[0], c[1])
        out = (x + sum(_clipped_zoom(x, float(f)) for f in factors)) / (len(factors) + 1)
    elif name == "snow":
        out = _snow(x, c, s, g)
    elif name == "frost":
        out = _frost(x, c, g)
    elif name == "fog":
        fog = _fog_layer(len(x), h, w, c[1], params, g)
        max_val = x.amax((1, 2, 3), keepdim=True)
        out = (x + c[0] * fog) * max_val / (max_val + c[0])
    elif name == "brightness":
        out = _brightness(x, c)
    elif name == "contrast":
        mean = x.mean((2, 3), keepdim=True)
        out = (x - mean) * c + mean
    elif name == "elastic_transform":
        out = _elastic(x, tuple(v * ratio for v in c), g)
    elif name == "pixelate":
        out = _pixelate(x, c)
    else:  # jpeg_compression
        out = _jpeg(x, c)
    return out.clamp(0, 1)


def parse_corruptions(text: str) -> list[str]:
    """``all`` or a comma-separated list of names."""
    if text.strip() == "all":
        return list(CORRUPTIONS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        _check(name, 1)
    return names


def parse_severities(text: str) -> list[int]:
    """``1-5`` or ``1,3,5``."""
    try:
        if "-" in text:
            lo, hi = (int(t) for t in text.split("-", 1))
            values = list(range(lo, hi + 1))
        else:
            values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise BayescliError(f"--severity must look like 1-5 or 1,3,5; got '{text}'") from None
    if not values or any(v not in range(1, 6) for v in values):
        raise BayescliError(f"severities must be within 1..5; got '{text}'")
    return values


def _official_block(root: Path, name: str, severity: int, n_test: int) -> tuple[Path, np.ndarray]:
    """The file holding ``name`` and its block of ``n_test`` images at ``severity`` (memory-mapped)."""
    flat, nested = root / f"{name}.npy", root / name / "test_images.npy"
    path = flat if flat.is_file() else nested
    if not path.is_file():
        raise BayescliError(f"no {flat.name} or {name}/test_images.npy under {root}; check --corruption-root")
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if len(arr) == 5 * n_test:
        return path, arr[(severity - 1) * n_test : severity * n_test]
    if len(arr) == n_test:
        return path, arr  # a single-severity set (MNIST-C): the same images for every severity
    raise BayescliError(
        f"{path} has {len(arr)} images; expected {n_test} or 5×{n_test} to match the test set"
    )


def _channels_first(imgs: torch.Tensor) -> torch.Tensor:
    return imgs.unsqueeze(1) if imgs.dim() == 3 else imgs.permute(0, 3, 1, 2).contiguous()


def load_official(root: Path, name: str, severity: int, rows: torch.Tensor, n_test: int) -> torch.Tensor:
    """Corrupted images ``[len(rows), C, H, W]`` uint8 from an official CIFAR-C / MNIST-C folder.

    ``rows`` index the clean test set (of size ``n_test``) that the corrupted blocks mirror.
    """
    _, block = _official_block(root, name, severity, n_test)
    return _channels_first(torch.from_numpy(np.ascontiguousarray(block[rows.numpy()])))


class OfficialSource(Source):
    """One severity block of an official corrupted set, memory-mapped: rows are read on demand."""

    def __init__(self, root: Path, name: str, severity: int, n_test: int) -> None:
        super().__init__()
        self.args = (root, name, severity, n_test)
        path, block = _official_block(root, name, severity, n_test)
        self.labels, self.n = None, len(block)
        self.shape = tuple(_channels_first(torch.zeros(1, *block.shape[1:])).shape[1:])
        self._block: np.ndarray | None = block

    def __getstate__(self) -> dict:  # workers started by spawn map the file themselves
        return {**self.__dict__, "_block": None}

    def __len__(self) -> int:
        return self.n

    def load_many(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
        if self._block is None:
            self._block = _official_block(*self.args)[1]
        imgs = _channels_first(torch.from_numpy(np.ascontiguousarray(self._block[rows.numpy()])))
        return (imgs.float().div_(255.0) if imgs.dtype == torch.uint8 else imgs.float()), rows, []
