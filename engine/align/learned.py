"""Learned matching: optimise the transform on the task loss of the interpolated model
(MATH.md section 4; "Git Re-Basin", ICLR 2023, straight-through estimator).

    min over latents  E_{lam ~ U(0.4, 0.6)}  L((1 - lam) theta_A + lam g(theta_B))

with the model weights frozen and Adam on the latents only, initialised at the weight-matching
solution. Each class has its own latent:

    heads, mlp, residual_perm   Z [n, n]; forward the permutation Hungarian(Z) (GQA-aware for heads),
                                backward the straight-through gradient dL/dZ = dL/dP
    residual_orth               Omega = polar(Omega_0 (I + E)); Newton-Schulz iterations in the forward
                                pass (torch's SVD gradient is undefined at repeated singular values,
                                which is exactly the start), the exact SVD polar factor at the end
    qk, vo (GL)                 A = A_0 (I + E)
    qk (RoPE)                   z_j = z_j0 exp(e_r + i e_phi) per pair, times A_0 (I + E) on the
                                unrotated dims of a partial RoPE
    mlp_scale                   s = s_0 exp(e)

The loss needs gradients through the group action, so `apply_dense` re-states engine/symmetry.apply
with permutation MATRICES (the straight-through ones); for hard permutations it equals apply
(tests/engine/test_align.py). The forward pass is torch.func.functional_call on the
reference-family twin (common.twin). The element returned is always the hard, exact one: the best
seen on a fixed validation batch (midpoint loss), the weight-matching start included.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor, nn

from engine.align.common import (
    F64,
    AlignContext,
    AlignOutput,
    check_twin,
    functional_logits,
    task_loss,
    tick,
    train_batches,
    twin,
    val_batch,
)
from engine.align.solvers import (
    assignment,
    gqa_assignment,
    perm_matrix,
    procrustes,
    residual_perm_from_scores,
    rope_scalars,
)
from engine.align.weight import weight_match
from engine.models.base import Arch, Params
from engine.spec import Spec
from engine.symmetry import GroupElement, LayerElement, apply, compose, identity, invert, rope_commutant

DEFAULT_STEPS = 100  # the documented budget of `learned` and `dual` when a run asks for 0 steps
LR = {"perm": 0.05, "map": 2e-3}  # Adam step sizes: permutation latents, continuous latents
LAMBDA = (0.4, 0.6)
VAL_ITEMS = {"lm": 4096, "vit": 512}  # validation tokens / images for picking the best element
EVALS = 10  # validation checks per run
CHUNK = 16  # sequences / images per forward pass when evaluating


# ---------------------------------------------------------------------------------------------
# The differentiable action


def _right(x: Tensor, axis: int, M: Tensor, by_axis: int | None, per: int) -> Tensor:
    """x <- x M along `axis` (engine/symmetry.py `_right`, restated here next to its dense twin)."""
    if by_axis is None:
        return (x.movedim(axis, -1) @ M).movedim(-1, axis)  # same shape as x
    Ms = M[torch.arange(x.shape[by_axis], device=M.device) // per]  # [size(by_axis), s, s]
    y = x.movedim((by_axis, axis), (0, -1))  # [size(by_axis), ..., s]
    y = torch.einsum("i...s,ist->i...t", y, Ms)  # [size(by_axis), ..., s]
    return y.movedim((0, -1), (by_axis, axis))  # same shape as x


def apply_dense(spec: Spec, mats: dict[str, dict[str, Tensor]], params: Params, residual_is_perm: bool) -> Params:
    """g.theta with permutations as matrices P (x <- P x along the axis: new i = sum_j P[i, j] old j).

    mats[group][role] as in engine/symmetry.apply: "perm"/"perm_kv" [n, n] matrices, "right" and
    "right_inv_t" [.., s, s], "scale" [m]; groups absent from mats act as the identity.
    Permutations act first, as in apply, because the maps are indexed by the new index.
    """
    out: Params = {}
    for key, ps in spec.params.items():
        x = params[key]
        for axis, acts in enumerate(ps.axes):
            for a in acts:
                if a.role in ("perm", "perm_kv") and a.group in mats:
                    P = mats[a.group][a.role].to(x.device, x.dtype)
                    x = (x.movedim(axis, -1) @ P.T).movedim(-1, axis)  # same shape
        for axis, acts in enumerate(ps.axes):
            for a in acts:
                m = mats.get(a.group)
                if m is None:
                    continue
                if a.role in ("right", "right_inv_t"):
                    x = _right(x, axis, m[a.role].to(x.device, x.dtype), a.by_axis, a.per)
                elif a.role in ("scale", "inv_scale"):
                    shape = [1] * x.dim()
                    shape[axis] = -1
                    s = m["scale"].to(x.device, x.dtype).reshape(shape)  # broadcast along `axis`
                    x = x * s if a.role == "scale" else x / s
                elif a.role == "norm" and residual_is_perm:  # gains follow a permutation, are folded otherwise
                    x = (x.movedim(axis, -1) @ m["right"].to(x.device, x.dtype)).movedim(-1, axis)  # same shape
        out[key] = x
    return out


def straight_through(hard: Tensor, Z: Tensor) -> Tensor:
    """Value `hard`, gradient as if it were Z (Z - Z.detach() is exactly zero in the forward pass)."""
    return hard + (Z - Z.detach())


def newton_schulz_polar(M: Tensor, iters: int = 12) -> Tensor:
    """The orthogonal polar factor of M, differentiable everywhere (X <- 1.5 X - 0.5 X X^T X)."""
    X = M / torch.linalg.matrix_norm(M.detach(), 2)  # singular values in (0, 1]: the iteration converges
    for _ in range(iters):
        X = 1.5 * X - 0.5 * X @ X.mT @ X
    return X


def rope_basis(layout: str, r: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """rope_commutant is affine in (Re z, Im z): A(z) = A(0) + sum_j Re z_j C_j + Im z_j S_j.

    Built from symmetry.rope_commutant itself, so the convention is the one apply checks; the
    affine form keeps A differentiable in z (rope_commutant writes into a tensor in place).
    """
    n = r // 2
    zero = rope_commutant(torch.zeros(n, dtype=torch.complex128), layout, d)  # [d, d]
    unit = torch.eye(n, dtype=F64)
    C = rope_commutant(torch.complex(unit, torch.zeros_like(unit)), layout, d) - zero  # [r/2, d, d]
    S = rope_commutant(torch.complex(torch.zeros_like(unit), unit), layout, d) - zero  # [r/2, d, d]
    return zero, C, S


# ---------------------------------------------------------------------------------------------
# Latents of one side's transform


class Transform(nn.Module):
    """Latents of one group element started at `g0`: `mats()` for the loss, `element()` for the result."""

    def __init__(self, arch: Arch, spec: Spec, kinds: frozenset[str], g0: GroupElement):
        super().__init__()
        self.arch, self.spec, self.kinds, self.g0 = arch, spec, kinds, g0
        L, d, hkv = arch.n_layers, arch.d_head, arch.n_kv_heads
        self.rep = arch.n_heads // hkv
        self.rope = spec.groups["blocks.0.qk"].structure == "rope_commutant"

        def zeros(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=F64))

        if "heads" in kinds:
            self.Z_heads = nn.Parameter(torch.stack([perm_matrix(el.head_perm) for el in g0.layers]))  # [L, h, h]
        if "mlp" in kinds:
            self.Z_mlp = nn.Parameter(torch.stack([perm_matrix(el.mlp_perm) for el in g0.layers]))  # [L, m, m]
        if "mlp_scale" in kinds:
            self.e_scale = zeros(L, arch.d_mlp)
        if "qk" in kinds:
            self.E_qk = zeros(L, hkv, d, d)
            if self.rope:
                self.e_rope = zeros(L, hkv, arch.rotary_dim // 2, 2)  # (log-modulus, phase) per pair
                self.basis = rope_basis(arch.rope_layout, arch.rotary_dim, d)
        if "vo" in kinds:
            self.E_vo = zeros(L, hkv, d, d)
        if "residual_perm" in kinds:
            self.Z_res = nn.Parameter(g0.residual.to(F64).clone())  # [D, D]
        if "residual_orth" in kinds:
            self.E_res = zeros(arch.d_model, arch.d_model)

    def param_groups(self) -> list[dict]:
        perm = [p for n, p in self.named_parameters() if n.startswith("Z_")]
        cont = [p for n, p in self.named_parameters() if not n.startswith("Z_")]
        return [g for g in ({"params": perm, "lr": LR["perm"]}, {"params": cont, "lr": LR["map"]}) if g["params"]]

    # one function per class, shared by mats() (differentiable) and element() (hard)

    def _head_perm(self, layer: int) -> Tensor:
        return gqa_assignment(self.Z_heads[layer].detach(), self.rep)

    def _mlp_perm(self, layer: int) -> Tensor:
        return assignment(self.Z_mlp[layer].detach())

    def _scale(self, layer: int) -> Tensor:
        return self.g0.layers[layer].mlp_scale.to(F64) * self.e_scale[layer].exp()

    def _qk(self, layer: int) -> Tensor:
        """A [h_kv, d, d]: GL(d) as A_0 (I + E); RoPE: pair scalars z_0 exp(e_r + i e_phi), GL on the rest."""
        A0, d = self.g0.layers[layer].qk.to(F64), self.arch.d_head
        if not self.rope:
            return A0 @ (torch.eye(d, dtype=F64) + self.E_qk[layer])
        r = self.arch.rotary_dim
        e = self.e_rope[layer]  # [h_kv, r/2, 2]
        z = rope_scalars(A0, self.arch.rope_layout, r) * torch.polar(e[..., 0].exp(), e[..., 1])  # [h_kv, r/2]
        zero, C, S = self.basis
        A = zero + torch.einsum("kj,jde->kde", z.real, C) + torch.einsum("kj,jde->kde", z.imag, S)  # [h_kv, d, d]
        if r < d:  # partial RoPE: the unrotated block is GL(d - r)
            G = A0[:, r:, r:] @ (torch.eye(d - r, dtype=F64) + self.E_qk[layer, :, r:, r:])  # [h_kv, d-r, d-r]
            A = torch.cat([A[:, :r], torch.cat([A[:, r:, :r], G], 2)], 1)  # [h_kv, d, d]
        return A

    def _vo(self, layer: int) -> Tensor:
        return self.g0.layers[layer].vo.to(F64) @ (torch.eye(self.arch.d_head, dtype=F64) + self.E_vo[layer])

    def mats(self) -> tuple[dict[str, dict[str, Tensor]], bool]:
        """Differentiable matrices per group for apply_dense, and whether the residual map is a permutation."""
        out: dict[str, dict[str, Tensor]] = {}
        g, rep = self.arch.n_kv_heads, self.rep
        for layer in range(self.arch.n_layers):
            b = f"blocks.{layer}"
            if "heads" in self.kinds:
                Z, hp = self.Z_heads[layer], self._head_perm(layer)  # [h, h], [h]
                Z_kv = Z.reshape(g, rep, g, rep).sum((1, 3)) / rep  # [h_kv, h_kv] group-to-group scores
                out[f"{b}.heads"] = {"perm": straight_through(perm_matrix(hp), Z),
                                     "perm_kv": straight_through(perm_matrix(hp[::rep] // rep), Z_kv)}
            if "mlp" in self.kinds:
                out[f"{b}.mlp"] = {"perm": straight_through(perm_matrix(self._mlp_perm(layer)), self.Z_mlp[layer])}
            if "mlp_scale" in self.kinds:
                out[f"{b}.mlp_scale"] = {"scale": self._scale(layer)}
            for kind, fn in (("qk", self._qk), ("vo", self._vo)):
                if kind in self.kinds:
                    M = fn(layer)
                    out[f"{b}.{kind}"] = {"right": M, "right_inv_t": torch.linalg.inv(M).mT}
        is_perm = "residual_perm" in self.kinds
        if is_perm:
            O = straight_through(residual_perm_from_scores(self.Z_res.detach()), self.Z_res)
            out["residual"] = {"right": O, "right_inv_t": O}
        elif "residual_orth" in self.kinds:
            O = newton_schulz_polar(self.g0.residual.to(F64) @ (torch.eye(self.arch.d_model, dtype=F64) + self.E_res))
            out["residual"] = {"right": O, "right_inv_t": O}
        return out, is_perm

    @torch.no_grad()
    def element(self) -> GroupElement:
        """The hard, exact group element the latents stand for."""
        layers = []
        for layer, el in enumerate(self.g0.layers):
            k = self.kinds
            layers.append(LayerElement(
                self._head_perm(layer) if "heads" in k else el.head_perm,
                self._qk(layer).clone() if "qk" in k else el.qk,
                self._vo(layer).clone() if "vo" in k else el.vo,
                self._mlp_perm(layer) if "mlp" in k else el.mlp_perm,
                self._scale(layer).clone() if "mlp_scale" in k else el.mlp_scale,
            ))
        O = self.g0.residual.to(F64)
        if "residual_perm" in self.kinds:
            O = residual_perm_from_scores(self.Z_res)
        elif "residual_orth" in self.kinds:
            O = procrustes(O @ (torch.eye(self.arch.d_model, dtype=F64) + self.E_res))  # exact polar factor
        return GroupElement(tuple(layers), O)


# ---------------------------------------------------------------------------------------------
# The optimisation, shared with dual.py


def relative(arch: Arch, g_a: GroupElement | None, g_b: GroupElement) -> GroupElement:
    """g_A^{-1} g_B: what the dual pair does to B seen from A's frame (MATH.md section 4)."""
    return g_b if g_a is None else compose(arch, invert(arch, g_a), g_b)


