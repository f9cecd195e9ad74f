"""Group elements and their actions on canonical Params (docs/MATH.md sections 1-3): identity, sample,
apply, invert, compose, membership.

Convention (docs/MATH.md, notation and section 1), theta -> g.theta, new index i takes old index sigma(i):

    W_Q^i <- W_Q^{sigma(i)} A_{c(i)}        b_Q^i <- b_Q^{sigma(i)} A_{c(i)}      c(i) = KV group of head i
    W_K^c <- W_K^{tau(c)} A_c^{-T}          b_K^c <- b_K^{tau(c)} A_c^{-T}        tau = induced KV permutation
    W_V^c <- W_V^{tau(c)} B_c               b_V^c <- b_V^{tau(c)} B_c
    W_O^i <- B_{c(i)}^{-1} W_O^{sigma(i)}
    W_in[:, j] <- W_in[:, pi(j)] s_j        W_gate[:, j] <- W_gate[:, pi(j)]      W_out[j] <- W_out[pi(j)] / s_j
    writers W <- W Omega                    readers W <- Omega^T W  (Omega^{-1} W in general)

QK-norm (docs/MATH.md section 1): A_c is a scaled signed permutation in the RoPE commutant, with the same
|A_c| in every KV group; W_Q, b_Q, W_K, b_K move by sign(A_c) and the q / k norm gains by |A| and |A^{-T}|.

The per-parameter bookkeeping comes from the spec (engine/spec.py); this file alone knows how each
role transforms an axis (`act`, the one interpreter of a spec, with permutations as hard gathers or, for
learned matching, straight-through ones). A `GroupElement` restricted to some kinds is the identity on
the others.

Residual rotations need the norms out of the way first (docs/MATH.md section 3; engine/surgery.py does
that). Residual permutations do not: gains and LayerNorm biases are permuted along.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.errors import SpecError
from engine.models.base import SCALED_MLPS, Arch, Params
from engine.models.reference import rope_pairs
from engine.spec import KINDS, ParamSpec, Spec, build_spec, check_arch

__all__ = [
    "KINDS",
    "GroupElement",
    "LayerElement",
    "act",
    "apply",
    "compose",
    "element_maps",
    "gather",
    "identity",
    "invert",
    "layer_maps",
    "qk_norm_part",
    "rope_commutant",
    "sample",
]

MAP_ROLES = ("right", "right_inv_t", "right_sign", "right_abs", "right_inv_t_abs")  # x <- x M, M by role

# Sampled elements have singular values in [e^-0.5, e^0.5] (condition number <= e): far enough from
# the identity to test anything, close enough that float64 round trips stay at 1e-14.
LOG_SPREAD = 0.5


@dataclass(frozen=True, eq=False)
class LayerElement:
    """One block's part of a group element (docs/MATH.md sections 1 and 2)."""

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
        # GQA (docs/MATH.md section 1): the query heads of new group c must all come from old group tau(c)
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
    """The Q/K map that multiplies RoPE pair j by the complex scalar z_j (docs/MATH.md section 1).

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
    """A per KV group: GL(d) without RoPE, H(r) x GL(d - r) with it; with QK-norm pair scalars
    z_cj = s_cj m_j i^(k_j), a sign per KV group and pair, a modulus and a quarter turn per pair (docs/MATH.md
    section 1)."""
    hkv, d = arch.n_kv_heads, arch.d_head
    if arch.pe != "rope":
        return random_gl(d, hkv, gen)
    r = arch.rotary_dim
    if arch.qk_norm:
        mod = ((torch.rand(r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * LOG_SPREAD).exp()  # [r/2]
        turn = torch.randint(0, 4, (r // 2,), generator=gen)  # [r/2] quarter turns, the same in every KV group
        flip = torch.randint(0, 2, (hkv, r // 2), generator=gen)  # [h_kv, r/2] a half turn per KV group
        z = torch.polar(mod.expand(hkv, -1), (turn + 2 * flip).to(torch.float64) * (torch.pi / 2))  # [h_kv, r/2]
        return _clean_quarter_turns(rope_commutant(z, arch.rope_layout, d))  # [h_kv, d, d]
    mod = ((torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * LOG_SPREAD).exp()  # [h_kv, r/2]
    phase = (torch.rand(hkv, r // 2, generator=gen, dtype=torch.float64) * 2 - 1) * torch.pi  # [h_kv, r/2]
    A = rope_commutant(torch.polar(mod, phase), arch.rope_layout, d)  # [h_kv, d, d]
    if r < d:
        A[:, r:, r:] = random_gl(d - r, hkv, gen)
    return A


def _sample_head_perm(h: int, hkv: int, gen: torch.Generator) -> Tensor:
    """Permute the KV groups, then the query heads within each group (docs/MATH.md section 1, GQA)."""
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
        if "mlp_scale" in kinds and arch.mlp in SCALED_MLPS:
            scale = ((torch.rand(m, generator=gen, dtype=torch.float64) * 2 - 1) * LOG_SPREAD).exp()  # [m]
            if arch.gated:  # docs/MATH.md section 2: any nonzero scale on the up branch
                scale = scale * (torch.randint(0, 2, (m,), generator=gen) * 2 - 1)
        layers.append(LayerElement(head_perm, qk.to(dtype), vo.to(dtype), mlp_perm, scale.to(dtype)))
    residual = base.residual
    if "residual_orth" in kinds and not arch.post_norm:  # docs/MATH.md section 9: a post-norm stream has no rotations
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


def _clean_quarter_turns(A: Tensor) -> Tensor:
    """cos and sin of multiples of pi/2 are 0 only up to 6e-17: make those entries exactly 0 (a monomial A)."""
    return torch.where(A.abs() > 1e-12 * A.abs().amax((-2, -1), keepdim=True), A, torch.zeros_like(A))


def monomial_mask(A: Tensor, tol: float = 1e-9) -> Tensor:
    """Entries of A [..., d, d] above tol times the largest of their matrix: where a monomial A is nonzero."""
    return A.abs() > tol * A.abs().amax((-2, -1), keepdim=True)


def qk_norm_part(A: Tensor, inv_t: Tensor | None = None) -> dict[str, Tensor]:
    """What a QK-norm model takes of its Q/K map A [h_kv, d, d] (docs/MATH.md section 1, QK-norm): W_Q and
    W_K move by sign(A), a signed permutation per KV group, the q_norm gain by |A| and the k_norm gain by
    |A^{-T}| (`inv_t`, computed when not given), both read from KV group 0 (the group holds the same |A| in
    every KV group). Differentiable in A."""
    mask = monomial_mask(A.detach())
    inv_t = torch.linalg.inv(A).mT if inv_t is None else inv_t  # [h_kv, d, d]
    return {"right_sign": torch.where(mask, A.detach().sign(), 0.0), "right_abs": A[0].abs() * mask[0],
            "right_inv_t_abs": inv_t[0].abs() * mask[0]}


def rope_commutant_part(A: Tensor, layout: str, r: int) -> Tensor:
    """The projection of A [..., d, d] onto H(r) x GL(d - r): what of A a RoPE model keeps."""
    i1, i2 = rope_pairs(r, layout)
    z = torch.complex((A[..., i1, i1] + A[..., i2, i2]) / 2, (A[..., i1, i2] - A[..., i2, i1]) / 2)  # [..., r/2]
    P = rope_commutant(z, layout, A.shape[-1])  # [..., d, d]
    P[..., r:, r:] = A[..., r:, r:]
    return P


def _is_qk_norm_map(A: Tensor, tol: float) -> bool:
    """A [h_kv, d, d] (already in the RoPE commutant) is monomial, with the same |A| in every KV group."""
    mask = monomial_mask(A, tol)
    P = A.abs() * mask  # [h_kv, d, d]
    one_per_row = bool((mask.sum(-1) == 1).all()) and bool((mask.sum(-2) == 1).all())
    small = float((A.abs() * ~mask).max()) <= tol * float(A.abs().max())
    return one_per_row and small and float((P - P[:1]).abs().max()) <= tol * float(P.max())


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
                                "(it must be one complex scalar per frequency pair, docs/MATH.md section 1).")
        if arch.qk_norm and not _is_qk_norm_map(el.qk.to(torch.float64), tol):
            raise SpecError(f"Layer {i}: under QK-norm the qk map must scale and turn each RoPE pair by a positive "
                            "multiple of 1, i, -1 or -i, with the same modulus and quarter turn in every KV group "
                            "(docs/MATH.md section 1, QK-norm).")
        s = el.mlp_scale
        if arch.mlp == "relu" and not bool((s > 0).all()):
            raise SpecError(f"Layer {i}: ReLU neurons only allow positive scales (docs/MATH.md section 2).")
        if arch.gated and not bool((s != 0).all()):
            raise SpecError(f"Layer {i}: {arch.mlp} up-branch scales must be nonzero.")
        if arch.mlp not in SCALED_MLPS and not bool(((s - 1).abs() <= tol).all()):
            raise SpecError(f"Layer {i}: a {arch.mlp} MLP has no neuron scaling symmetry (docs/MATH.md section 2).")
    O = g.residual.to(torch.float64)
    if float((O.T @ O - torch.eye(O.shape[0], dtype=O.dtype)).abs().max()) > tol:
        raise SpecError("The residual map is not orthogonal; only O(D) preserves the norms (docs/MATH.md section 3).")
    if not _is_perm_matrix(O) and "residual_orth" in spec.requires:
        raise SpecError(f"A residual rotation cannot be applied yet: {spec.requires['residual_orth']}.")
    _check_post_norm_residual(spec, O)


def _check_post_norm_residual(spec: Spec, O: Tensor) -> None:
    """A post-norm stream allows permutations only (docs/MATH.md section 9)."""
    if spec.arch.post_norm and not _is_perm_matrix(O):
        raise SpecError("The residual map is not a permutation; a post-LayerNorm encoder's stream is normalised "
                        "after every add, and only permutations commute with that (docs/MATH.md section 9).")


# ---------------------------------------------------------------------------------------------
# The action


def _right(x: Tensor, axis: int, M: Tensor, by_axis: int | None, per: int) -> Tensor:
    """x <- x M along `axis`; M [s, s], or a stack [n, s, s] indexed by by_axis // per (M on x's device)."""
    if by_axis is None:
        return (x.movedim(axis, -1) @ M).movedim(-1, axis)
    Ms = M[torch.arange(x.shape[by_axis], device=x.device) // per]  # [size(by_axis), s, s]
    y = x.movedim((by_axis, axis), (0, -1))  # [size(by_axis), ..., s]
    y = torch.einsum("i...s,ist->i...t", y, Ms)  # [size(by_axis), ..., s]
    return y.movedim((0, -1), (by_axis, axis))


def _along(v: Tensor, x: Tensor, axis: int) -> Tensor:
    shape = [1] * x.dim()
    shape[axis] = -1
    return v.to(x.device, x.dtype).reshape(shape)  # broadcastable along `axis`


def gather(x: Tensor, axis: int, index: Tensor) -> Tensor:
    """A permutation as a hard gather: index i of `axis` takes old index index[i] (`act`'s default)."""
    return x.index_select(axis, index.to(x.device))


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
        f"{b}.qk": None if torch.equal(A, eye_d) else _qk_maps(A),
        f"{b}.vo": None if torch.equal(B, eye_d) else {"right": B, "right_inv_t": torch.linalg.inv(B).mT},
        f"{b}.heads": None if torch.equal(hp, torch.arange(len(hp), device=hp.device)) else {
            "perm": hp, "perm_kv": el.kv_perm},
        f"{b}.mlp": None if torch.equal(mp, torch.arange(len(mp), device=mp.device)) else {"perm": mp},
        f"{b}.mlp_scale": None if bool((sc == 1).all()) else {"scale": sc},
    }


