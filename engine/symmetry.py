"""Group actions on canonical Params (MATH.md sections 1-3): identity, sample, apply, invert, compose.

Convention (MATH.md section 1), theta -> g.theta, new index i takes old index sigma(i):

    W_Q^i <- W_Q^{sigma(i)} A_{c(i)}        b_Q^i <- b_Q^{sigma(i)} A_{c(i)}      c(i) = KV group of head i
    W_K^c <- W_K^{tau(c)} A_c^{-T}          b_K^c <- b_K^{tau(c)} A_c^{-T}        tau = induced KV permutation
    W_V^c <- W_V^{tau(c)} B_c               b_V^c <- b_V^{tau(c)} B_c
    W_O^i <- B_{c(i)}^{-1} W_O^{sigma(i)}
    W_in[:, j] <- W_in[:, pi(j)] s_j        W_gate[:, j] <- W_gate[:, pi(j)]      W_out[j] <- W_out[pi(j)] / s_j
    writers W <- W Omega                    readers W <- Omega^T W  (Omega^{-1} W in general)

The per-parameter bookkeeping comes from the spec (engine/spec.py); this file only knows how each
role transforms an axis. A `GroupElement` restricted to some kinds is the identity on the others.

The residual group needs the norms out of the way (MATH.md section 3): `fold_norms` moves RMSNorm
gains into the readers, `layernorm_to_rmsnorm` rewrites a LayerNorm model as an RMSNorm one of the
reference family. Residual permutations need neither: gains and LayerNorm biases are permuted along.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.errors import ModelError, SpecError
from engine.models.base import Arch, Params
from engine.models.reference import RefConfig, rope_pairs
from engine.spec import KINDS, ParamSpec, Spec, build_spec, check_arch

__all__ = [
    "KINDS",
    "GroupElement",
    "LayerElement",
    "act",
    "apply",
    "compose",
    "element_maps",
    "fold_norms",
    "fold_norms_",
    "identity",
    "invert",
    "layer_maps",
    "layernorm_to_rmsnorm",
    "reference_config_from_arch",
    "rope_commutant",
    "sample",
]

# Sampled elements have singular values in [e^-0.5, e^0.5] (condition number <= e): far enough from
# the identity to test anything, close enough that float64 round trips stay at 1e-14.
LOG_SPREAD = 0.5


@dataclass(frozen=True, eq=False)
class LayerElement:
    """One block's part of a group element (MATH.md sections 1 and 2)."""

    head_perm: Tensor  # [h] new query head i takes old head head_perm[i]
    qk: Tensor  # [h_kv, d, d] A per KV group (indexed by the new group)
    vo: Tensor  # [h_kv, d, d] B per KV group
    mlp_perm: Tensor  # [m]
    mlp_scale: Tensor  # [m] s_j of the new neuron j
    kv_perm: Tensor | None = None  # [h_kv], derived from head_perm when not given

    def __post_init__(self) -> None:
        h, hkv = self.head_perm.shape[0], self.qk.shape[0]
        if h % hkv:
            raise SpecError(f"head_perm has {h} heads, not a multiple of the {hkv} KV groups of qk.")
        rep = h // hkv
        if self.kv_perm is None:
            object.__setattr__(self, "kv_perm", self.head_perm[::rep] // rep)  # [h_kv]
        # GQA (MATH.md section 1): the query heads of new group c must all come from old group tau(c)
        if not torch.equal(self.head_perm // rep, self.kv_perm.repeat_interleave(rep)):
            raise SpecError("head_perm moves query heads between KV groups, which is not a symmetry of "
                            "grouped-query attention; permute whole groups and heads within a group.")


@dataclass(frozen=True, eq=False)
class GroupElement:
    layers: tuple[LayerElement, ...]
    residual: Tensor  # [D, D] Omega: orthogonal, a permutation matrix for residual_perm, I if unused


# ---------------------------------------------------------------------------------------------
# Elements: identity and random samples


def identity(arch: Arch, dtype: torch.dtype = torch.float64) -> GroupElement:
    check_arch(arch)
    h, hkv, d, m = arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp
    layers = tuple(
        LayerElement(torch.arange(h), torch.eye(d, dtype=dtype).repeat(hkv, 1, 1),  # [h_kv, d, d]
                     torch.eye(d, dtype=dtype).repeat(hkv, 1, 1), torch.arange(m), torch.ones(m, dtype=dtype))
        for _ in range(arch.n_layers)
    )
    return GroupElement(layers, torch.eye(arch.d_model, dtype=dtype))


def random_orthogonal(n: int, k: int, gen: torch.Generator) -> Tensor:
    """k Haar-random orthogonal n x n matrices: QR of a Gaussian with the sign of diag(R) fixed."""
    Q, R = torch.linalg.qr(torch.randn(k, n, n, generator=gen, dtype=torch.float64))  # [k, n, n]
    return Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[..., None, :]


def random_gl(n: int, k: int, gen: torch.Generator) -> Tensor:
    """k well-conditioned random elements of GL(n): U diag(e^u) V, u ~ U(-0.5, 0.5); both det signs."""
    u = (torch.rand(k, n, generator=gen, dtype=torch.float64) * 2 - 1) * LOG_SPREAD  # [k, n]
    return random_orthogonal(n, k, gen) @ torch.diag_embed(u.exp()) @ random_orthogonal(n, k, gen)  # [k, n, n]


def rope_commutant(z: Tensor, layout: str, d: int) -> Tensor:
    """The Q/K map that multiplies RoPE pair j by the complex scalar z_j (MATH.md section 1).

    z [..., r/2] complex -> A [..., d, d] real: on pair (i1_j, i2_j) of reference.rope_pairs(r, layout)
    the block a_j I + b_j J (row-vector form [[a, b], [-b, a]]), so q A scales and rotates the pair as
    z_j q_j and k A^{-T} as k_j / conj(z_j); both commute with every RoPE rotation. The d - r
    dimensions RoPE leaves alone get the identity; put a GL(d - r) block there for partial RoPE.
    """
    r = 2 * z.shape[-1]
    if r > d:
        raise SpecError(f"{r // 2} RoPE pairs do not fit in a head of dimension {d}.")
    i1, i2 = rope_pairs(r, layout)
    a, b = z.real, z.imag  # [..., r/2]
    A = torch.eye(d, dtype=a.dtype).repeat(*z.shape[:-1], 1, 1)  # [..., d, d]
    A[..., i1, i1], A[..., i1, i2] = a, b
    A[..., i2, i1], A[..., i2, i2] = -b, a
    return A


def _sample_qk(arch: Arch, gen: torch.Generator) -> Tensor:
    """A per KV group: GL(d) without RoPE, H(r) x GL(d - r) with it (MATH.md section 1 table)."""
    hkv, d = arch.n_kv_heads, arch.d_head
    if arch.pe != "rope":
        return random_gl(d, hkv, gen)
    r = arch.rotary_dim
    mod = ((torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * LOG_SPREAD).exp()  # [h_kv, r/2]
    phase = (torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * torch.pi  # [h_kv, r/2]
    A = rope_commutant(torch.polar(mod, phase), arch.rope_layout, d)  # [h_kv, d, d]
    if r < d:
        A[:, r:, r:] = random_gl(d - r, hkv, gen)
    return A


def _sample_head_perm(h: int, hkv: int, gen: torch.Generator) -> Tensor:
    """Permute the KV groups, then the query heads within each group (MATH.md section 1, GQA)."""
    rep = h // hkv
    groups = torch.randperm(hkv, generator=gen)  # [h_kv]
    within = torch.stack([torch.randperm(rep, generator=gen) for _ in range(hkv)])  # [h_kv, rep]
    return (groups[:, None] * rep + within).reshape(h)  # [h]


def _check_kinds(kinds: Iterable[str]) -> frozenset[str]:
    if isinstance(kinds, str):
        kinds = (kinds,)
    kinds = frozenset(kinds)
    unknown = kinds - set(KINDS)
    if unknown:
        raise SpecError(f"Unknown symmetry kind(s) {sorted(unknown)}; the kinds are {', '.join(KINDS)}.")
    return kinds


def sample(arch: Arch, kinds: Iterable[str] = KINDS, seed: int = 0, dtype: torch.dtype = torch.float64) -> GroupElement:
    """A random group element, seeded, restricted to `kinds`; kinds the arch lacks stay the identity.

    Permutations are uniform; GL, RoPE-commutant and scaling parts have singular values / moduli in
    [e^-0.5, e^0.5]; SwiGLU up-branch scales get random signs; residual_orth is Haar on O(D) (it
    contains residual_perm, so asking for both gives a rotation).
    """
    kinds = _check_kinds(kinds)
    check_arch(arch)
    gen = torch.Generator().manual_seed(int(seed))
    base = identity(arch, torch.float64)
    h, hkv, m = arch.n_heads, arch.n_kv_heads, arch.d_mlp
    layers = []
    for el in base.layers:
        head_perm = _sample_head_perm(h, hkv, gen) if "heads" in kinds else el.head_perm
        qk = _sample_qk(arch, gen) if "qk" in kinds else el.qk
        vo = random_gl(arch.d_head, hkv, gen) if "vo" in kinds else el.vo
        mlp_perm = torch.randperm(m, generator=gen) if "mlp" in kinds else el.mlp_perm
        scale = el.mlp_scale
        if "mlp_scale" in kinds and arch.mlp in ("relu", "swiglu"):
            scale = ((torch.rand(m, generator=gen, dtype=torch.float64) * 2 - 1) * LOG_SPREAD).exp()  # [m]
            if arch.mlp == "swiglu":  # MATH.md section 2: any nonzero scale on the up branch
                scale = scale * (torch.randint(0, 2, (m,), generator=gen) * 2 - 1)
        layers.append(LayerElement(head_perm, qk.to(dtype), vo.to(dtype), mlp_perm, scale.to(dtype)))
    residual = base.residual
    if "residual_orth" in kinds:
        residual = random_orthogonal(arch.d_model, 1, gen)[0]
    elif "residual_perm" in kinds:
        residual = torch.eye(arch.d_model, dtype=torch.float64)[torch.randperm(arch.d_model, generator=gen)]
    return GroupElement(tuple(layers), residual.to(dtype))


# ---------------------------------------------------------------------------------------------
# Checks: shapes always, group membership when strict


def _check_shapes(arch: Arch, g: GroupElement) -> None:
    h, hkv, d, m, D = arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp, arch.d_model
    if len(g.layers) != arch.n_layers:
        raise SpecError(f"The group element has {len(g.layers)} layers but the model has {arch.n_layers}.")
    want = {"head_perm": (h,), "kv_perm": (hkv,), "qk": (hkv, d, d), "vo": (hkv, d, d), "mlp_perm": (m,),
            "mlp_scale": (m,)}
    for i, el in enumerate(g.layers):
        for name, shape in want.items():
            got = tuple(getattr(el, name).shape)
            if got != shape:
                raise SpecError(f"Layer {i} of the group element has {name} of shape {list(got)}, "
                                f"the model needs {list(shape)}.")
    if tuple(g.residual.shape) != (D, D):
        raise SpecError(f"The residual map has shape {list(g.residual.shape)}, the model needs [{D}, {D}].")


def _is_perm(p: Tensor, n: int) -> bool:
    return p.shape == (n,) and torch.equal(torch.sort(p).values, torch.arange(n, device=p.device))


def _is_perm_matrix(M: Tensor) -> bool:
    return bool(((M == 0) | (M == 1)).all()) and bool((M.sum(0) == 1).all()) and bool((M.sum(1) == 1).all())


def rope_commutant_part(A: Tensor, layout: str, r: int) -> Tensor:
    """The projection of A [..., d, d] onto H(r) x GL(d - r): what of A a RoPE model keeps."""
    i1, i2 = rope_pairs(r, layout)
    z = torch.complex((A[..., i1, i1] + A[..., i2, i2]) / 2, (A[..., i1, i2] - A[..., i2, i1]) / 2)  # [..., r/2]
    P = rope_commutant(z, layout, A.shape[-1])  # [..., d, d]
    P[..., r:, r:] = A[..., r:, r:]
    return P


def _check_membership(spec: Spec, g: GroupElement) -> None:
    arch, tol = spec.arch, 1e-9
    for i, el in enumerate(g.layers):
        if not _is_perm(el.head_perm, arch.n_heads) or not _is_perm(el.mlp_perm, arch.d_mlp):
            raise SpecError(f"Layer {i} of the group element has a head or neuron permutation that is not "
                            "a permutation.")
        for name in ("qk", "vo"):
            M = getattr(el, name)
            if not bool(torch.isfinite(torch.linalg.cond(M)).all()) or float(torch.linalg.cond(M).max()) > 1e12:
                raise SpecError(f"Layer {i}: the {name} map is singular, not an element of GL({arch.d_head}).")
        if arch.pe == "rope":
            A = el.qk
            off = (A - rope_commutant_part(A, arch.rope_layout, arch.rotary_dim)).abs().max()
            if float(off) > tol * float(A.abs().max()):
                raise SpecError(f"Layer {i}: the qk map does not commute with the {arch.rope_layout} RoPE rotations "
                                "(it must be one complex scalar per frequency pair, MATH.md section 1).")
        s = el.mlp_scale
        if arch.mlp == "relu" and not bool((s > 0).all()):
            raise SpecError(f"Layer {i}: ReLU neurons only allow positive scales (MATH.md section 2).")
        if arch.mlp == "swiglu" and not bool((s != 0).all()):
            raise SpecError(f"Layer {i}: SwiGLU up-branch scales must be nonzero.")
        if arch.mlp not in ("relu", "swiglu") and not bool(((s - 1).abs() <= tol).all()):
            raise SpecError(f"Layer {i}: a {arch.mlp} MLP has no neuron scaling symmetry (MATH.md section 2).")
    O = g.residual.to(torch.float64)
    if float((O.T @ O - torch.eye(O.shape[0], dtype=O.dtype)).abs().max()) > tol:
        raise SpecError("The residual map is not orthogonal; only O(D) preserves the norms (MATH.md section 3).")
    if not _is_perm_matrix(O) and "residual_orth" in spec.requires:
        raise SpecError(f"A residual rotation cannot be applied yet: {spec.requires['residual_orth']}.")


# ---------------------------------------------------------------------------------------------
# The action


def _right(x: Tensor, axis: int, M: Tensor, by_axis: int | None, per: int) -> Tensor:
    """x <- x M along `axis`; M [s, s], or a stack [n, s, s] indexed by by_axis // per."""
    M = M.to(x.device)
    if by_axis is None:
        return (x.movedim(axis, -1) @ M).movedim(-1, axis)
    Ms = M[torch.arange(x.shape[by_axis], device=x.device) // per]  # [size(by_axis), s, s]
    y = x.movedim((by_axis, axis), (0, -1))  # [size(by_axis), ..., s]
    y = torch.einsum("i...s,ist->i...t", y, Ms)  # [size(by_axis), ..., s]
    return y.movedim((0, -1), (by_axis, axis))


def _along(v: Tensor, x: Tensor, axis: int) -> Tensor:
    shape = [1] * x.dim()
    shape[axis] = -1
    return v.to(x.device).reshape(shape)  # broadcastable along `axis`


def element_maps(g: GroupElement) -> dict[str, dict[str, Tensor] | None]:
    """What `act` needs of g, per group name; identity parts are None (a restricted element then costs
    only what it moves). Permutations stay index vectors; maps and their inverses are float64."""
    wide = torch.float64
    O = g.residual.to(wide)
    eye = torch.eye(O.shape[0], dtype=wide, device=O.device)
    if torch.equal(O, eye):
        res = None
    elif _is_perm_matrix(O):  # x Omega for a permutation matrix is an index: column j of the result is column argmax_i O_ij
        res = {"index": O.argmax(0)}
    else:
        res = {"right": O, "right_inv_t": torch.linalg.inv(O).mT}
    mats: dict[str, dict[str, Tensor] | None] = {"residual": res}
    for i, el in enumerate(g.layers):
        mats |= layer_maps(i, el)
    return mats


def layer_maps(layer: int, el: LayerElement) -> dict[str, dict[str, Tensor] | None]:
    """`element_maps` of one block's part of an element."""
    b, wide = f"blocks.{layer}", torch.float64
    A, B = el.qk.to(wide), el.vo.to(wide)
    eye_d = torch.eye(A.shape[-1], dtype=wide, device=A.device).expand_as(A)  # [h_kv, d, d]
    hp, mp, sc = el.head_perm, el.mlp_perm, el.mlp_scale.to(wide)
    return {
        f"{b}.qk": None if torch.equal(A, eye_d) else {"right": A, "right_inv_t": torch.linalg.inv(A).mT},
        f"{b}.vo": None if torch.equal(B, eye_d) else {"right": B, "right_inv_t": torch.linalg.inv(B).mT},
        f"{b}.heads": None if torch.equal(hp, torch.arange(len(hp), device=hp.device)) else {
            "perm": hp, "perm_kv": el.kv_perm},
        f"{b}.mlp": None if torch.equal(mp, torch.arange(len(mp), device=mp.device)) else {"perm": mp},
        f"{b}.mlp_scale": None if bool((sc == 1).all()) else {"scale": sc},
    }


def act(ps: ParamSpec, mats: dict[str, dict[str, Tensor] | None], x: Tensor) -> Tensor:
    """One parameter moved by the element whose `element_maps` are `mats`, computed in x's dtype.

    Groups absent from `mats` act as the identity, so a caller can move one layer, or apply the
    residual map alone, without building the rest of the element.
    """
    # permutations first: the matrices and scales are indexed by the new (permuted) index
    for axis, acts in enumerate(ps.axes):
        for a in acts:
            m = mats.get(a.group)
            if a.role in ("perm", "perm_kv") and m is not None:
                x = x.index_select(axis, m[a.role].to(x.device))
    for axis, acts in enumerate(ps.axes):
        for a in acts:
            m = mats.get(a.group)
            if m is None:
                continue
            if "index" in m:  # residual permutation: writers, readers (Omega^{-T} = Omega), norms
                x = x.index_select(axis, m["index"].to(x.device))
            elif a.role in ("right", "right_inv_t"):
                x = _right(x, axis, m[a.role].to(x.dtype), a.by_axis, a.per)
            elif a.role == "scale":
                x = x * _along(m["scale"].to(x.dtype), x, axis)
            elif a.role == "inv_scale":
                x = x / _along(m["scale"].to(x.dtype), x, axis)
            # a folded gain (all ones) is invariant under rotations; strict mode checked it is folded
    return x


def apply(arch: Arch, g: GroupElement, params: Params, strict: bool = True) -> Params:
    """g.theta as a new dict (MATH.md sections 1-3), each parameter computed in float64 at least.

    strict=True checks that g lies in this architecture's group (RoPE commutant, scale signs, an
    orthogonal residual map, norms folded for rotations) and raises SpecError otherwise; the break
    tests pass strict=False to apply maps from larger groups on purpose.
    """
    spec = build_spec(arch, params)
    _check_shapes(arch, g)
    if strict:
        _check_membership(spec, g)
    mats = element_maps(g)
    out: Params = {}
    for key, ps in spec.params.items():
        x0 = params[key]
        out[key] = act(ps, mats, x0.to(torch.promote_types(x0.dtype, torch.float64))).to(x0.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Group operations


def invert(arch: Arch, g: GroupElement) -> GroupElement:
    """g^{-1}: sigma^{-1}, A^{-1}_{tau^{-1}(c)}, pi^{-1}, 1 / s_{pi^{-1}(j)}, Omega^T."""
    _check_shapes(arch, g)
    layers = []
    for el in g.layers:
        hp, kv, mp = torch.argsort(el.head_perm), torch.argsort(el.kv_perm), torch.argsort(el.mlp_perm)
        layers.append(LayerElement(hp, torch.linalg.inv(el.qk[kv]), torch.linalg.inv(el.vo[kv]), mp,
                                   1 / el.mlp_scale[mp], kv_perm=kv))
    O = g.residual
    return GroupElement(tuple(layers), O.mT.clone() if _is_orth(O) else torch.linalg.inv(O))


def _is_orth(O: Tensor) -> bool:
    O64 = O.to(torch.float64)
    return float((O64.T @ O64 - torch.eye(O.shape[0], dtype=torch.float64)).abs().max()) < 1e-12


def compose(arch: Arch, g: GroupElement, h: GroupElement) -> GroupElement:
    """g o h, so that apply(compose(g, h), theta) == apply(g, apply(h, theta)).

    With theta' = h.theta: W''^i = W'^{sigma_g(i)} A^g_i = W^{sigma_h(sigma_g(i))} A^h_{sigma_g(i)} A^g_i,
    hence sigma = sigma_h[sigma_g], A_c = A^h_{tau_g(c)} A^g_c, s = s_h[pi_g] s_g, Omega = Omega_h Omega_g.
    """
    _check_shapes(arch, g)
    _check_shapes(arch, h)
    layers = []
    for eg, eh in zip(g.layers, h.layers):
        layers.append(LayerElement(
            eh.head_perm[eg.head_perm], eh.qk[eg.kv_perm] @ eg.qk, eh.vo[eg.kv_perm] @ eg.vo,
            eh.mlp_perm[eg.mlp_perm], eh.mlp_scale[eg.mlp_perm] * eg.mlp_scale, kv_perm=eh.kv_perm[eg.kv_perm],
        ))
    return GroupElement(tuple(layers), h.residual @ g.residual)


# ---------------------------------------------------------------------------------------------
# Norm folding (MATH.md section 3)


def _readers(arch: Arch, norm: str, layer: int | None) -> list[tuple[str, str | None, str]]:
    """(weight, its bias or None, contraction) of every reader that follows a norm."""
    if norm == "norm_f":
        return [("head.W", "head.b", "D,Dn->n")]
    b = f"blocks.{layer}"
    if norm == "norm1":
        return [(f"{b}.attn.W_{x}", f"{b}.attn.b_{x}", "D,hDd->hd") for x in "QKV"]
    rs = [(f"{b}.mlp.W_in", f"{b}.mlp.b_in", "D,Dm->m")]
    if arch.mlp == "swiglu":
        rs.append((f"{b}.mlp.W_gate", None, "D,Dm->m"))  # the gate has no bias in the canonical layout
    return rs


def _norms(arch: Arch) -> list[tuple[str, int | None]]:
    return [(f"blocks.{i}.{n}", i) for i in range(arch.n_layers) for n in ("norm1", "norm2")] + [("norm_f", None)]


def _fold_gain(W: Tensor, g: Tensor) -> Tensor:
    """diag(g) W on the residual (input) axis of a reader: axis 0 of [D, n], axis 1 of [h, D, d]."""
    return W * g[:, None] if W.dim() == 2 else W * g[None, :, None]


def fold_norms(arch: Arch, params: Params) -> tuple[Arch, Params]:
    """Move every RMSNorm gain into the readers after it; all gains become 1 (MATH.md section 3).

    RMSNorm(x) W = (x / rms(x)) diag(g) W, so the readers absorb diag(g) exactly. Tied embeddings are
    untied when the final gain is not all ones (the unembedding becomes diag(g) E^T while E, a writer,
    stays); the returned Arch then belongs to the reference family, whose module can hold the untied
    head. Otherwise the family is unchanged and the Params fit the original model.
    """
    if arch.norm != "rmsnorm":
        raise SpecError(f"fold_norms folds RMSNorm gains, but this model uses {arch.norm}; "
                        "call layernorm_to_rmsnorm instead.")
    build_spec(arch, params)
    p = {k: v.clone() for k, v in params.items()}
    g_f = params["norm_f.g"]
    untie = arch.tied_embeddings and not bool((g_f == 1).all())
    if untie:
        p["head.W"] = params["embed.tok"].T.clone()  # [D, V]
    for name, layer in _norms(arch):
        g = params[f"{name}.g"]
        for W, _, _ in _readers(arch, name.split(".")[-1], layer):
            if W in p:
                p[W] = _fold_gain(p[W], g)
        p[f"{name}.g"] = torch.ones_like(g)
    new = replace(arch, tied_embeddings=False, family="reference") if untie else arch
    return new, p


@torch.no_grad()
def fold_norms_(arch: Arch, params: Params) -> None:
    """fold_norms written into `params` themselves (views of a model: no copy is made).

    Only where fold_norms keeps the Arch: RMSNorm, and no tied embedding to untie.
    """
    if arch.norm != "rmsnorm" or (arch.tied_embeddings and not bool((params["norm_f.g"] == 1).all())):
        raise SpecError("Norm gains can be folded in place only into an RMSNorm model without a tied "
                        "embedding to untie; use fold_norms.")
    for name, layer in _norms(arch):
        g = params[f"{name}.g"]
        for W, _, _ in _readers(arch, name.split(".")[-1], layer):
            if W in params:
                params[W].copy_(_fold_gain(params[W], g))
        g.fill_(1)


def layernorm_to_rmsnorm(arch: Arch, params: Params) -> tuple[Arch, Params]:
    """Rewrite a LayerNorm model as an RMSNorm model of the reference family (MATH.md section 3).

    Every writer is centred (W <- W (I - 11^T/D)), so the residual stream has zero mean and
    LayerNorm(x) = RMSNorm(x) with the same eps; the gain is folded into the readers (diag(g) W) and
    the bias beta into the readers' biases (b_W <- b_W + beta W), which are created, zero, where the
    model had none. All gains become 1. Tied embeddings are untied unless the final norm has gain 1
    (then C E^T serves as the unembedding, since the readers only see centred vectors, and beta E^T
    goes into the head bias).
    Fixed sinusoidal PE cannot be centred (it is not a parameter), so such a model is refused, as is a
    SwiGLU model with a LayerNorm bias (its gate branch has no bias to absorb beta).
    """
    if arch.norm != "layernorm":
        raise SpecError(f"layernorm_to_rmsnorm rewrites LayerNorm models, but this model uses {arch.norm}; "
                        "call fold_norms instead.")
    if arch.pe == "sinusoidal":
        raise SpecError("A LayerNorm model with fixed sinusoidal PE cannot be rewritten as RMSNorm: the "
                        "sinusoidal table is a residual writer whose rows are not centred and cannot be changed.")
    build_spec(arch, params)
    D = arch.d_model
    p = {k: v.clone() for k, v in params.items()}
    beta = {name: params.get(f"{name}.b") for name, _ in _norms(arch)}
    if arch.mlp == "swiglu" and any(b is not None and bool((b != 0).any()) for n, b in beta.items() if "norm2" in n):
        raise SpecError("A SwiGLU model with a LayerNorm bias cannot be rewritten: the gate branch has no bias "
                        "to absorb it.")
    bias = arch.attn_bias or arch.out_bias or arch.mlp_bias or arch.norm_bias
    g_f, b_f = params["norm_f.g"], beta["norm_f"]
    keep_tied = arch.tied_embeddings and bool((g_f == 1).all())
    untie = arch.tied_embeddings and not keep_tied
    head_bias = arch.head_bias or b_f is not None
    if untie:
        p["head.W"] = params["embed.tok"].T.clone()  # [D, V] before centring: the reader sees E^T
    if bias:  # the reference family has all of these biases or none; absent ones are zero
        ref = params["norm_f.g"]
        dt, dev = ref.dtype, ref.device
        h, hkv, d, m = arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp
        for i in range(arch.n_layers):
            b = f"blocks.{i}"
            for k, shape in ((f"{b}.attn.b_Q", (h, d)), (f"{b}.attn.b_K", (hkv, d)), (f"{b}.attn.b_V", (hkv, d)),
                             (f"{b}.attn.b_O", (D,)), (f"{b}.mlp.b_in", (m,)), (f"{b}.mlp.b_out", (D,))):
                p.setdefault(k, torch.zeros(shape, dtype=dt, device=dev))
    if head_bias:
        g_f = params["norm_f.g"]
        p.setdefault("head.b", torch.zeros(arch.n_out, dtype=g_f.dtype, device=g_f.device))

    # readers: gain into the weight, beta into the bias (using the weight before the gain)
    for name, layer in _norms(arch):
        g, b = params[f"{name}.g"], beta[name]
        for W, bW, eq in _readers(arch, name.split(".")[-1], layer):
            tied = W not in p  # kept tied: the unembedding is the centred embedding itself (gain 1)
            if b is not None and bW is not None:
                p[bW] = p[bW] + torch.einsum(eq, b, params["embed.tok"].T if tied else p[W])
            if not tied:
                p[W] = _fold_gain(p[W], g)
        p[f"{name}.g"] = torch.ones_like(g)
        p.pop(f"{name}.b", None)

    # writers: centre along D, x (I - 11^T/D)
    writers = ["embed.tok", "embed.pos", "embed.patch.W", "embed.patch.b", "embed.cls"]
    for i in range(arch.n_layers):
        writers += [f"blocks.{i}.attn.W_O", f"blocks.{i}.attn.b_O", f"blocks.{i}.mlp.W_out", f"blocks.{i}.mlp.b_out"]
    for k in writers:
        if k in p:
            p[k] = p[k] - p[k].mean(-1, keepdim=True)  # [..., D] every writer's D axis is last
    new = replace(arch, family="reference", norm="rmsnorm", norm_bias=False, attn_bias=bias, out_bias=bias,
                  mlp_bias=bias, head_bias=head_bias, tied_embeddings=keep_tied)
    build_spec(new, p)
    return new, p


def reference_config_from_arch(arch: Arch, *, in_chans: int | None = None, patch_size: int | None = None,
                               image_size: int | None = None, patch_dim: int | None = None) -> RefConfig:
    """The reference-family config whose module computes the same function as `arch` describes.

    A ViT's image geometry is not part of an Arch: give in_chans / patch_size / image_size, or the
    patch dimension P = C p^2 (the rows of embed.patch.W), from which C in (3, 1) and p are inferred.
    Raises SpecError if the reference family cannot express the architecture (mixed bias flags, ...).
    """
    check_arch(arch)
    a = arch
    bias = a.attn_bias
    if not (a.out_bias == bias and a.mlp_bias == bias and a.norm_bias == (bias and a.norm == "layernorm")):
        raise SpecError("The reference family has all attention, MLP and LayerNorm biases or none; "
                        f"this {a.family} architecture mixes them.")
    if a.causal != (a.task == "lm"):
        raise SpecError(f"The reference family's {a.task} is {'' if a.task == 'lm' else 'not '}causal, "
                        "unlike this model.")
    kw: dict = {
        "task": a.task, "n_layers": a.n_layers, "d_model": a.d_model, "n_heads": a.n_heads,
        "n_kv_heads": a.n_kv_heads, "d_head": a.d_head, "d_mlp": a.d_mlp, "pe": a.pe,
        "rope_layout": a.rope_layout or "interleaved", "rotary_dim": a.rotary_dim, "rope_base": a.rope_base,
        "norm": a.norm, "norm_eps": a.norm_eps, "mlp": a.mlp, "bias": bias, "head_bias": a.head_bias,
        "tied_embeddings": a.tied_embeddings, "parallel_residual": a.parallel_residual,
    }
    if a.task == "lm":
        kw.update(vocab_size=a.n_out, n_ctx=a.n_ctx)
    else:
        n_side = round((a.n_ctx - 1) ** 0.5)
        if n_side * n_side != a.n_ctx - 1:
            raise SpecError(f"A ViT context of {a.n_ctx} is not a square grid of patches plus a class token.")
        if patch_size is None and image_size is not None:
            patch_size = image_size // n_side
        if patch_size is None or in_chans is None:
            if patch_dim is None:
                raise SpecError("A ViT's image geometry is not in its Arch; give in_chans and patch_size, "
                                "or patch_dim.")
            for c in ([in_chans] if in_chans else [3, 1]):
                p = round((patch_dim / c) ** 0.5)
                if c * p * p == patch_dim and (patch_size is None or p == patch_size):
                    in_chans, patch_size = c, p
                    break
            else:
                raise SpecError(f"Patch dimension {patch_dim} is not C p^2 for C in (3, 1).")
        kw.update(n_classes=a.n_out, in_chans=in_chans, patch_size=patch_size, image_size=patch_size * n_side)
    try:
        cfg = RefConfig(**kw)
    except ModelError as e:
        raise SpecError(f"The reference family cannot express this architecture: {e}") from None
    why = cfg.arch().mismatch(replace(a, family="reference"))
    if why:
        raise SpecError(f"The reference family cannot express this architecture: {why}.")
    return cfg
