"""The symmetry group's size from the architecture alone (no weights, so from a config.json too).

- group dimension from the formulas of docs/MATH.md sections 1-3, per component, per layer and in total;
- the sinusoidal table's spectrum, whose rank fixes how many residual rotations stay exact.
"""

from __future__ import annotations

import torch

from engine.models.base import SCALED_MLPS, Arch
from engine.models.reference import sinusoidal_table
from engine.spec import check_arch

__all__ = ["group_dimension", "sinusoidal_spectrum"]


# ---------------------------------------------------------------------------------------------
# Group dimension from the formulas (docs/MATH.md sections 1-3, 6)


def group_dimension(arch: Arch, centred: bool | None = None) -> dict:
    """Continuous dimension of the symmetry group, per component, per layer and in total.

    Counted for the folded form (RMSNorm gains in the readers; LayerNorm rewritten as RMSNorm; a post-norm
    encoder as given, since no rewrite removes its stream norms), with the logits as the function (the
    log-softmax would add the head's constant-column gauge).
      qk   h_kv (r + (d - r)^2)   GL(d) without RoPE (r = 0), H(r) x GL(d - r) with it;
           d / 2 with QK-norm     one gain scale per frequency pair and layer, shared by every head
      vo   h_kv d^2
      key_bias    h_kv (d - r)   b_K + t on unrotated dims (per KV group: docs/MATH.md section 7); none with
                                 QK-norm (the norm sees the shift)
      value_bias  h_kv d         b_V + t folded into b_O (needs b_O)
      mlp_scale   m              ReLU or SwiGLU
      residual_orth  D(D-1)/2    O(D); sinusoidal: only rotations fixing P_sin's row differences are exact
      pe_shift    D (LM) or 2D (ViT: class token / row 0 and patch bias / rows 1..N); untied only
      ln_reader_gauge            `centred` (default: a LayerNorm model): the stream lies in the hyperplane
                                 orthogonal to 1, so every reader column may add a multiple of 1 there:
                                 per layer h d + 2 h_kv d + m (2m for SwiGLU), plus n_out for an untied head;
                                 post-norm (BERT, docs/MATH.md section 9): the same columns move along 1/g
                                 of the norm before them, plus the masked-LM head's dense layer (D)
    Permutations are discrete (dimension 0).
    """
    check_arch(arch)
    D, hkv, d, m, r, L = arch.d_model, arch.n_kv_heads, arch.d_head, arch.d_mlp, arch.rotary_dim, arch.n_layers
    centred = arch.norm == "layernorm" if centred is None else centred
    qk = r // 2 if arch.qk_norm else hkv * (r + (d - r) ** 2)  # QK-norm: docs/MATH.md section 1
    vo = hkv * d * d
    kb = hkv * (d - r) if arch.attn_bias and not arch.qk_norm else 0
    vb = hkv * d if arch.attn_bias and arch.out_bias else 0
    ms = m if arch.mlp in SCALED_MLPS else 0
    gauge = arch.n_heads * d + 2 * hkv * d + m * (2 if arch.gated else 1) if centred else 0
    head_gauge = arch.n_out if centred and not arch.tied_embeddings else 0
    if centred and arch.post_norm:  # the head's dense layer reads the last stream norm (docs/MATH.md section 9)
        head_gauge += D
    notes = []
    if arch.pe == "sinusoidal":
        # Omega must fix every difference P_sin[t] - P_sin[t0] (the embedding absorbs a constant shift):
        # LM rows 0..T-1, ViT patch rows 1..N (the class token absorbs row 0); distinct frequencies make
        # these differences independent, so their rank is min(#differences, D)
        k = min(arch.n_ctx - (1 if arch.task == "lm" else 2), D)
        res = (D - k) * (D - k - 1) // 2
        notes.append(f"sinusoidal PE: exact residual rotations must fix {k} independent differences of P_sin "
                     f"rows (dim {res}); O({D}) is only approximate")
    elif arch.post_norm:  # docs/MATH.md section 9: permutations only, dimension 0
        res = 0
        notes.append("post-LayerNorm: the residual stream admits permutations only (and the global sign), no rotations")
    else:
        res = D * (D - 1) // 2
    pe = (D if arch.task == "lm" else 2 * D) if arch.pe == "learned" and not arch.tied_embeddings else 0
    if arch.pe == "learned" and arch.tied_embeddings:
        notes.append("tied embeddings: the embedding shift moves the logits by a per-position constant, a "
                     "symmetry of the log-probabilities only, not counted")
    if arch.post_norm:
        notes.append("post-LayerNorm: counted as given (no rewrite removes the stream norms' gains); each reader "
                     "column may move along 1/g of the norm before it, every writer row's mean is a free gauge")
    elif arch.norm == "layernorm":
        notes.append("LayerNorm: counted for the RMSNorm rewrite; as given, the gains and biases add per-norm "
                     "scalings and bias shifts, every writer row's mean is a free gauge, and only rotations "
                     "fixing the all-ones vector are exact")
    per_layer = [{"layer": i, "qk": qk, "vo": vo, "key_bias": kb, "value_bias": vb, "attention": qk + vo + kb + vb,
                  "mlp": ms, "ln_reader_gauge": gauge, "total": qk + vo + kb + vb + ms + gauge} for i in range(L)]
    by_kind = {"heads": 0, "mlp": 0, "mlp_scale": L * ms, "qk": L * qk, "vo": L * vo, "residual_perm": 0,
               "residual_orth": res, "key_bias": L * kb, "value_bias": L * vb, "pe_shift": pe}
    if centred:
        by_kind["ln_reader_gauge"] = L * gauge + head_gauge
    return {"per_layer": per_layer, "total": sum(by_kind.values()), "by_kind": by_kind, "notes": notes}


# ---------------------------------------------------------------------------------------------
# Sinusoidal spectrum


def sinusoidal_spectrum(n_pos: int, d_model: int, rtol: float = 1e-6) -> dict:
    """Singular values of P_sin[:n_pos] (docs/MATH.md section 3): rank, and how many are below rtol * sigma_max."""
    s = torch.linalg.svdvals(sinusoidal_table(n_pos, d_model, torch.float64))  # [min(T, D)]
    small = int((s < rtol * s[0]).sum())
    return {"n_pos": n_pos, "d_model": d_model, "singular_values": [float(v) for v in s],
            "sigma_max": float(s[0]), "sigma_min": float(s[-1]), "condition": float(s[0] / s[-1]),
            "n_below_rtol": small, "rtol": rtol, "numerical_rank": len(s) - small}