def _qk_maps(A: Tensor) -> dict[str, Tensor]:
    inv_t = torch.linalg.inv(A).mT  # [h_kv, d, d]
    return {"right": A, "right_inv_t": inv_t, **qk_norm_part(A, inv_t)}


def act(ps: ParamSpec, mats: dict[str, dict | None], x: Tensor,
        permute: Callable[[Tensor, int, Any], Tensor] = gather) -> Tensor:
    """One parameter moved by the element whose maps are `mats`, computed in x's dtype on x's device.

    This is the one interpreter of a spec: every role's rule lives here. `permute(x, axis, entry)`
    applies a permutation entry of `mats` (roles perm and perm_kv, and a residual permutation's
    "index"): `gather` for the index vectors of `element_maps`; learned matching passes a
    straight-through gather whose entries also carry the latent that receives the gradient
    (engine.align.learned.permute). The other steps are autograd operations, so the result is
    differentiable in x and in continuous maps that are functions of latents.

    Groups absent from `mats`, or None there, act as the identity, so a caller can move one layer, or
    apply the residual map alone, without building the rest of the element.
    """
    # permutations first: the matrices and scales are indexed by the new (permuted) index
    for axis, acts in enumerate(ps.axes):
        for a in acts:
            m = mats.get(a.group)
            if a.role in ("perm", "perm_kv") and m is not None:
                x = permute(x, axis, m[a.role])
    for axis, acts in enumerate(ps.axes):
        for a in acts:
            m = mats.get(a.group)
            if m is None:
                continue
            if "index" in m:  # residual permutation: writers, readers (Omega^{-T} = Omega), norms
                x = permute(x, axis, m["index"])
            elif a.role in MAP_ROLES:
                x = _right(x, axis, m[a.role].to(x.device, x.dtype), a.by_axis, a.per)
            elif a.role == "scale":
                x = x * _along(m["scale"], x, axis)
            elif a.role == "inv_scale":
                x = x / _along(m["scale"], x, axis)
            # a folded gain (all ones) is invariant under rotations; strict mode checked it is folded
    return x


def apply(arch: Arch, g: GroupElement, params: Params, strict: bool = True) -> Params:
    """g.theta as a new dict (docs/MATH.md sections 1-3), each parameter computed in float64 at least.

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
