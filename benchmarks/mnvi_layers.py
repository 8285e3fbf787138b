"""MNVI moment propagation vs Monte Carlo, layer by layer, on the C-1 nets (issue 25, part 1).

C-1 (VI-SPEC C5): conv(1→4,3×3) → ReLU → maxpool2 → BN(eval, random stats) → flatten →
linear(36→16) → ReLU → linear(16→5) on 8×8 inputs, per-unit noise ``a·U(0.5, 1.5)`` in every
conv/linear layer, built by ``tests/mnvi_nets.py::c1_net`` (shared with the test; net seed 6 is
the test's net, seeds 7–10 are four more). Monte Carlo draws per-weight noise ``w = m(1 + √a ε)``
once per draw, so a conv weight is shared by all positions (the model of [002:(5)]).

For every layer three numbers are compared on every unit of every input:

* ``prop``: bayescli's :class:`MomentPropagator` on the net up to that layer (the end-to-end
  error accumulated so far);
* ``local``: that layer's rule alone applied to the *Monte-Carlo* marginal moments of its input
  (the error this layer's rule adds, given exact input marginals);
* ``cov``: for linear layers, the share of the output variance that comes from the
  covariances between the layer's inputs, ``m_iᵀ(Σ − diag Σ)m_i / Var_MC`` with Σ the
  Monte-Carlo input covariance — exactly what [002] Assumption 3 drops.

Variance columns: median |relative error| over units and inputs, the ratio of total variance
Σprop/ΣMC, the worst unit (units with MC variance above 1e-3 of the layer's mean). Mean column:
max |Δmean| / MC std. Monte-Carlo SE of a variance at 5·10⁴ draws ≈ 0.6% (Gaussian units).

A second Monte Carlo (``indep``) redraws the first conv's weights independently for every output
position, which removes the spatial correlation from weight sharing and nothing else.

Run: ``.venv/bin/python benchmarks/mnvi_layers.py`` (about 5 minutes on 2 cores);
``--draws``/``--inputs``/``--seeds`` shrink it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mnvi_nets import c1_net  # noqa: E402

from bayescli.posterior.vi.moments import MomentPropagator  # noqa: E402

NAMES = ["conv", "relu", "maxpool", "bn", "flatten", "linear1", "relu", "linear2"]
NOISY = {0: "0", 5: "5", 7: "7"}


def noise_for(prop: MomentPropagator, a: float, seed: int = 8) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: a * (0.5 + torch.rand(u, generator=gen, dtype=torch.float64)) for k, u in prop.layers.items()}


def draw(weight: torch.Tensor, a: torch.Tensor, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Draws ``m(1 + √a ε)`` of shape ``[*shape, *weight.shape]`` (``a`` per input unit = dim 1)."""
    eps = torch.randn(*shape, *weight.shape, generator=gen, dtype=torch.float64)
    sd = a.sqrt().view(-1, *[1] * (weight.dim() - 2))
    return weight * (1 + sd * eps)


