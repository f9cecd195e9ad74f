"""Diagnostics every method's record carries: the matching cost per layer before and after, and the JSON
view of a group element (engine.align.run.alignment_record)."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.align.context import F64
from engine.align.pair import Pair
from engine.models.base import Params
from engine.symmetry import GroupElement

SLICE = 1 << 20  # elements per slice of a big tensor in elementwise reductions


def slices(x: Tensor) -> list[Tensor]:
    """x cut along its first axis into views of about SLICE elements: temporaries stay small."""
    if x.dim() == 0 or x.numel() <= SLICE:
        return [x]
    return list(x.split(max(1, SLICE * x.shape[0] // x.numel())))


def layer_of(key: str) -> str:
    """'blocks.3.attn.W_Q' -> 'blocks.3'; embeddings, final norm and head -> 'outer'."""
    parts = key.split(".")
    return f"blocks.{parts[1]}" if parts[0] == "blocks" else "outer"


def matching_costs(pa: Params, pb: Params) -> dict[str, float]:
    """||theta_A - theta_B||^2 per layer ('outer' = embeddings, final norm, head), the weight-matching
    objective; divided by ||theta_A||^2 + ||theta_B||^2 so 1 means unrelated and 0 identical."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for k in pa:  # in slices of the parameters' own dtype: no copy of an embedding matrix
        L = layer_of(k)
        a, b = pa[k].detach(), pb[k].detach()
        num[L] = num.get(L, 0.0) + sum(float(torch.linalg.vector_norm(x - y)) ** 2 for x, y in zip(slices(a), slices(b)))
        den[L] = den.get(L, 0.0) + float(torch.linalg.vector_norm(a)) ** 2 + float(torch.linalg.vector_norm(b)) ** 2
    return {L: num[L] / den[L] if den[L] > 0 else 0.0 for L in num}


def rounded(t: Tensor, digits: int = 5) -> list:
    return torch.round(t.detach().to(F64), decimals=digits).tolist()


def describe_element(pair: Pair, g: GroupElement, classes: frozenset[str], view: list[dict] | None = None) -> dict:
    """The JSON view of a group element: permutations as index lists, RoPE complex scalars per head,
    Q/K and V/O maps by their singular values, the residual map (index list or matrix); `view`
    (matching_view) adds each layer's head cost matrix and matched-neuron similarities."""
    from engine.align.solvers import residual_perm_of, rope_scalars

    a = pair.arch
    layers = []
    for el in g.layers:
        d: dict = {
            "head_perm": el.head_perm.tolist(),
            "kv_perm": el.kv_perm.tolist(),
            "mlp_perm": el.mlp_perm.tolist(),
        }
        if "mlp_scale" in classes:
            d["mlp_scale"] = rounded(el.mlp_scale)
        if "qk" in classes:
            d["qk_singular_values"] = rounded(torch.linalg.svdvals(el.qk.to(F64)))
            if a.pe == "rope":
                z = rope_scalars(el.qk.to(F64), a.rope_layout, a.rotary_dim)  # [h_kv, r/2]
                d["rope_scalars"] = {"abs": rounded(z.abs()), "angle": rounded(z.angle())}
        if "vo" in classes:
            d["vo_singular_values"] = rounded(torch.linalg.svdvals(el.vo.to(F64)))
        layers.append(d | (view[len(layers)] if view else {}))
    O = g.residual.to(F64)
    perm = residual_perm_of(O)
    residual: dict = {"kind": "identity" if torch.equal(O, torch.eye(a.d_model, dtype=F64)) else
                      ("permutation" if perm is not None else "orthogonal")}
    if perm is not None:
        residual["perm"] = perm.tolist()
    else:
        residual["matrix"] = rounded(O, 4)
        residual["distance_from_identity"] = float(torch.linalg.matrix_norm(O - torch.eye(a.d_model, dtype=F64)))
    return {"layers": layers, "residual": residual}
