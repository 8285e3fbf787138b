"""The GGP predictive: Laplace inference in function space (seed 003 §2.5, App. A.3–A.4, B.1).

Linearising the network at ``θ*`` with prior ``θ ~ N(0, δ⁻¹ I)`` gives a Gaussian process with
mean ``m(x) = f(x; θ*) − J(x) θ*`` and kernel ``k(x, x') = δ⁻¹ J(x) J(x')ᵀ``. Classes are taken
independent a priori (Rasmussen & Williams §3.5): class ``c`` has kernel ``K_c = δ⁻¹ J_c J_cᵀ``
from the Jacobian rows of its logit. For a last-layer posterior ``J = I_K ⊗ φ̃ᵀ``, so ``m = 0``
and every class shares ``K = δ⁻¹ Φ̃ Φ̃ᵀ`` — exact, not an approximation.

On ``M`` training points the posterior over ``f [M, C]`` is approximated by Laplace:

* ``mode="map"``: expand at the network's own logits ``f*`` (``a* = K⁺(f* − m)``, least squares);
* ``mode="refined"``: Newton's method (R&W Algorithm 3.3, with a Brent line search on the step
  as in gpml) on ``Ψ(a) = log p(y | f) − ½ aᵀ(f − m)``, ``f = m + K a``, to the GGP mode.

Predictions at test points (R&W Algorithm 3.4): mean ``m* + K*ᵀ a`` and the full ``C × C``
covariance ``diag_c(k_c** − b_cᵀ k_c*) + Bᵀ (Σ_c E_c)⁻¹ B`` with ``b_c = E_c k_c*`` and
``E_c = D_c^{½}(I + D_c^{½} K_c D_c^{½})⁻¹ D_c^{½}``, ``D_c = diag(π_c)``. All solves in float64.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from scipy.optimize import minimize_scalar

from bayescli.data import Data
from bayescli.errors import BayescliError, BayescliWarning
from bayescli.models.features import Features, extract_features
from bayescli.models.specs import Classifier, LoadedModel
from bayescli.options import Subset
from bayescli.posterior.base import Posterior
from bayescli.posterior.curvature import network_jacobian
from bayescli.posterior.gaussian import LogitGaussian, augment, cholesky_jitter
from bayescli.posterior.laplace import LaplacePosterior

_JITTER = 1e-10
# Objective gains below this fraction of |Ψ| are round-off: Ψ sums M·C terms in float64.
_ROUNDOFF = 1e-12


@dataclass
class GGPLaplace:
    """A fitted GGP Laplace approximation on ``M`` points and ``C`` classes.

    The kernel is either ``kernel [C or 1, M, M]`` (a leading 1 means shared across classes) or,
    for a kernel shared by all classes with rank ``R < M``, its factor ``factor [M, R]`` with
    ``K = F Fᵀ``: then every ``M × M`` inverse goes through Woodbury in ``O(M² R)`` instead of
    ``O(M³)`` per class (last-layer kernels have ``R = D + 1``). ``prior_mean [M, C]``, ``y``
    one-hot ``[M, C]``; after :meth:`fit`: ``a [C, M]``, ``f [M, C]`` and the objective trace.
    """

    kernel: torch.Tensor | None
    prior_mean: torch.Tensor
    y: torch.Tensor
    factor: torch.Tensor | None = None
    a: torch.Tensor | None = None
    f: torch.Tensor | None = None
    history: list[float] = field(default_factory=list)
    grad_norm: float = float("nan")
    _predictive_factors: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_classes(self) -> int:
        return int(self.y.shape[1])

    def _k_times(self, a: torch.Tensor) -> torch.Tensor:
        """``K_c a_c`` for every class: ``[C, M]`` → ``[C, M]``."""
        if self.factor is not None:
            return (a @ self.factor) @ self.factor.T
        return torch.einsum("cij,cj->ci", self.kernel.expand(self.num_classes, -1, -1), a)

    def objective(self, a: torch.Tensor) -> float:
        """``Ψ(a) = Σ_n [y_nᵀ f_n − logsumexp f_n] − ½ Σ_c a_cᵀ (K_c a_c)``."""
        g = self._k_times(a)
        f = self.prior_mean + g.T
        loglik = (self.y * f).sum() - torch.logsumexp(f, 1).sum()
        return float(loglik - 0.5 * (a * g).sum())

    def _factors(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``π [C, M]``, ``E [C, M, M]`` and the Cholesky factor of ``Σ_c E_c``."""
        pi = f.softmax(1).T  # [C, M]
        s = pi.sqrt()
        m = pi.shape[1]
        eye = torch.eye(m, dtype=pi.dtype, device=pi.device)
        if self.factor is not None:
            # Woodbury: E_c = D − D F (I_R + Fᵀ D F)⁻¹ Fᵀ D with D = diag(π_c)
            fr = self.factor
            df = pi[:, :, None] * fr  # [C, M, R]
            inner = torch.eye(fr.shape[1], dtype=pi.dtype, device=pi.device) + fr.T @ df  # [C, R, R]
            sol = torch.linalg.solve(inner, df.transpose(1, 2))  # [C, R, M]
            e = torch.diag_embed(pi) - df @ sol
        else:
            kmat = self.kernel.expand(self.num_classes, -1, -1)
            chol = cholesky_jitter(eye + s[:, :, None] * kmat * s[:, None, :])
            e = s[:, :, None] * torch.cholesky_solve(torch.diag_embed(s), chol)  # D^½ B_c⁻¹ D^½
        m_chol = cholesky_jitter(e.sum(0) + _JITTER * eye)
        return pi, e, m_chol

    def _newton_a(self, a: torch.Tensor) -> torch.Tensor:
        """One Newton step (R&W Algorithm 3.3) from ``a``; returns the new ``a``."""
        g = self._k_times(a)
        f = self.prior_mean + g.T
        pi, e, m_chol = self._factors(f)
        gt = g  # [C, M], f − m
        w_g = pi * gt - pi * (pi * gt).sum(0, keepdim=True)  # (D − ΠΠᵀ)(f − m)
        b = w_g + self.y.T - pi
        c = torch.einsum("cij,cj->ci", e, self._k_times(b))
        rhs = torch.cholesky_solve(c.sum(0, keepdim=True).T, m_chol).T  # [1, M]
        return b - c + torch.einsum("cij,j->ci", e, rhs[0])

    def gradient_norm(self, a: torch.Tensor) -> float:
        """``‖y − π(f) − a‖_∞``: the mode condition in representer form (R&W eq. 3.15, ``a = y − π``).

        ``∇_a Ψ = K (y − π − a)``; the residual itself is scale-free, whereas ``K`` (eigenvalues up to
        ~10⁵ for raw features) would inflate round-off in the product.
        """
        f = self.prior_mean + self._k_times(a).T
        return float((self.y.T - f.softmax(1).T - a).abs().max())

    def fit(self, f_star: torch.Tensor, refine: bool, max_iter: int = 100, gtol: float = 1e-9) -> GGPLaplace:
        """Start at the network's logits ``f_star [M, C]``; with ``refine`` run Newton to the mode.

        Each iteration takes the Newton direction with a Brent line search on its length. Near the
        mode the objective's gains fall to round-off (``≲ 1e-12·|Ψ|``) long before the mode condition
        holds, so there the line search cannot tell steps apart: a full Newton step is taken when it
        lowers :meth:`gradient_norm` (Newton converges quadratically there), and the loop stops only
        when the gradient is below ``gtol``, after ``max_iter`` steps, or when neither rule makes
        progress (the reached gradient norm is kept in :attr:`grad_norm` either way).
        """
        self.a = _least_squares_a(self, (f_star - self.prior_mean).T)
        self.history = [self.objective(self.a)]
        if refine:
            gnorm = self.gradient_norm(self.a)
            for _ in range(max_iter):
                if gnorm < gtol:
                    break
                direction = self._newton_a(self.a) - self.a
                start = self.a

                def negative(
                    t: float, start: torch.Tensor = start, direction: torch.Tensor = direction
                ) -> float:
                    return -self.objective(start + t * direction)

                res = minimize_scalar(negative, bounds=(0.0, 2.0), method="bounded", options={"xatol": 1e-6})
                value = -float(res.fun)
                flat = _ROUNDOFF * max(1.0, abs(self.history[-1]))
                if value > self.history[-1] + flat:
                    self.a = start + float(res.x) * direction
                    gnorm = self.gradient_norm(self.a)
                else:
                    candidate = start + direction
                    cand_norm = self.gradient_norm(candidate)
                    value = self.objective(candidate)
                    if not (cand_norm < gnorm and value >= self.history[-1] - flat):
                        break
                    self.a, gnorm = candidate, cand_norm
                self.history.append(value)
        self.f = self.prior_mean + self._k_times(self.a).T
        # W, E and chol(Σ E) at the expansion point serve every later prediction.
        self._predictive_factors = self._factors(self.f)[1:]
        self.grad_norm = self.gradient_norm(self.a)
        return self

    def predict(
        self, k_cross: torch.Tensor, k_diag: torch.Tensor, prior_mean_test: torch.Tensor, chunk: int = 2048
    ) -> LogitGaussian:
        """Predictive logit Gaussian at test points.

        ``k_cross [C or 1, M, N*]`` = ``k_c(X, x*)``, ``k_diag [C or 1, N*]`` = ``k_c(x*, x*)``,
        ``prior_mean_test [N*, C]``. Returns mean ``[N*, C]`` and full covariance ``[N*, C, C]``.
        """
        if self.a is None:
            raise BayescliError("fit the GGP before predicting")
        c = self.num_classes
        kx = k_cross.expand(c, -1, -1)
        mean = prior_mean_test + torch.einsum("cmn,cm->nc", kx, self.a)
        e, m_chol = self._predictive_factors
        covs = []
        for start in range(0, kx.shape[-1], chunk):
            kc = kx[..., start : start + chunk]
            b = torch.einsum("cij,cjn->cin", e, kc)  # [C, M, n]
            v = torch.linalg.solve_triangular(m_chol, b, upper=False)
            cov = torch.einsum("cin,din->ncd", v, v)
            diag = k_diag.expand(c, -1)[:, start : start + chunk] - (b * kc).sum(1)
            covs.append(cov + torch.diag_embed(diag.T))
        cov = torch.cat(covs)
        return LogitGaussian(mean, cov.diagonal(dim1=1, dim2=2).clone(), cov)


