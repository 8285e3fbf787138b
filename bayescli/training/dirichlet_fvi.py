"""Dirichlet fVI from scratch: a builtin network trained with the fVI objective (VI-SPEC A1/A3).

The objective and its Adam loop are the post-hoc fit's
(:mod:`bayescli.posterior.vi.dirichlet_fvi_objective`); here the families' samples are whole
networks (:func:`~bayescli.posterior.vi.dirichlet_fvi_samples.network_logits`): ``ensemble`` trains
``M`` networks jointly, ``mfvi`` a mean-field Gaussian over every weight (one draw per sample,
shared by the batch), ``dropout`` masks the inputs of every linear layer but the first
parametrised one, ``map`` one network (label smoothing, VI-SPEC A1).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from bayescli.data import ArrayData
from bayescli.data.shifts import rotate
from bayescli.devices import generator
from bayescli.errors import require
from bayescli.models.specs import Classifier, ModelSpec, build_network, last_linear_name
from bayescli.options import Subset
from bayescli.posterior.selection import Scored, select_on_grid, unvalidated
from bayescli.posterior.vi.budget import MAX_EPOCHS
from bayescli.posterior.vi.dirichlet_fvi import TAU_GRID, dirichlet_predictive, index_source
from bayescli.posterior.vi.dirichlet_fvi_objective import optimise, parse_beta
from bayescli.posterior.vi.dirichlet_fvi_posterior import DirichletFVIPosterior
from bayescli.posterior.vi.dirichlet_fvi_samples import network_logits
from bayescli.posterior.vi.dirichlet_fvi_settings import DirichletFVIConfig, default_tau
from bayescli.training.classifier import channel_stats, checkpoint_metadata

DEFAULT_RULE = "default_tau: 1 for K <= 10, 0.1 for K <= 100, 10/K beyond (the seed's values at N = 60000)"


def parse_model_kwargs(text: str) -> dict:
    """``hidden=50,depth=2`` → ``{"hidden": 50, "depth": 2}`` (ints, floats or strings)."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        require(bool(sep and key), f"model_kwargs must look like hidden=50,depth=2; got '{text}'")
        for cast in (int, float, str):
            try:
                out[key.strip()] = cast(value)
                break
            except ValueError:
                continue
    return out