@torch.no_grad()
def mean_loss(forward: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> float:
    total = 0.0
    for i in range(0, len(x), CHUNK):
        total += float(task_loss(forward(x[i:i + CHUNK]), y[i:i + CHUNK])) * y[i:i + CHUNK].numel()
    return total / y.numel()


def optimise(ctx: AlignContext, g0_b: GroupElement, dual: bool, steps: int) -> dict:
    """Adam on the latents of B's transform (and A's, if dual) on the interpolated task loss.

    Returns the best hard elements seen on the validation batch (midpoint loss of theta_A and
    g_A^{-1} g_B theta_B, the same function as the dual midpoint) and the training history.
    """
    pair, kinds = ctx.pair, ctx.classes
    arch, spec = pair.arch, pair.spec
    tw = twin(pair.model_a)
    xv, yv = val_batch(arch, VAL_ITEMS[arch.task])
    check_twin(pair.model_a, tw, xv[:2])
    ref = next(tw.module.parameters())  # the weights live where the twin runs; the latents on the CPU
    pa = {k: v.detach().to(ref.device, ref.dtype) for k, v in pair.params_a.items()}
    pb = {k: v.detach().to(ref.device, ref.dtype) for k, v in pair.params_b.items()}
    side_b = Transform(arch, spec, kinds, g0_b)
    side_a = Transform(arch, spec, kinds, identity(arch)) if dual else None
    groups = side_b.param_groups() + (side_a.param_groups() if side_a else [])
    opt = torch.optim.Adam(groups) if groups else None
    batches = train_batches(arch, ctx.batch, ctx.seed)
    rng = random.Random(ctx.seed)

    def val_midpoint(g_a: GroupElement | None, g_b: GroupElement) -> float:
        moved = apply(arch, relative(arch, g_a, g_b), pb, strict=False)
        mid = {k: 0.5 * pa[k] + 0.5 * moved[k] for k in pa}
        return mean_loss(lambda x: functional_logits(tw, mid, x), xv, yv)

    def current() -> tuple[GroupElement | None, GroupElement]:
        return (side_a.element() if side_a else None), side_b.element()

    best_val = val_midpoint(*current())
    best, best_step = current(), 0
    history = {"step": [0], "train_loss": [None], "val_midpoint_loss": [best_val]}
    every = max(1, steps // EVALS)
    for step in range(1, steps + 1 if opt else 1):
        x, y = next(batches)
        lam = rng.uniform(*LAMBDA)
        mats_b, perm_b = side_b.mats()
        theta_b = apply_dense(spec, mats_b, pb, perm_b)
        if side_a is not None:
            mats_a, perm_a = side_a.mats()
            theta_a = apply_dense(spec, mats_a, pa, perm_a)
        else:
            theta_a = pa
        mid = {k: (1 - lam) * theta_a[k] + lam * theta_b[k] for k in pa}
        loss = task_loss(functional_logits(tw, mid, x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == steps:
            v = val_midpoint(*current())
            history["step"].append(step)
            history["train_loss"].append(float(loss.detach()))
            history["val_midpoint_loss"].append(v)
            if v < best_val:
                best_val, best, best_step = v, current(), step
            if ctx.progress:
                ctx.progress(step, steps, f"midpoint loss {v:.4f}")
    return {"g_a": best[0], "g_b": best[1], "best_step": best_step, "best_val_midpoint_loss": best_val,
            "history": history, "steps": steps}


def align_learned(ctx: AlignContext) -> AlignOutput:
    """One-sided learned matching from the weight-matching start (registry entry `learned`)."""
    t = tick()
    g0, _ = weight_match(ctx.pair, ctx.classes, ctx.qk_structure)
    t_init = t()
    res = optimise(ctx, g0, dual=False, steps=ctx.steps or DEFAULT_STEPS)
    info = {k: res[k] for k in ("steps", "best_step", "best_val_midpoint_loss", "history")}
    return AlignOutput(res["g_b"], info | {"seconds": t(), "init_seconds": t_init})
