"""Activation matching: the weight-matching assignments, scored on activations over a data batch
(docs/MATH.md section 4.3; "Git Re-Basin", ICLR 2023, activation matching).

Both models see the same training batch. Everything used is invariant to the transforms it is not
solving for, so one pass suffices (no coordinate descent):

    residual   Omega from the residual stream at every block boundary, each boundary at unit mean
               square: Procrustes on X_B^T X_A (rotation), or an assignment on the cross-correlation
               (permutation)
    heads      sigma on ||pattern_i^A - pattern_j^B||^2 + ||z_i^A - z_j^B Omega||^2: attention
               patterns are invariant to A_i, head outputs z_i = softmax(..) V_i W_O^i to B_i
    qk         A per KV group from the query / key activations (before RoPE), the same GL / RoPE
               problem as weight matching with activations as rows, the weights' own rows stacked under
               them for what the batch does not span (weight_rows); under QK-norm the normalised q, k
               (gains included) move by the whole map, and the QK-norm group is fitted on them
    vo         B per KV group: the GL problem of weight matching (W_V moving by B, W_O^T by B^{-T}), in
               A's residual frame; value activations can leave it unbounded (see the code)
    mlp        pi on the correlation of hidden activations (after the nonlinearity); with mlp_scale
               |correlation| for SwiGLU (its up branch may flip sign), then s_j by least squares

Activations come from the reference-family twin (common.twin), hooked at each block's attention
and MLP inputs (the normalised residual stream); q, k, v, patterns and hidden units are then
computed from the canonical parameters in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engine.align.batches import train_batches
from engine.align.context import F64, AlignContext, AlignOutput, F64View, tick
from engine.align.forward import check_twin, twin
from engine.align.pair import Pair
from engine.align.solvers import assignment, fit_gl, gqa_assignment, procrustes, residual_perm_matrix
from engine.align.weight import bias_rows, circuit_inner, fit_qk, group_rows
from engine.align.weight import scratch_bytes as weight_scratch
from engine.cancel import CancelToken, check
from engine.classes import RESIDUAL
from engine.evaluate import seq_len
from engine.models.base import Arch, Params
from engine.models.reference import head_norm, mlp_activation, rotate
from engine.models.widening import widened
from engine.progress import Progress
from engine.symmetry import GroupElement, LayerElement

ACT_BATCH = {"lm": 16, "vit": 256}  # sequences of up to 128 tokens / images


def scratch_bytes(arch: Arch, params: int, layer_params: int, itemsize: int) -> int:
    """Peak scratch beyond the two models (bytes), from the config alone (registry entry `activation`; the
    arithmetic is engine.resources'): weight matching's, plus both models' captured residual streams and
    normalised block inputs of one batch of N positions, one layer's q, k, v, mixed values, patterns and
    hidden units (with their centred copies) in float64, and the twin check's logits (two sequences)."""
    D, h, d, m, L, V = arch.d_model, arch.n_heads, arch.d_head, arch.d_mlp, arch.n_layers, arch.n_out
    T, f = seq_len(arch), F64.itemsize
    n = ACT_BATCH[arch.task] * T
    return (weight_scratch(arch, params, layer_params, itemsize) + 2 * n * (3 * L + 1) * D * itemsize
            + 2 * f * n * (4 * h * d + h * T + 3 * m) + 2 * 2 * (T if arch.task == "lm" else 1) * V * itemsize)


class _Enough(Exception):
    """Raised by the last hook: the unembedding (logits [N, V]) is never computed."""


@torch.no_grad()
def capture(model, inputs: Tensor) -> dict[str, list[Tensor]]:
    """Residual stream at each block input and before the final norm, and each block's normalised
    attention / MLP inputs, from one forward pass of a reference-family module, stopped before the
    unembedding. Kept in the model's dtype on the CPU; the matching reads them in float64 one layer
    at a time."""
    net = model.module
    p = next(net.parameters())
    dtype = p.dtype
    out: dict[str, list[Tensor]] = {"resid": [], "x_attn": [], "x_mlp": []}

    def keep(key: str):  # in the model's dtype even where a bfloat16 forward computes in float32 (widened)
        return lambda m, a: out[key].append(a[0].to("cpu", dtype))

    def last(m, a):
        keep("resid")(m, a)
        raise _Enough

    hooks = []
    for blk in net.blocks:
        hooks += [blk.register_forward_pre_hook(keep("resid")), blk.attn.register_forward_pre_hook(keep("x_attn")),
                  blk.mlp.register_forward_pre_hook(keep("x_mlp"))]
    hooks.append(net.norm_f.register_forward_pre_hook(last))
    try:
        with widened(net):  # bfloat16 weights compute in float32 where the CPU lacks bfloat16 products
            net(inputs.to(p.device, dtype) if inputs.is_floating_point() else inputs.to(p.device))
    except _Enough:
        pass
    finally:
        for h in hooks:
            h.remove()
    return out


def boundary_rows(x: Tensor) -> Tensor:
    """The residual stream at one block boundary [B, T, D] as rows [B*T, D] scaled to unit mean square.

    Every reader sees the stream normalised, but its raw norm grows with depth (26-fold over the zoo
    ViTs' first block): unscaled, the deepest boundaries alone would fit the residual map and the
    embeddings would be ignored (bench/RESULTS.md, the ViT anomalies).
    """
    r = x.flatten(0, 1).to(F64)  # [B*T, D]
    return r / r.square().mean().sqrt().clamp_min(1e-30)


def attention_parts(arch: Arch, model, p: Params, layer: int, x: Tensor) -> dict[str, Tensor]:
    """q, k (before RoPE; after the QK-norm when there is one), v [B, n, T, d], patterns [B, h, T, T] and
    the heads' mixed values o [B*T, h*d] (head i's output is z_i = o_i W_O^i; never formed: head_output_inner)."""
    b, rep = f"blocks.{layer}.attn", arch.n_heads // arch.n_kv_heads
    proj = {}
    for r in "QKV":
        y = torch.einsum("btD,hDd->bhtd", x, p[f"{b}.W_{r}"])  # [B, n, T, d]
        if f"{b}.b_{r}" in p:
            y = y + p[f"{b}.b_{r}"][:, None]
        proj[r] = y
    if arch.qk_norm:  # before RoPE, as the model does (reference.head_norm)
        proj["Q"] = head_norm(proj["Q"], p[f"{b}.q_norm.g"], arch.norm_eps)
        proj["K"] = head_norm(proj["K"], p[f"{b}.k_norm.g"], arch.norm_eps)
    q, k = proj["Q"], proj["K"]
    if arch.pe == "rope":
        T, r = x.shape[1], arch.rotary_dim
        cs = (model.module.rope_cos[:T].to("cpu", F64), model.module.rope_sin[:T].to("cpu", F64))
        q, k = rotate(q, cs, r, arch.rope_layout), rotate(k, cs, r, arch.rope_layout)
    k, v = k.repeat_interleave(rep, 1), proj["V"].repeat_interleave(rep, 1)  # [B, h, T, d]
    s = q @ k.mT / math.sqrt(arch.d_head)  # [B, h, T, T]
    if arch.causal:
        T = s.shape[-1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = s.softmax(-1)  # [B, h, T, T]
    del s
    o = (att @ v).transpose(1, 2).flatten(0, 1).flatten(1)  # [B*T, h*d], heads side by side
    return {"q": proj["Q"], "k": proj["K"], "v": proj["V"], "pattern": att, "o": o}


def head_output_inner(oa: Tensor, Wa: Tensor, ob: Tensor, Wb: Tensor, h: int) -> Tensor:
    """<z_i^A, z_j^B>  [h, h] for head outputs z_i = o_i W_i (o [N, h*d], W [h, d, D]) without forming
    any z ([h, N, D], 150 MB per model at GPT-2-small): weight.circuit_inner on (o, W^T)."""
    return circuit_inner(oa, Wa.flatten(0, 1).mT, ob, Wb.flatten(0, 1).mT, h)


def hidden(arch: Arch, p: Params, layer: int, x: Tensor) -> Tensor:
    """Post-nonlinearity hidden activations [B*T, m] of block `layer`'s MLP."""
    b = f"blocks.{layer}.mlp"
    u = x @ p[f"{b}.W_in"] + p.get(f"{b}.b_in", 0)  # [B, T, m]
    a = mlp_activation(arch.mlp, u, x @ p[f"{b}.W_gate"] if arch.gated else None)
    return a.flatten(0, 1)  # [B*T, m]


def correlation(X: Tensor, Y: Tensor) -> Tensor:
    """Pearson correlation of the columns of X [N, n] with those of Y [N, n] -> [n, n]."""
    X = X - X.mean(0)
    Y = Y - Y.mean(0)
    X = X / X.norm(dim=0).clamp_min(1e-30)
    Y = Y / Y.norm(dim=0).clamp_min(1e-30)
    return X.T @ Y  # [n, n]


def _rows_per_head(t: Tensor) -> Tensor:
    """[B, n, T, d] -> [n, B*T, d]: one row stack per head."""
    return t.permute(1, 0, 2, 3).flatten(1, 2)  # [n, B*T, d]


def activation_match(pair: Pair, kinds: frozenset[str], inputs: Tensor, qk_structure: str | None = None,
                     progress: Progress | None = None, cancel: CancelToken | None = None) -> tuple[GroupElement, dict]:
    """The activation-matching element from one batch `inputs`; `progress` hears of every layer and
    `cancel` is checked before each (engine.cancel)."""
    arch, spec = pair.arch, pair.spec
    pa, pb = F64View(pair.params_a), F64View(pair.params_b)  # one parameter at a time, never the model
    ta, tb = twin(pair.model_a), twin(pair.model_b)
    check_twin(pair.model_a, ta, inputs[:2])  # two sequences: logits [2, T, V], not the batch's
    check_twin(pair.model_b, tb, inputs[:2])
    acts_a, acts_b = capture(ta, inputs), capture(tb, inputs)
    structure = qk_structure or spec.groups["blocks.0.qk"].structure
    rep, D = arch.n_heads // arch.n_kv_heads, arch.d_model

    # residual stream first: everything below is invariant to it, except the head outputs z
    O = torch.eye(D, dtype=F64)
    if set(RESIDUAL) & kinds:
        stats = Moments(D)
        for xa, xb in zip(acts_a.pop("resid"), acts_b.pop("resid")):  # one block boundary at a time
            stats.add(boundary_rows(xa), boundary_rows(xb))  # [N, D] each
        if "residual_perm" in kinds:
            O = residual_perm_matrix(assignment(stats.correlation()))
        else:
            O = procrustes(stats.cross)
    acts_a.pop("resid", None), acts_b.pop("resid", None)

    layers, corr = [], []
    for layer in range(arch.n_layers):
        check(cancel, f"activation matching, layer {layer + 1}/{arch.n_layers}")
        at_a = attention_parts(arch, ta, pa, layer, acts_a["x_attn"][layer].to(F64))
        at_b = attention_parts(arch, tb, pb, layer, acts_b["x_attn"][layer].to(F64))
        hp = torch.arange(arch.n_heads)
        if "heads" in kinds:
            Pa, Pb = at_a["pattern"].transpose(0, 1).flatten(1), at_b["pattern"].transpose(0, 1).flatten(1)  # [h, *]
            Wa, Wb = pa[f"blocks.{layer}.attn.W_O"], pb[f"blocks.{layer}.attn.W_O"] @ O  # [h, d, D]: B in A's frame
            h = arch.n_heads
            za = head_output_inner(at_a["o"], Wa, at_a["o"], Wa, h).diagonal()  # ||z_i^A||^2 [h]
            zb = head_output_inner(at_b["o"], Wb, at_b["o"], Wb, h).diagonal()
            cost = (_norm_sqdist(Pa.square().sum(1), Pb.square().sum(1), Pa @ Pb.T)
                    + _norm_sqdist(za, zb, head_output_inner(at_a["o"], Wa, at_b["o"], Wb, h)))  # [h, h]
            hp = gqa_assignment(-cost, rep)
            del Pa, Pb, Wa, Wb
        kv = hp[::rep] // rep
        A = B = torch.eye(arch.d_head, dtype=F64).repeat(arch.n_kv_heads, 1, 1)  # [h_kv, d, d]
        if "qk" in kinds:
            Qa = _rows_per_head(at_a["q"]).reshape(arch.n_kv_heads, -1, arch.d_head)  # [h_kv, rep*B*T, d]
            Qb = _rows_per_head(at_b["q"])[hp].reshape(arch.n_kv_heads, -1, arch.d_head)  # [h_kv, rep*B*T, d]
            Ka, Kb = _rows_per_head(at_a["k"]), _rows_per_head(at_b["k"])[kv]  # [h_kv, B*T, d]
            if not arch.qk_norm:  # the weights' rows settle what the batch cannot see (weight_rows)
                (wqa, wqb), (wka, wkb) = (weight_rows(pa, pb, O, layer, r) for r in "QK")
                Qa, Qb = torch.cat([Qa, group_rows(wqa, rep)], 1), torch.cat([Qb, group_rows(wqb[hp], rep)], 1)
                Ka, Kb = torch.cat([Ka, wka], 1), torch.cat([Kb, wkb[kv]], 1)
            A = fit_qk(arch, structure, Qa, Qb, Ka, Kb)
        if "vo" in kinds:
            # On the weights, as weight matching fits it (W_V moves by B, W_O^T by B^{-T}), with B's in
            # A's residual frame. Not on value activations: they may span fewer directions than the
            # head (the zoo ViTs' residual streams hold 99% of their energy in 10-15 of 64 dims), and
            # along a direction they miss B can grow without cost while B^{-1} W_O shrinks, so the fit
            # ran off to singular values near 1,000 on vit-rope (bench/RESULTS.md, the ViT anomalies).
            att = f"blocks.{layer}.attn"
            Va, Vb = weight_rows(pa, pb, O, layer, "V")  # [h_kv, D+, d]
            Vb = Vb[kv]
            Oa = pa[f"{att}.W_O"].mT.reshape(arch.n_kv_heads, -1, arch.d_head)  # [h_kv, rep*D, d]
            Ob = (pb[f"{att}.W_O"][hp] @ O).mT.reshape(arch.n_kv_heads, -1, arch.d_head)  # writers: W Omega
            B = fit_gl(Va, Vb, Oa, Ob)
        del at_a, at_b
        ha = hidden(arch, pa, layer, acts_a["x_mlp"][layer].to(F64))  # [N, m]
        hb = hidden(arch, pb, layer, acts_b["x_mlp"][layer].to(F64))
        mp = torch.arange(arch.d_mlp)
        c = correlation(ha, hb)  # [m, m]
        if "mlp" in kinds:
            signed = "mlp_scale" in kinds and arch.gated
            mp = assignment(c.abs() if signed else c)
        corr.append(float(c[torch.arange(arch.d_mlp), mp].mean()))
        s = torch.ones(arch.d_mlp, dtype=F64)
        if "mlp_scale" in kinds:  # h_A ~ s h_B: least squares per neuron
            hbp = hb[:, mp]
            s = (ha * hbp).sum(0) / hbp.square().sum(0).clamp_min(1e-30)
            bad = (s <= 0) if arch.mlp == "relu" else (s == 0)
            s = torch.where(bad, torch.ones_like(s), s)
        layers.append(LayerElement(hp, A, B, mp, s))
        if progress:
            progress(layer + 1, arch.n_layers, f"layer {layer + 1}/{arch.n_layers}")
    return GroupElement(tuple(layers), O), {"mlp_matched_correlation": corr, "tokens": int(acts_a["x_mlp"][0].shape[:2].numel())}


def weight_rows(pa: Params, pb: Params, O: Tensor, layer: int, r: str) -> tuple[Tensor, Tensor]:
    """W_r (r of Q, K, V) with its bias as a last row [n, D+1, d] for A, and for B in A's residual frame (readers:
    Omega^T W): the rows of the V/O fit, and of the Q/K fit beside the activations.

    q = x W_Q + b_Q, so a weight row is the projection of a unit input: stacked under the activations it enters
    the Q/K fit as one more input, with about 1/N of the N activation rows' weight (a normalised input row has
    D times a weight row's squared norm). Where the batch determines the map the activations decide; where it
    does not, the weights do. The batch's inputs can span few directions: the first block sees only the
    embeddings of the tokens present (48 distinct bytes in 16 sequences of the bundled corpus), fewer than a
    wide head's unrotated dims (GPT-NeoX-1B: 192 of 256), and an underdetermined GL fit there missed a planted
    element by 1.0 relative (bench/RESULTS.md, "A GPT-NeoX-shaped billion, and activation matching at that
    size")."""
    key, bias = f"blocks.{layer}.attn.W_{r}", f"blocks.{layer}.attn.b_{r}"
    wa = bias_rows(pa, key, bias)  # [n, D(+1), d]
    wb = torch.einsum("De,hDd->hed", O, pb[key])  # [n, D, d]
    if bias in pb:
        wb = torch.cat([wb, pb[bias][:, None]], 1)
    return wa, wb


def _norm_sqdist(nx: Tensor, ny: Tensor, inner: Tensor) -> Tensor:
    """||X_i - Y_j||^2 / mean(||X||^2 + ||Y||^2) from the squared norms [n] and inner products [n, n]:
    two cost terms of different units on one scale."""
    d = nx[:, None] + ny[None] - 2 * inner  # [n, n]
    return d / (nx.mean() + ny.mean()).clamp_min(1e-30)


class Moments:
    """Column statistics of two row sets [N, D] streamed block by block: the cross product X_B^T X_A
    (Procrustes) and the Pearson correlation of A's columns with B's (assignment), never the rows."""

    def __init__(self, D: int):
        self.n = 0
        self.sa, self.sb = torch.zeros(D, dtype=F64), torch.zeros(D, dtype=F64)
        self.qa, self.qb = torch.zeros(D, dtype=F64), torch.zeros(D, dtype=F64)
        self.cross = torch.zeros(D, D, dtype=F64)  # X_B^T X_A

    def add(self, xa: Tensor, xb: Tensor) -> None:
        self.n += xa.shape[0]
        self.sa += xa.sum(0)
        self.sb += xb.sum(0)
        self.qa += xa.square().sum(0)
        self.qb += xb.square().sum(0)
        self.cross += xb.T @ xa

    def correlation(self) -> Tensor:
        """[D_A, D_B]: the correlation of A's column i with B's column j over all rows added."""
        ma, mb = self.sa / self.n, self.sb / self.n
        cov = self.cross.T - self.n * ma[:, None] * mb[None]  # [D, D]
        sa = (self.qa - self.n * ma.square()).clamp_min(0).sqrt().clamp_min(1e-30)
        sb = (self.qb - self.n * mb.square()).clamp_min(0).sqrt().clamp_min(1e-30)
        return cov / sa[:, None] / sb[None]


def align_activations(ctx: AlignContext) -> AlignOutput:
    """Activation matching over ctx.classes on one training batch (registry entry `activation`)."""
    t = tick()
    arch = ctx.pair.arch
    x, _ = next(train_batches(arch, ACT_BATCH[arch.task], ctx.seed))
    g, info = activation_match(ctx.pair, ctx.classes, x, ctx.qk_structure, ctx.progress, ctx.cancel)
    return AlignOutput(g, info | {"seconds": t()})