def mc_layers(net: nn.Sequential, x: torch.Tensor, a: dict, total: int, indep: bool, seed: int) -> list:
    """Per layer: (mean, var, cov or None) of the flattened output under per-weight noise."""
    gen = torch.Generator().manual_seed(seed)
    conv = net[0]
    chunk = 10_000
    cols = F.unfold(x, 3)  # [1, 9, 36]
    sums: list = [None] * 8
    with torch.no_grad():
        for _ in range(total // chunk):
            if indep:  # an independent weight draw for each of the 36 output positions
                w = draw(conv.weight, a["0"], (chunk, cols.shape[2]), gen).reshape(chunk, 36, 4, 9)
                h = torch.einsum("slok,kl->sol", w, cols[0]) + conv.bias.view(1, -1, 1)
            else:
                w = draw(conv.weight, a["0"], (chunk,), gen).reshape(chunk, 4, 9)
                h = torch.matmul(w, cols) + conv.bias.view(1, -1, 1)
            outs = [h.view(chunk, 4, 6, 6)]
            for k in range(1, 8):
                mod, prev = net[k], outs[-1]
                if k in (5, 7):
                    wk = draw(mod.weight, a[NOISY[k]], (chunk,), gen)
                    outs.append(torch.einsum("sij,sj->si", wk, prev) + mod.bias)
                else:
                    outs.append(mod(prev))
            for k, o in enumerate(outs):
                o = o.reshape(chunk, -1)
                s1, s2 = o.sum(0), o.T @ o if k in (4, 6) else o.square().sum(0)
                sums[k] = (s1, s2) if sums[k] is None else (sums[k][0] + s1, sums[k][1] + s2)
    res = []
    for k, (s1, s2) in enumerate(sums):
        m = s1 / total
        if k in (4, 6):
            cov = (s2 - total * torch.outer(m, m)) / (total - 1)
            res.append((m, cov.diagonal().clone(), cov))
        else:
            res.append((m, (s2 - total * m.square()) / (total - 1), None))
    return res


def shape_of(k: int) -> tuple:
    return {0: (4, 6, 6), 1: (4, 6, 6), 2: (4, 3, 3), 3: (4, 3, 3)}.get(k, (-1,))


def compare(net, noise, x, mc, mc_indep) -> list:
    """Rows of per-unit (layer, kind, mean_err, var_rel, prop_var, mc_var) for one input."""
    rows = []
    with torch.no_grad():
        for k in range(8):
            if k == 4:
                continue  # flatten: identity on both moments
            sub = {NOISY[j]: noise[NOISY[j]] for j in NOISY if j <= k}
            out = MomentPropagator(net[: k + 1])(x, sub)
            m_mc, v_mc, _ = mc[k]
            loc_in = mc[k - 1] if k else None
            if k:
                layer = net[k : k + 1]
                lin = {NOISY[k]: noise[NOISY[k]]} if k in NOISY else {}
                mi, vi = loc_in[0].view(1, *shape_of(k - 1)), loc_in[1].view(1, *shape_of(k - 1))
                loc = MomentPropagator(layer)(mi, lin, input_var=vi)
            else:
                loc = out
            entry = {
                "k": k,
                "prop": (out.mean.flatten(), out.var.flatten()),
                "local": (loc.mean.flatten(), loc.var.flatten()),
            }
            entry["mc"] = (m_mc, v_mc)
            entry["indep"] = mc_indep[k][:2]
            if k in (5, 7):  # variance share from the input covariances (Assumption 3)
                cov = mc[k - 1 if k == 7 else 4][2]
                w = net[k].weight
                off = cov - torch.diag(cov.diagonal())
                term = torch.einsum("ij,jk,ik->i", w, off, w)
                entry["cov_share"] = term / v_mc
                entry["local_cov"] = loc.var.flatten() + term
            if k < 7:  # restart: rules from the MC marginals of this layer's output to the logits
                tail = {NOISY[j]: noise[NOISY[j]] for j in NOISY if j > k}
                r = MomentPropagator(net[k + 1 :])(
                    m_mc.view(1, *shape_of(k)), tail, input_var=v_mc.view(1, *shape_of(k))
                )
                entry["restart"] = r.var.flatten()
            else:
                entry["restart"] = v_mc
            rows.append(entry)
    return rows


def var_stats(pred_v, mc_v):
    keep = mc_v > 1e-3 * mc_v.mean()
    rel = (pred_v - mc_v) / mc_v
    return rel[keep].abs(), float(pred_v.sum() / mc_v.sum()), float(rel[keep].abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=50_000)
    ap.add_argument("--inputs", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[6, 7, 8, 9, 10])
    ap.add_argument("--a", type=float, nargs="+", default=[0.02, 0.05, 0.2])
    args = ap.parse_args()
    torch.set_num_threads(2)
    for a in args.a:
        table: dict = {}
        finals = []
        for seed in args.seeds:
            net = c1_net(seed)
            noise = noise_for(MomentPropagator(net), a)
            xs = torch.randn(
                args.inputs, 1, 1, 8, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64
            )
            for i, x in enumerate(xs):
                mc = mc_layers(net, x, noise, args.draws, False, 100 + i)
                mc_i = mc_layers(net, x, noise, args.draws, True, 200 + i)
                mc_final = mc[7]
                for e in compare(net, noise, x, mc, mc_i):
                    t = table.setdefault(
                        e["k"],
                        {
                            "rel": [],
                            "ratio": [],
                            "max": [],
                            "merr": [],
                            "loc_rel": [],
                            "loc_ratio": [],
                            "ind_ratio": [],
                            "cov": [],
                            "cov_fix": [],
                            "rs_ratio": [],
                            "rs_max": [],
                        },
                    )
                    m_mc, v_mc = e["mc"]
                    rel, ratio, mx = var_stats(e["prop"][1], v_mc)
                    t["rel"].extend(rel.tolist())
                    t["ratio"].append(ratio)
                    t["max"].append(mx)
                    t["merr"].append(
                        float(
                            ((e["prop"][0] - m_mc).abs() / v_mc.clamp_min(1e-30).sqrt())[
                                v_mc > 1e-3 * v_mc.mean()
                            ].max()
                        )
                    )
                    lrel, lratio, _ = var_stats(e["local"][1], v_mc)
                    t["loc_rel"].extend(lrel.tolist())
                    t["loc_ratio"].append(lratio)
                    t["ind_ratio"].append(var_stats(e["prop"][1], e["indep"][1])[1])
                    if "cov_share" in e:
                        t["cov"].extend(e["cov_share"].tolist())
                        t["cov_fix"].extend(var_stats(e["local_cov"], v_mc)[0].tolist())
                    _, rs_ratio, rs_max = var_stats(e["restart"], mc_final[1])
                    t["rs_ratio"].append(rs_ratio)
                    t["rs_max"].append(rs_max)
                    if e["k"] == 7:
                        signed = (e["prop"][1] - v_mc) / v_mc
                        finals.append((seed, i, ratio, mx, float(signed.min()), float(signed.max())))
        print(
            f"\n=== a = {a}·U(0.5,1.5), nets {args.seeds}, {args.inputs} inputs each, {args.draws} draws ==="
        )
        print(
            f"{'layer':<9}{'mean err':>9}{'|relvar| med':>13}{'max':>7}{'Σprop/ΣMC':>16}"
            f"{'local |rel| med':>17}{'local Σ ratio':>18}{'indep Σ ratio':>18}"
            f"{'cov share':>16}{'+cov |rel|':>11}"
            f"{'restart→logits Σ':>19}{'max':>7}"
        )
        for k, t in sorted(table.items()):

            def rng(v):
                return f"{min(v):.3f}–{max(v):.3f}"

            cov = f"{min(t['cov']):+.2f}…{max(t['cov']):+.2f}" if t["cov"] else ""
            fix = f"{statistics.median(t['cov_fix']):.4f}" if t["cov_fix"] else ""
            print(
                f"{NAMES[k]:<9}{max(t['merr']):9.3f}{statistics.median(t['rel']):13.4f}{max(t['max']):7.3f}"
                f"{rng(t['ratio']):>16}{statistics.median(t['loc_rel']):17.4f}{rng(t['loc_ratio']):>18}"
                f"{rng(t['ind_ratio']):>18}{cov:>16}{fix:>11}{rng(t['rs_ratio']):>19}{max(t['rs_max']):7.3f}"
            )
        worst = max(finals, key=lambda f: f[3])
        print(
            f"logits: worst unit |rel var err| {worst[3]:.3f} (net {worst[0]}, input {worst[1]}); "
            f"signed per-logit range {min(f[4] for f in finals):+.3f}…{max(f[5] for f in finals):+.3f}; "
            f"per-net max over inputs: "
            + ", ".join(f"{s}:{max(f[3] for f in finals if f[0] == s):.2f}" for s in args.seeds)
        )


if __name__ == "__main__":
    main()