def train(
    model_spec: str,
    train: ArrayData,
    val: ArrayData | None,
    settings: DirichletFVIConfig,
    device: torch.device,
) -> tuple[Classifier, dict, DirichletFVIPosterior]:
    """Train ``builtin:NAME`` from scratch with the fVI objective (VI-SPEC A1/A3).

    ``tau`` unset is :func:`~bayescli.posterior.vi.dirichlet_fvi.default_tau` (the seed's rule);
    ``select=True`` trains one network per ``TAU_GRID`` multiple of it and keeps the best
    validation ``select_by`` score on ``val`` (each point costs a whole training run, so
    selection is never implicit here). Returns the classifier (map/dropout: the trained network;
    mfvi: the means; ensemble: member 0), checkpoint metadata as
    :func:`bayescli.training.classifier.train_classifier` writes it, and the whole-network
    posterior (``subset = all``) with its ``selection``.
    """
    start_time = time.perf_counter()
    cfg = settings
    spec = ModelSpec.parse(model_spec)
    require(spec.kind == "builtin", f"Dirichlet fVI trains builtin models from scratch only, got {spec}")
    require(train.y is not None, f"{train.spec} has no labels; training needs labelled data")
    require(
        not cfg.select or (val is not None and val.y is not None),
        "select=True chooses tau on validation data; give labelled validation data (`val`) or unset select",
    )
    device = torch.device(device)
    k = train.num_classes
    beta = parse_beta(cfg.beta, k).to(device)
    kwargs = parse_model_kwargs(cfg.model_kwargs)
    if cfg.normalisation == "pm1":
        channels = train.input_shape[0] if len(train.input_shape) == 3 else 1
        norm_mean, norm_std = [0.5] * channels, [0.5] * channels
    else:
        norm_mean, norm_std = channel_stats(train)
    pool = index_source(cfg.index_data, train, cfg.seed)
    # an index set's inputs go to the device once: batches index them there with the device's
    # draws, so nothing is read back per step
    pool_x = pool.inputs(slice(None)).to(device) if pool is not None and not isinstance(pool, list) else None
    labels = train.y

    def train_at(tau: float) -> tuple[Classifier, DirichletFVIPosterior]:
        torch.manual_seed(cfg.seed)
        nets = [
            build_network(spec, k, train.input_shape, kwargs)
            for _ in range(cfg.members if cfg.family == "ensemble" else 1)
        ]
        clfs = [Classifier(net, last_linear_name(net), norm_mean, norm_std).to(device) for net in nets]
        for c in clfs:
            c.train()
        rho: dict[str, torch.Tensor] = {}
        if cfg.family == "mfvi":
            for name, p in clfs[0].net.named_parameters():
                sigma = max(cfg.init_scale * float(p.detach().square().mean().sqrt()), 1e-6)
                rho[name] = torch.full_like(p, sigma + math.log(-math.expm1(-sigma))).requires_grad_()
        noise = generator(device, cfg.seed + 1)
        samples = cfg.step_samples

        def sample(x: torch.Tensor) -> torch.Tensor:
            if cfg.family == "ensemble":
                return torch.stack([c(x) for c in clfs])
            stds = {n: F.softplus(r) for n, r in rho.items()}
            return network_logits(cfg.family, clfs[0], x, samples, noise, cfg.dropout, None, stds)

        def forward(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            x = train.inputs(idx).to(device)
            logits = sample(x)
            if pool is None:
                return logits, None
            if isinstance(pool, list):
                pts = torch.cat([rotate(x, a) for a in pool])
            else:
                pts = pool_x[torch.randint(len(pool_x), (len(idx),), generator=noise, device=device)]
            return logits, sample(pts)

        parameters = [p for c in clfs for p in c.net.parameters()] + list(rho.values())
        history = optimise(
            parameters, forward, labels, cfg, tau, beta, f"fVI {spec} τ={tau:g}", cfg.epochs or MAX_EPOCHS
        )
        for c in clfs:
            c.eval()
        if cfg.family == "ensemble":
            params = {
                f"member.{m}.{name}": v.detach()
                for m, c in enumerate(clfs)
                for name, v in c.net.state_dict().items()
            }
        elif cfg.family == "mfvi":
            params = {f"std.{n}": F.softplus(r).detach() for n, r in rho.items()}
        else:
            params = {}
        post = DirichletFVIPosterior(
            cfg.family,
            Subset.ALL,
            params,
            beta,
            cfg.num_samples,
            len(train),
            tau,
            cfg.dropout,
            cfg.seed,
            cfg.smoothing,
        )
        post.meta["history"] = history
        return clfs[0], post

    base = default_tau(k)
    if cfg.tau is not None:
        clf, post = train_at(cfg.tau)
        post.selection = unvalidated("tau", cfg.tau, "given explicitly", fixed=True)
    elif not cfg.select:
        clf, post = train_at(base)
        post.selection = unvalidated("tau", base, DEFAULT_RULE)
    else:
        x_val = val.inputs(slice(None))

        def candidate(tau: float) -> tuple[tuple[Classifier, DirichletFVIPosterior], Scored]:
            clf, post = train_at(tau)
            return (clf, post), dirichlet_predictive(post.alpha_inputs(clf, x_val))

        grid = [base * f for f in TAU_GRID]
        (clf, post), sel = select_on_grid(
            "tau", grid, candidate, val.y, cfg.select_by, principled=base, extensions=0
        )
        post.selection = sel
    settings_record = cfg.record()
    post.meta |= {
        "config": settings_record,
        "index_data": settings_record["index_data"],
        "fit_seconds": time.perf_counter() - start_time,
    }
    history = post.meta["history"]
    training = {"method": "dirichlet-fvi", **settings_record, "tau": post.tau}
    loss = [h["loss"] for h in history]
    meta = checkpoint_metadata(spec, clf, train, val, device, (norm_mean, norm_std), training, loss, kwargs)
    if cfg.family == "ensemble":
        meta["ensemble_member"] = 0  # the checkpoint holds member 0; the posterior holds all
    return clf, meta, post