def _least_squares_a(model: GGPLaplace, g: torch.Tensor) -> torch.Tensor:
    """Minimum-norm ``a_c`` with ``K_c a_c = g_c`` (``K`` may be singular: rank ≤ D+1 < M)."""
    c = model.num_classes
    if model.factor is not None:
        u, sv, _ = torch.linalg.svd(model.factor, full_matrices=False)
        keep = sv > sv.max() * max(model.factor.shape) * torch.finfo(sv.dtype).eps
        u, inv = u[:, keep], 1.0 / sv[keep].pow(2)
        return ((g @ u) * inv) @ u.T
    evals, evecs = torch.linalg.eigh(model.kernel)
    cutoff = evals.amax(-1, keepdim=True) * model.kernel.shape[-1] * torch.finfo(evals.dtype).eps
    inv = torch.where(evals > cutoff, 1.0 / evals, torch.zeros_like(evals))
    evecs, inv = evecs.expand(c, -1, -1), inv.expand(c, -1)
    return torch.einsum("cij,cj,ckj,ck->ci", evecs, inv, evecs, g)


MAX_JACOBIAN_BYTES = 4 * 2**30


class GGPPredictor:
    """A GGP Laplace fitted once on ``M`` points of the fitting data, predicting anywhere.

    Last-layer posteriors need only features; all-layer posteriors also the classifier and the
    pixel-space inputs (their kernel comes from per-input Jacobians, ``M·C·P`` floats). Memory:
    the GP works on all ``M`` points at once, so their features (or inputs and Jacobians) are held;
    test inputs are processed batch by batch.
    """

    def __init__(
        self,
        posterior: LaplacePosterior,
        fit_feats: Features,
        refine: bool,
        classifier: Classifier | None = None,
        fit_data: Data | None = None,
    ) -> None:
        if fit_feats.labels is None:
            raise BayescliError("the GGP predictive needs labelled fitting points")
        self.post, self.classifier = posterior, classifier
        self.last_layer = posterior.subset is Subset.LAST_LAYER
        self.delta = posterior.prior_precision
        y = torch.nn.functional.one_hot(fit_feats.labels, fit_feats.logits.shape[1]).double()
        factor = None
        if self.last_layer:
            self.train = self._phi(fit_feats.phi)
            prior_mean = torch.zeros_like(y)
            f_star = self.train @ posterior.gaussian.mean.double().T
            if self.train.shape[1] < self.train.shape[0]:  # low rank: K = F Fᵀ, F = Φ̃/√δ
                kernel, factor = None, self.train / self.delta**0.5
            else:
                kernel = (self.train @ self.train.T / self.delta)[None]
        else:
            # the M fitting points only: their Jacobians [M, C, P] are what this kernel needs
            x = torch.cat([xb for xb, _ in fit_data.batches(256)]).to(fit_feats.phi.device)
            self.train_jac, f_star, prior_mean = self._jacobian(x)
            kernel = torch.einsum("mcp,ncp->cmn", self.train_jac, self.train_jac) / self.delta
        self.model = GGPLaplace(kernel, prior_mean, y, factor).fit(f_star, refine)
        self.info = {
            "points": len(y),
            "mode": "refined" if refine else "map",
            "newton_iterations": len(self.model.history) - 1,
            "objective_at_f_star": self.model.history[0],
            "objective": self.model.history[-1],
            "gradient_norm": self.model.grad_norm,
            "kernel": "last-layer δ⁻¹ φ̃ᵀφ̃' I_K" if self.last_layer else "per-class Jacobian δ⁻¹ J_c J_cᵀ",
        }

    def _phi(self, phi: torch.Tensor) -> torch.Tensor:
        phi = phi.double()
        return augment(phi) if self.post.head_bias else phi

    def _jacobian(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``J [N, C, P]``, ``f(x; θ*) [N, C]`` and the GP prior mean ``f − J θ*``."""
        n_params = self.post.gaussian.num_params
        if len(x) * self.post.meta.get("num_classes", 10) * n_params * 8 > MAX_JACOBIAN_BYTES:
            raise BayescliError(
                f"the all-layer GGP kernel needs {len(x)}×C×{n_params:,} Jacobian entries; "
                "use fewer GGP fitting points (`ggp_points`) or a last-layer posterior"
            )
        x = x.to(self.post.gaussian.mean.device)
        f, jac = network_jacobian(self.classifier.net, self.classifier.normalise(x))
        theta = self.post.gaussian.mean.reshape(-1).double()
        jac, f = jac.double(), f.double()
        return jac, f, f - jac @ theta

    def logit_gaussian(
        self, feats: Features, data: Data | None = None, batch_size: int = 256
    ) -> LogitGaussian:
        """Predictive logit Gaussian (full ``C × C`` covariance) at new inputs."""
        if self.last_layer:
            test = self._phi(feats.phi)
            k_cross = (self.train @ test.T / self.delta)[None]
            k_diag = (test.pow(2).sum(1) / self.delta)[None]
            lg = self.model.predict(k_cross, k_diag, test.new_zeros(len(test), self.model.num_classes))
            return LogitGaussian(lg.mean.float(), lg.var.float(), lg.cov.float())
        parts = []
        for x, _ in data.batches(batch_size):
            jac, _, prior_mean = self._jacobian(x)
            k_cross = torch.einsum("mcp,ncp->cmn", self.train_jac, jac) / self.delta
            k_diag = jac.pow(2).sum(-1).T / self.delta
            lg = self.model.predict(k_cross, k_diag, prior_mean)
            parts.append(LogitGaussian(lg.mean.float(), lg.var.float(), lg.cov.float()))
        return LogitGaussian.cat(parts)


def ggp_fit_spec(posterior: Posterior) -> str:
    """The data spec of ``posterior``'s recorded fitting data, whose seeded subset the caller loads
    (with the model's recipe) and passes to :func:`fit_ggp`; raises when the posterior cannot
    define a GGP."""
    _check_laplace(posterior)
    spec = (posterior.meta.get("data") or {}).get("spec")
    if not spec:
        raise BayescliError(
            "the posterior does not record its fitting data; refit it (Laplace) or give the GGP's "
            "fitting points (`ggp_data`)"
        )
    return str(spec)


def fit_ggp(
    posterior: Posterior,
    model: LoadedModel,
    fit_data: Data,
    refine: bool,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> GGPPredictor:
    """Fit the GGP on ``fit_data`` (labelled points of the posterior's fitting distribution,
    prepared with ``model``'s recipe; usually a seeded subset of its recorded fitting data).

    The points' provenance is recorded in ``info["data"]``.
    """
    _check_laplace(posterior)
    prior = posterior.prior_record
    if refine and str(prior.get("method", "")).startswith("val-"):
        # the refined mode is the GP posterior's at δ; a δ chosen for the GLM predictive (up to
        # the MAP limit, δ → ∞) pulls that mode to the prior mean, far from the trained network
        warnings.warn(
            BayescliWarning(
                f"the refined GGP predictive uses δ = {posterior.prior_precision:.3g}, chosen on validation "
                f"data for the {prior.get('objective', 'GLM predictive')}; refinement moves the mode toward "
                "the prior mean as δ grows. Use the map GGP mode, or a posterior with the marglik δ "
                f"({prior.get('marglik', float('nan')):.3g})"
            ),
            stacklevel=2,
        )
    feats = extract_features(model, fit_data, batch_size, device)
    ggp = GGPPredictor(posterior, feats, refine, model.classifier, fit_data)
    ggp.info |= {"data": fit_data.info}
    return ggp


def _check_laplace(posterior: Posterior) -> None:
    if not isinstance(posterior, LaplacePosterior):
        raise BayescliError(
            f"the GGP predictive needs a Laplace posterior (its prior precision defines the GP prior), "
            f"not {posterior.method}; use the glm predictive or a Laplace posterior"
        )
