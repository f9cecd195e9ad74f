"""The circuit path: interpolate every head's QK and OV circuits instead of its factored weights.

The weight path (engine.interpolate.LinearPath) lerps W_Q, W_K, W_V and W_O. The circuit path lerps
the bilinear forms they compose into, per query head i, on [x, 1] (biases included):

    M_i(lam) = (1 - lam) M_i^A + lam M_i^B      M = [W_Q; b_Q] [W_K; b_K]^T   (attention scores)
    N_i(lam) = (1 - lam) N_i^A + lam N_i^B      N = [W_V; b_V] W_O            (values into the residual)

Both sums are products of factors twice as wide, so the model at lam is the reference family with
head width 2d and nothing else changed:

    (1 - lam) Q_A K_A^T + lam Q_B K_B^T = [sqrt(1 - lam) Q_A | sqrt(lam) Q_B] [sqrt(1 - lam) K_A | sqrt(lam) K_B]^T
    (1 - lam) V_A O_A + lam V_B O_B = [(1 - lam) V_A | lam V_B] [O_A ; O_B]

The doubled head's attention scale 1/sqrt(2d) is turned back into the endpoints' 1/sqrt(d) by a
factor sqrt(2) on the queries. Embeddings, norms, MLPs, output biases and the head lerp as on the
weight path. At lam = 0 and 1 the model computes the endpoints; in between it depends on each head
only through its circuits, so it is unchanged by any within-head map of either endpoint (the Q/K
and V/O groups of docs/MATH.md section 1), which the weight path is not.

RoPE: the score of query t and key s is q_t R_{s-t} k_s^T with one rotation frequency per pair, so
each half of the doubled head must rotate with the endpoints' own frequencies. The work model's
rotary tables hold the endpoints' r/2 frequencies twice, and the columns are laid out so that
doubled pair j < r/2 carries A's pair j and pair r/2 + j carries B's pair j (for either pairing
layout, partial RoPE included: the unrotated dims of A and then B follow the 2r rotated ones).

QK-norm: the score is no longer the bilinear form M_i of the weights (a per-head RMSNorm sits between
x W_Q and the product), so a QK-norm model has no circuit path and is refused (`circuit_refusal`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from engine.errors import LMCError
from engine.models import Model, canonical
from engine.models.base import Arch, Params, check_same_architecture
from engine.models.reference import RefConfig, Transformer, rope_frequencies, rope_pairs
from engine.results import PATHS

__all__ = ["PATHS", "CircuitPath", "circuit_refusal", "doubled_config", "half_columns"]
ATTN = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V")  # the factored head weights the circuit path replaces


def circuit_refusal(arch: Arch) -> str | None:
    """Why `arch` has no circuit path, or None."""
    if arch.qk_norm:
        return ("its QK-norm normalises each head's queries and keys before the product, so attention scores are "
                "not the bilinear circuits W_Q W_K^T the circuit path interpolates")
    return None


def half_columns(d: int, r: int, layout: str | None) -> tuple[Tensor, Tensor]:
    """Where A's and B's head columns go in the doubled head of width 2d: (ia [d], ib [d]).

    Doubled RoPE pair j (rope_pairs(2r, layout)) takes A's pair j for j < r/2 and B's pair j - r/2
    above; the d - r unrotated dims go to 2r.. (A) and 2r + d - r.. (B). Without RoPE (r = 0): A's
    columns first, then B's.
    """
    ia, ib = torch.empty(d, dtype=torch.long), torch.empty(d, dtype=torch.long)
    if r:
        i1, i2 = rope_pairs(r, layout)  # [r/2] each: the endpoints' pairs
        J1, J2 = rope_pairs(2 * r, layout)  # [r] each: the doubled head's pairs
        h = r // 2
        ia[i1], ia[i2] = J1[:h], J2[:h]
        ib[i1], ib[i2] = J1[h:], J2[h:]
    rest = torch.arange(d - r)
    ia[r:], ib[r:] = 2 * r + rest, 2 * r + (d - r) + rest
    return ia, ib


def doubled_config(model: Model, params: Params) -> RefConfig:
    """The reference-family config of the circuit path's model: `model`'s architecture, heads 2d wide."""
    from engine.surgery import reference_config_from_arch

    a = model.arch
    P = params["embed.patch.W"].shape[0] if "embed.patch.W" in params else None
    cfg = reference_config_from_arch(a, patch_dim=P)
    return replace(cfg, d_head=2 * a.d_head, rotary_dim=2 * a.rotary_dim if a.pe == "rope" else 0)


class CircuitPath:
    """The circuit path between two models, evaluated in one preallocated doubled-head work model.

    Same interface as engine.interpolate.LinearPath: `at(lam)` sets the work model to the path's model
    at lam and returns it. The endpoints may live on the CPU while the work model lives on `device`
    (each tensor is copied over when it is written). Both endpoints must have the same architecture
    (check_same_architecture); any family the reference family can express is accepted.
    """

    def __init__(self, a: Model, b: Model, device: str | torch.device | None = None):
        check_same_architecture(a, b)
        why = circuit_refusal(a.arch)
        if why:
            raise LMCError(f"The circuit path is not defined for {a.name or a.family}: {why}.")
        self.a, self.b = a, b
        self._pa, self._pb = canonical(a, copy=False), canonical(b, copy=False)  # views where the layout allows
        p = next(iter(self._pa.values()))
        self.device = torch.device(device) if device is not None else p.device
        arch = a.arch
        cfg = doubled_config(a, self._pa)
        module = Transformer(cfg).to(dtype=p.dtype, device=self.device)
        if arch.pe == "rope":  # both halves rotate with the endpoints' own frequencies
            w = rope_frequencies(arch.rotary_dim, arch.rope_base, arch.rope_scaling)  # [r/2]
            ang = torch.arange(cfg.seq_len, dtype=torch.float64)[:, None] * torch.cat([w, w])  # [T, r]
            module.rope_cos, module.rope_sin = ang.cos().to(self.device), ang.sin().to(self.device)
        self.work = Model("reference", cfg.arch(), module, cfg.to_dict(), name=f"circuits({a.name}, {b.name})")
        self._sw = module.state_dict()
        missing = sorted(set(self._sw) ^ set(self._pa))
        if missing:  # a bug in doubled_config, not a user error, but say it plainly
            raise LMCError(f"The circuit path's model and {a.name or 'model A'} disagree on parameter {missing[0]!r}.")
        self.ia, self.ib = (i.to(self.device) for i in half_columns(arch.d_head, arch.rotary_dim, arch.rope_layout))
        self.at(0.0)

    def _get(self, params: Params, key: str) -> Tensor:
        return params[key].detach().to(self.device, self._sw[key].dtype)

    @torch.no_grad()
    def at(self, lam: float) -> Model:
        """The work model set to the circuit path's model at lam (the endpoints at lam 0 and 1)."""
        q = (math.sqrt(2 * (1 - lam)), math.sqrt(2 * lam))  # sqrt(2): scale 1/sqrt(2d) -> 1/sqrt(d)
        k = (math.sqrt(1 - lam), math.sqrt(lam))
        v = (1 - lam, lam)
        scales = {"W_Q": q, "b_Q": q, "W_K": k, "b_K": k, "W_V": v, "b_V": v, "W_O": (1.0, 1.0)}
        for key, w in self._sw.items():
            name = key.rsplit(".", 1)[-1]
            if ".attn." in key and name in scales:
                sa, sb = scales[name]
                xa, xb = self._get(self._pa, key), self._get(self._pb, key)
                if name == "W_O":  # [h, d, D] -> rows of the doubled head [h, 2d, D]
                    w[:, self.ia], w[:, self.ib] = xa * sa, xb * sb
                else:  # [n, D, d] or [n, d] -> columns of the doubled head
                    w[..., self.ia], w[..., self.ib] = xa * sa, xb * sb
            elif w.is_floating_point():
                torch.lerp(self._get(self._pa, key), self._get(self._pb, key), lam, out=w)
        return self.work

