"""Where the maths runs: the ``--device`` choice, seeded generators on it, and host boundaries.

With a CUDA device the whole last-layer pipeline stays on it — features, curvature sums
(float64), eigendecompositions (float64), the prior search, predictives, links and metrics —
and only scalars and the final outputs come back to the host. Posterior files are device-free:
tensors are written from the host and read to whichever device the command uses.
"""

from __future__ import annotations

import torch

from bayescli.errors import BayescliError


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU; otherwise ``cpu``/``cuda``/``cuda:i``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BayescliError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BayescliError(f"device {device} requested but CUDA is not available; use --device cpu")
    return dev


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on ``device`` (random draws must be made on the device of
    the tensors they fill; CPU and CUDA streams differ, so seeded draws are per device)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on ``device`` (so wall-clock timings mean something); CPU: no-op."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- chunk sizes --------------------------------------------------------------------------------
#
# Every chunked loop of the maths (the links, Minka, the Dirichlet fVI predictive, detectors,
# curvature sums) asks chunk_elements() how many elements one chunk may hold. On a CPU chunks are
# sized for the cache (each loop keeps its own measured constant: those numbers are today's and
# stay); on a GPU a kernel launch costs ~5 µs whatever its size and ~10⁶ elements already fill
# the device, so cache-sized chunks of 2¹⁸ numbers make hundreds of launch-bound kernels: there a
# chunk is as large as a memory budget allows.

#: Fraction of the device's total memory one chunk's temporaries may take. The total, not the
#: free memory: seeded draws on a GPU depend on the chunks' shapes (each chunk draws its own
#: block), so a chunk must not change with what else happens to be on the device.
CUDA_CHUNK_FRACTION = 1 / 16
#: Cap of that budget (bytes). Beyond ~10⁸ elements a kernel is no faster per element; the rest
#: is left to the caching allocator and to the features and posterior the command holds.
CUDA_CHUNK_MAX_BYTES = 4 << 30
#: Floor of that budget (bytes), for small devices.
CUDA_CHUNK_MIN_BYTES = 64 << 20


def cuda_chunk_bytes(device: torch.device | str) -> int:
    """The bytes one chunk's temporaries may take on the CUDA ``device``:
    ``clamp(total memory × CUDA_CHUNK_FRACTION, CUDA_CHUNK_MIN_BYTES, CUDA_CHUNK_MAX_BYTES)`` —
    4 GiB on an 80 GiB H100 or a 141 GiB H200, 1 GiB on a 16 GiB card."""
    _, total = torch.cuda.mem_get_info(torch.device(device))
    return int(min(CUDA_CHUNK_MAX_BYTES, max(CUDA_CHUNK_MIN_BYTES, total * CUDA_CHUNK_FRACTION)))


def chunk_elements(device: torch.device | str, cpu_elements: int, bytes_per_element: int) -> int:
    """Elements in one chunk of a chunked loop on ``device``.

    * CPU (and any non-CUDA device): ``cpu_elements``, the loop's cache-sized constant, unchanged
      (so CPU numbers and speed do not depend on this policy).
    * CUDA: ``cuda_chunk_bytes(device) // bytes_per_element``, where ``bytes_per_element`` is what
      the loop keeps live per element of a chunk (its temporaries × their element sizes; each
      caller documents its count). A chunk's peak memory is then ``elements × bytes_per_element
      ≤ the budget``: few, large kernels.

    A caller with rows of ``width`` elements takes ``max(1, chunk_elements(...) // width)`` rows
    (:func:`chunk_rows`).
    """
    if torch.device(device).type != "cuda":
        return cpu_elements
    return max(1, cuda_chunk_bytes(device) // max(1, bytes_per_element))


def chunk_rows(device: torch.device | str, width: int, cpu_elements: int, bytes_per_element: int) -> int:
    """Rows of ``width`` elements per chunk: ``max(1, chunk_elements(...) // width)``."""
    return max(1, chunk_elements(device, cpu_elements, bytes_per_element) // max(1, width))
