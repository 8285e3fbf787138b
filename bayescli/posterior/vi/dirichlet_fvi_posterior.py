"""The Dirichlet fVI posterior: the family's tensors, its Dirichlet predictive and files.

Fitted post hoc by :func:`bayescli.posterior.vi.dirichlet_fvi.fit` or trained from scratch by
:func:`bayescli.training.dirichlet_fvi.train` (the objective and families:
:mod:`bayescli.posterior.vi.dirichlet_fvi`).

Predictive (VI-SPEC A2): the ``M`` test-time samples give ``Dir(α)`` per input (the same Minka
estimate); the logit Gaussian is its Laplace-bridge image (seed 004, eqs. 5–6)
``μ_k = ln α_k − mean_l ln α_l``, ``Σ_kl = δ_kl/α_k − (1/K)(1/α_k + 1/α_l − (1/K) Σ_u 1/α_u)``
(rank ``K − 1``: ``Σ1 = 0``), with ``alpha = α`` and ``exact = False``. The bridge link returns
``α`` itself and ``softmax(μ) = α/α₀``, so both reproduce the Dirichlet predictive exactly; probit,
SODPP and MC act on the Gaussian and only approximate it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from bayescli import devices
from bayescli.dirichlet import dirichlet_to_gaussian, fit_precision_vectorised
from bayescli.errors import BayescliError
from bayescli.models.specs import Classifier
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.gaussian import LogitGaussian
from bayescli.posterior.vi.dirichlet_fvi_samples import ensemble_member_logits, head_logits, network_logits
from bayescli.posterior.vi.dirichlet_fvi_settings import GAMMA

FULL_COV_MAX_CLASSES = 64  # above this, the logit Gaussian carries diag Σ only
PREDICT_CHUNK_ELEMENTS = 1 << 23  # samples × inputs × classes per sampled chunk on a CPU
# Bytes per sample × input × class of a sampled chunk on CUDA (predict_chunk_rows): the logits and
# their softmax in float32 (4 + 4), its float64 copy (8) and the sampler's temporaries (8) ...
PREDICT_SAMPLE_BYTES = 24
# ... plus, per input × class, ~12 float64 [rows, K] arrays (the two sample means, ln ᾱ, Minka's
# workspace of 2 × 8 buffers in float32 and float64, α and the bridge's μ and diag Σ).
PREDICT_ROW_BYTES = 12 * 8
MEMBER_CHUNK_ELEMENTS = 1 << 20  # inputs × classes per member GEMM of a head ensemble on the CPU
MEMBER_BUFFER_ELEMENTS = 1 << 24  # members × inputs × classes of its logits buffer (64 MiB float32)
CACHE_CHUNK_ELEMENTS = 1 << 19  # samples × inputs × classes per sample-means pass (in cache)
MINKA_CHUNK_ELEMENTS = 1 << 18  # inputs × classes per Minka/bridge pass (float64)
INPUT_CHUNK_IMAGES = 2048  # images per network pass (all samples) in whole-network predictives
# −ln of the smallest product of factors ≥ c that float64 holds with room to spare (≈ 1e-282)
_PRODUCT_LOG_FLOOR = 650.0


@torch.no_grad()
def sample_means(
    logits: torch.Tensor,
    gamma: float,
    out: torch.Tensor | None = None,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sufficient statistics of the smoothed samples ``f̃_m = (1 − γ) p_m + γ/K``, ``p_m =
    softmax(l_m)``, for member logits ``logits [M, N, K]``: ``[2, N, K]`` (float64) with ``Σ_m f̃_m``
    in row 0 (``ᾱ`` up to its normalisation, :func:`normalised_means`) and ``ᾰ = (1/M) Σ_m ln f̃_m``
    in row 1, written into ``out`` if given. ``work``: scratch ``[M, N, K]`` in the logits' dtype and
    in float64 (or ``None``).

    ``p_m`` is the logits' dtype's softmax (as in training); everything after it is float64, so the
    result is the float64 estimator of those samples to float64 rounding (a float32 ``p + c`` alone
    would move ``z`` of near-identical members by ~3e−7). Logs are the costly part, so
    ``Σ_m ln f̃_m = M ln(1 − γ) + ln Π_m (p_m + c)`` with ``c = γ/(K(1 − γ))``: one log of ``[N, K]``
    per run of members whose product cannot underflow (each factor is ≥ ``c``) instead of ``M``.
    ``γ = 0`` sums ``log_softmax`` instead (``p`` may underflow to 0; ``ᾰ`` then carries the
    logits' dtype's rounding of ``log_softmax``).
    """
    m, n, k = logits.shape
    if out is None:
        out = logits.new_empty(2, n, k, dtype=torch.float64)
    if work is None:
        work = (torch.empty_like(logits), torch.empty_like(logits, dtype=torch.float64))
    narrow, wide = work
    total, log_sum = out[0], out[1]
    if gamma == 0:
        torch.sum(wide.copy_(torch.softmax(logits, -1, out=narrow)), 0, out=total)
        torch.sum(wide.copy_(torch.log_softmax(logits, -1, out=narrow)), 0, out=log_sum).div_(m)
        return out
    p = wide.copy_(torch.softmax(logits, -1, out=narrow))
    torch.sum(p, 0, out=total).mul_(1 - gamma).add_(m * gamma / k)
    c = gamma / (k * (1 - gamma))
    run = max(1, int(_PRODUCT_LOG_FLOOR // -math.log(c))) if c < 1 else m
    for start in range(0, m, run):
        factors = p[start : start + run].add_(c)
        if start == 0:
            torch.prod(factors, 0, out=log_sum).log_()
        else:
            log_sum.add_(torch.prod(factors, 0).log_())
    log_sum.div_(m).add_(math.log1p(-gamma))
    return out


def predict_chunk_rows(members: int, width: int, device: torch.device) -> int:
    """Inputs per sampled chunk of ``members`` samples of ``width`` numbers each
    (:func:`bayescli.devices.chunk_rows`): ``PREDICT_CHUNK_ELEMENTS / (M·width)`` on a CPU; on
    CUDA the device's budget over ``M·width`` elements of ``PREDICT_SAMPLE_BYTES`` plus the
    per-input float64 work (``PREDICT_ROW_BYTES`` per class, spread over the ``M`` samples)."""
    per_element = PREDICT_SAMPLE_BYTES + -(-PREDICT_ROW_BYTES // max(1, members))
    return devices.chunk_rows(device, members * width, PREDICT_CHUNK_ELEMENTS, per_element)


def ensemble_chunk_rows(members: int, k: int, device: torch.device) -> int:
    """Inputs per chunk of a head ensemble's member GEMMs (:func:`ensemble_member_logits`): on the
    CPU ``MEMBER_CHUNK_ELEMENTS / K`` (~1,000 rows at K = 1000 keep each GEMM as fast per FLOP as
    the plain head), within ``MEMBER_BUFFER_ELEMENTS`` for all members; on a GPU
    :func:`predict_chunk_rows`."""
    if device.type == "cpu":
        return max(1, min(MEMBER_CHUNK_ELEMENTS // k, MEMBER_BUFFER_ELEMENTS // (members * k)))
    return predict_chunk_rows(members, k, device)


def normalised_means(
    means: torch.Tensor, log_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ᾱ`` (normalised in place), ``ln ᾱ`` (into ``log_out`` if given) and ``ᾰ`` (``[N, K]``,
    float64) from :func:`sample_means`' ``[2, N, K]``."""
    a_bar = means[0].div_(means[0].sum(-1, keepdim=True))
    return a_bar, torch.log(a_bar, out=log_out), means[1]


@dataclass
class DirichletFVIPosterior(Posterior):
    """A fitted Dirichlet fVI posterior and its Dirichlet predictive.

    ``params`` holds the family's tensors: last layer — ``weight [M, K, D]``, ``bias [M, K]``
    (+ ``weight_std``, ``bias_std`` for mfvi); whole network — ensemble ``member.{m}.{name}``
    states, mfvi ``std.{name}`` (the means are the checkpoint's weights), nothing for map and
    dropout. ``n_data`` is ``N`` (the cap on ``z``), ``members`` the test-time ``M``.
    """

    family: str
    subset: Subset
    params: dict[str, torch.Tensor]
    beta: torch.Tensor
    members: int
    n_data: int
    tau: float
    dropout: float
    seed: int
    smoothing: float = GAMMA
    meta: dict = field(default_factory=dict)

    method: ClassVar[str] = "dirichlet-fvi"
    native_dirichlet: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return f"dirichlet-fvi {self.subset.value} {self.family}"

    @property
    def num_classes(self) -> int:
        return int(self.beta.shape[0])

    def summary(self) -> dict:
        return {
            "family": self.family,
            "members": self.members,
            "tau": self.tau,
            "tau_method": "fixed" if self.selection is None else self.selection.how,
            "n_data": self.n_data,
        }

    # -- predictives --------------------------------------------------------------------------

    def _generator(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)

    def _dirichlet(
        self,
        sampler: tuple[Callable[[slice], torch.Tensor], int],
        n: int,
        device: torch.device,
        gaussian: bool,
    ) -> tuple[torch.Tensor, LogitGaussian | None]:
        """``α [N, K]`` (float64) from logit samples of row chunks (``sampler = (fn, rows)``,
        ``fn(slice) -> [M, rows, K]``) and, if ``gaussian``, its Laplace-bridge image.

        On the CPU the elementwise work runs on sub-chunks that stay in cache: the sample means
        (:func:`sample_means`, over ``[M, rows, K]``) on ``CACHE_CHUNK_ELEMENTS``, Minka
        (:func:`~bayescli.dirichlet.fit_precision_vectorised`) and the bridge (over ``[rows, K]``, in
        float64) on ``MINKA_CHUNK_ELEMENTS``; results go straight into the preallocated outputs.
        A GPU wants few large kernels (and Minka reads its straggler count back once per call)."""
        k = self.num_classes
        sample, rows = sampler
        alpha = torch.empty(n, k, dtype=torch.float64, device=device)
        full = k <= FULL_COV_MAX_CLASSES
        if gaussian:
            mean, var = torch.empty_like(alpha), torch.empty_like(alpha)
            cov = torch.empty(n, k, k, dtype=torch.float64, device=device) if full else None
        on_cpu = device.type == "cpu"
        sub = max(1, CACHE_CHUNK_ELEMENTS // (self.members * k)) if on_cpu else rows
        block = max(1, MINKA_CHUNK_ELEMENTS // k) if on_cpu else rows
        # scratch reused by every (sub-)chunk: fresh temporaries would cost page faults each time
        means = torch.empty(2, min(rows, n), k, dtype=torch.float64, device=device)
        log_a_bar_work = torch.empty(min(block, n), k, dtype=torch.float64, device=device)
        work, workspace = None, {}
        for start in range(0, n, rows):
            with torch.no_grad():
                logits = sample(slice(start, start + rows))
            count = logits.shape[1]
            if work is None:
                shape = (logits.shape[0], min(sub, count), k)
                work = (logits.new_empty(shape), logits.new_empty(shape, dtype=torch.float64))
            for lo in range(0, count, sub):
                hi = min(lo + sub, count)
                scratch = tuple(t[:, : hi - lo] for t in work)
                sample_means(logits[:, lo:hi], self.smoothing, means[:, lo:hi], scratch)
            del logits  # the next chunk's samples reuse its memory
            for lo in range(0, count, block):
                hi = min(lo + block, count)
                sl = slice(start + lo, start + hi)
                a_bar, log_a_bar, a_log = normalised_means(means[:, lo:hi], log_a_bar_work[: hi - lo])
                z, _ = fit_precision_vectorised(
                    a_bar, log_a_bar, a_log, self.members, k, self.n_data, workspace=workspace
                )
                a = torch.mul(a_bar, z[:, None], out=alpha[sl])
                if gaussian and full:
                    mean[sl], cov[sl] = dirichlet_to_gaussian(a)
                    var[sl] = cov[sl].diagonal(dim1=1, dim2=2)
                elif gaussian:
                    # dirichlet_to_gaussian_diag(a) without its [rows, K] log (ln α = ln z + ln ᾱ,
                    # and ln z cancels in the centring) nor temporaries
                    torch.sub(log_a_bar, log_a_bar.mean(-1, keepdim=True), out=mean[sl])
                    inv = torch.reciprocal(a, out=var[sl])
                    torch.add(inv.sum(-1, keepdim=True).div_(k**2), inv, alpha=1 - 2 / k, out=inv)
        if not gaussian:
            return alpha, None
        return alpha, LogitGaussian(mean, var, cov, alpha=alpha, exact=False)

    def _feature_sampler(self, phi: torch.Tensor) -> tuple[Callable[[slice], torch.Tensor], int]:
        if self.subset is not Subset.LAST_LAYER:
            raise BayescliError(f"this {self.label} posterior predicts from inputs, not features")
        gen = self._generator(phi.device)
        params = {k: v.to(phi.device) for k, v in self.params.items()}
        phi = phi.to(params["weight"].dtype)
        k = self.num_classes
        if self.family in ("ensemble", "map"):
            # one head-sized GEMM per member: its weights stay in cache, unlike the stacked [M·K, D]
            m = params["weight"].shape[0]
            rows = min(ensemble_chunk_rows(m, k, phi.device), phi.shape[0])
            buffer = phi.new_empty(m, rows, k)

            def members(sl: slice) -> torch.Tensor:
                return ensemble_member_logits(params, phi[sl], buffer)

            return members, rows

        def sampled(sl: slice) -> torch.Tensor:
            return head_logits(self.family, params, phi[sl], self.members, gen, self.dropout)

        # dropout masks are [M, rows, D], everything else [M, rows, K]
        width = max(k, phi.shape[1] if self.family == "dropout" else 0)
        return sampled, predict_chunk_rows(self.members, width, phi.device)

    def _input_sampler(
        self, classifier: Classifier, x: torch.Tensor
    ) -> tuple[Callable[[slice], torch.Tensor], int]:
        if self.subset is Subset.LAST_LAYER:
            raise BayescliError(f"this {self.label} posterior predicts from features, not inputs")
        device = next(classifier.parameters()).device
        gen = self._generator(device)
        members, stds = self._network_state(device)

        def sampler(sl: slice) -> torch.Tensor:
            xb = x[sl].to(device)
            return network_logits(self.family, classifier, xb, self.members, gen, self.dropout, members, stds)

        # the images' activations, not the budget, bound a network pass
        rows = min(
            predict_chunk_rows(self.members, self.num_classes, device), INPUT_CHUNK_IMAGES // self.members
        )
        return sampler, max(1, rows)

    def alpha_features(self, phi: torch.Tensor) -> torch.Tensor:
        """Dirichlet ``α [N, K]`` per input from last-layer features ``phi [N, D]``."""
        return self._dirichlet(self._feature_sampler(phi), phi.shape[0], phi.device, False)[0]

    def alpha_inputs(self, classifier: Classifier, x: torch.Tensor) -> torch.Tensor:
        """Dirichlet ``α [N, K]`` per pixel-space input ``x [N, ...]`` (whole-network posteriors)."""
        device = next(classifier.parameters()).device
        return self._dirichlet(self._input_sampler(classifier, x), x.shape[0], device, False)[0]

    def logit_gaussian(self, phi: torch.Tensor) -> LogitGaussian:
        """Laplace-bridge image of the Dirichlet predictive for features ``phi [N, D]`` (float64)."""
        return self._dirichlet(self._feature_sampler(phi), phi.shape[0], phi.device, True)[1]

    def logit_gaussian_inputs(self, classifier: Classifier, x: torch.Tensor) -> LogitGaussian:
        """Laplace-bridge image of the Dirichlet predictive for inputs ``x [N, ...]`` (float64)."""
        device = next(classifier.parameters()).device
        return self._dirichlet(self._input_sampler(classifier, x), x.shape[0], device, True)[1]

    def sample_logits(
        self,
        num: int,
        classifier: Classifier,
        x: torch.Tensor | None,
        phi: torch.Tensor | None,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Logits ``[num, N, K]`` of ``num`` draws from q: ensembles cycle through their members
        (draw ``i`` is member ``i mod M``, the exact mixture when ``M`` divides ``num``), map
        repeats its one function, mfvi and dropout draw fresh weights or masks."""
        with torch.no_grad():
            if self.subset is Subset.LAST_LAYER:
                params = {k: v.to(phi.device) for k, v in self.params.items()}
                out = head_logits(
                    self.family, params, phi.to(params["weight"].dtype), num, generator, self.dropout
                )
            else:
                x = x.to(next(classifier.parameters()).device)  # inputs arrive from the host
                members, stds = self._network_state(x.device)
                out = network_logits(self.family, classifier, x, num, generator, self.dropout, members, stds)
        if self.family in ("ensemble", "map"):
            out = out[torch.arange(num) % out.shape[0]]
        return out

    def _network_state(
        self, device: torch.device
    ) -> tuple[list[dict[str, torch.Tensor]] | None, dict[str, torch.Tensor] | None]:
        """Member states (ensemble) and weight stds (mfvi) of a whole-network posterior."""
        members = None
        if self.family == "ensemble":
            members = [
                {
                    k.split(".", 2)[2]: v.to(device)
                    for k, v in self.params.items()
                    if k.startswith(f"member.{m}.")
                }
                for m in range(self.members)
            ]
        stds = None
        if self.family == "mfvi":
            stds = {k[len("std.") :]: v.to(device) for k, v in self.params.items() if k.startswith("std.")}
        return members, stds

    # -- files --------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.params, "beta": self.beta}

    def own_metadata(self) -> dict:
        return {
            "family": self.family,
            "members": self.members,
            "n_data": self.n_data,
            "tau": self.tau,
            "dropout": self.dropout,
            "seed": self.seed,
            "smoothing": self.smoothing,
            "predictive": "dirichlet: Minka fit (z in [K, n_data]) to the M test-time samples; logit "
            "Gaussian = its Laplace-bridge image (seed 004 eqs. 5-6), rank K-1",
            "logit_gaussian_exact": False,
            "exact_links": ["bridge", "none"],
            "logit_gaussian_cov": "full" if self.num_classes <= FULL_COV_MAX_CLASSES else "diag",
        }

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> DirichletFVIPosterior:
        params = {k: v for k, v in tensors.items() if k != "beta"}
        return cls(
            meta["family"],
            Subset(meta["subset"]),
            params,
            tensors["beta"],
            int(meta["members"]),
            int(meta["n_data"]),
            float(meta["tau"]),
            float(meta["dropout"]),
            int(meta["seed"]),
            float(meta["smoothing"]),
            cls.provenance(meta, _OWN_KEYS),
        )


_OWN_KEYS = {
    "family",
    "members",
    "n_data",
    "tau",
    "dropout",
    "seed",
    "smoothing",
    "predictive",
    "logit_gaussian_exact",
    "exact_links",
    "logit_gaussian_cov",
}
