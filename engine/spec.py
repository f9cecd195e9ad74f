"""Symmetry specs as data: which group acts on which axis of which parameter (docs/MATH.md sections 1-3).

A spec is built from an `Arch` (engine/models/base.py) and validated against the canonical Params:
every key is described (acted on, or declared invariant), every shape agrees with the Arch, and an
architecture the spec cannot describe fails with one sentence saying why (SpecError). The group
actions in engine/symmetry.py interpret a spec; nothing here computes with tensor values except
the check whether the norm gains are folded.

Group classes (`KINDS`, what a user restricts to) and the structure of each group:

    heads          S_h permutation of query heads; under GQA it maps KV groups to KV groups
    mlp            S_m permutation of hidden neurons; SwiGLU gate and up share it
    mlp_scale      ReLU: positive per-neuron scaling; SwiGLU: nonzero scaling of the up branch
    qk             per KV group A: GL(d) without RoPE, RoPE commutant H(r) x GL(d - r) with RoPE; with
                   QK-norm the monomial maps of H(d): one modulus and orientation per pair for the
                   whole layer (they move the q/k norm gains), a sign per pair and KV group
    vo             per KV group B: GL(d)
    residual_perm  permutation of the residual stream (norm gains and LayerNorm biases follow); the only
                   residual map of a post-norm encoder (docs/MATH.md section 9)
    residual_orth  O(D) on the residual stream, exact once norm gains are folded into the readers

Each parameter axis carries a tuple of `AxisAction`s. Roles, all acting on the axis moved last:

    perm         index by the group's permutation (new index i takes old index perm[i])
    perm_kv      index by the induced KV-group permutation (GQA)
    right        x <- x M          (W_Q A, W_V B, writers W Omega)
    right_inv_t  x <- x M^{-T}     (W_K A^{-T}, W_O^T B^{-T} i.e. W_O <- B^{-1} W_O, readers Omega^T W)
    scale        x <- x * s        (ReLU / SwiGLU-up columns)
    inv_scale    x <- x / s        (the matching rows of W_out)
    norm         norm gain or LayerNorm bias: follows a residual permutation; must be folded otherwise
    right_sign   x <- x sign(M)    (QK-norm: W_Q and W_K move by M's signed permutation alone)
    right_abs    x <- x |M|        (QK-norm: the q_norm gain takes M's moduli, entrywise |M|)
    right_inv_t_abs  x <- x |M^{-T}|  (QK-norm: the k_norm gain)

`by_axis` names the axis whose (already permuted) index selects one matrix of a stack (one A per
KV group), `per` how many consecutive indices of that axis share one matrix (h / h_kv query heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import SpecError
from engine.models.base import MLP_KINDS, NORM_KINDS, PE_KINDS, ROPE_LAYOUTS, SCALED_MLPS, Arch, Params

KINDS = ("heads", "mlp", "mlp_scale", "qk", "vo", "residual_perm", "residual_orth")
STRUCTURES = ("permutation", "orthogonal", "gl", "rope_commutant", "rope_qk_norm", "positive_scaling",
              "nonzero_scaling")
ROLES = ("perm", "perm_kv", "right", "right_inv_t", "scale", "inv_scale", "norm", "right_sign", "right_abs",
         "right_inv_t_abs")


@dataclass(frozen=True)
class Group:
    """One group acting on some axes: `n` independent copies, each acting on a space of size `size`."""

    name: str  # "blocks.0.qk", "residual", ...
    kinds: tuple[str, ...]  # the KINDS classes acting through this group
    structure: str  # STRUCTURES
    n: int  # copies (h_kv for one A per KV group, 1 otherwise)
    size: int  # dimension of the space acted on (h, d, m or D)
    layer: int | None
    rope_layout: str | None = None  # rope_commutant and rope_qk_norm only
    rotary_dim: int = 0  # rope_commutant: H(r) on the first r dims, GL(d - r) on the rest
    exact: bool = True  # False: allowed, but not a symmetry of this model (sinusoidal residual)


@dataclass(frozen=True)
class AxisAction:
    group: str
    role: str  # ROLES
    by_axis: int | None = None
    per: int = 1


@dataclass(frozen=True)
class ParamSpec:
    key: str
    shape: tuple[int, ...]
    axes: tuple[tuple[AxisAction, ...], ...]  # one tuple of actions per axis; () = invariant axis

    @property
    def invariant(self) -> bool:
        return not any(self.axes)


@dataclass(frozen=True)
class Spec:
    arch: Arch
    groups: dict[str, Group]
    params: dict[str, ParamSpec]
    kinds: tuple[str, ...]  # KINDS with a nontrivial group in this architecture
    approximate: frozenset[str]  # kinds allowed but not exact (sinusoidal PE: P_sin Omega != P_sin)
    requires: dict[str, str] = field(default_factory=dict)  # kind -> what to do before applying it
    norms_folded: bool = False  # RMSNorm with every gain 1: residual_orth is exact

    def axes_of(self, group: str) -> list[tuple[str, int, AxisAction]]:
        """The inverse index: every (key, axis, action) a group acts on."""
        return [(k, ax, a) for k, p in self.params.items() for ax, acts in enumerate(p.axes)
                for a in acts if a.group == group]

    def describe(self, kind: str) -> str:
        """Human name of the group of a kind in this architecture, e.g. 'H(8) x GL(8) per KV group'."""
        a = self.arch
        d, r = a.d_head, a.rotary_dim
        if kind == "heads":
            gqa = " (KV groups to KV groups)" if a.n_kv_heads != a.n_heads else ""
            return f"S_{a.n_heads} head permutation{gqa}"
        if kind == "mlp":
            return f"S_{a.d_mlp} neuron permutation" + (" (gate and up tied)" if a.gated else "")
        if kind == "mlp_scale":
            return "positive neuron scaling" if a.mlp == "relu" else "nonzero up-branch scaling"
        if kind == "qk":
            if a.qk_norm:
                return (f"QK-norm: RoPE commutant maps that are scaled signed permutations, {d // 2} gain "
                        "scales and pair orientations per layer, a sign per pair and KV group")
            if a.pe != "rope":
                return f"GL({d}) per KV group"
            lay = f"RoPE commutant H({r}), {a.rope_layout} pairs"
            return f"{lay} x GL({d - r}) per KV group" if r < d else f"{lay} per KV group"
        if kind == "vo":
            return f"GL({d}) per KV group"
        if kind == "residual_perm":
            return f"S_{a.d_model} residual permutation"
        return f"O({a.d_model}) residual rotation"


# ---------------------------------------------------------------------------------------------
# Validation of the architecture itself


def check_arch(arch: Arch) -> None:
    """Raise SpecError if no spec can describe this architecture."""
    def need(ok: bool, why: str) -> None:
        if not ok:
            raise SpecError(f"The {arch.family} architecture has no symmetry spec: {why}.")

    need(arch.task in ("lm", "vit"), f"task {arch.task!r} is neither lm nor vit")
    need(arch.pe in PE_KINDS, f"positional encoding {arch.pe!r} is not one of {PE_KINDS} "
         "(ALiBi-style per-head biases would break head permutations)")
    need(arch.norm in NORM_KINDS, f"norm {arch.norm!r} is not one of {NORM_KINDS}")
    need(arch.mlp in MLP_KINDS, f"MLP activation {arch.mlp!r} is not one of {MLP_KINDS}")
    need(min(arch.n_layers, arch.d_model, arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp) > 0,
         "every size must be positive")
    need(arch.n_heads % arch.n_kv_heads == 0,
         f"{arch.n_heads} query heads do not split into {arch.n_kv_heads} KV groups")
    if arch.pe == "rope":
        need(arch.rope_layout in ROPE_LAYOUTS, f"RoPE pairing {arch.rope_layout!r} is not one of {ROPE_LAYOUTS}")
        need(0 < arch.rotary_dim <= arch.d_head and arch.rotary_dim % 2 == 0,
             f"rotary_dim {arch.rotary_dim} must be even and in (0, d_head={arch.d_head}]")
    else:
        need(arch.rotary_dim == 0, f"rotary_dim is {arch.rotary_dim} without RoPE")
    need(not arch.tied_embeddings or arch.task == "lm", "only a language model can tie its embeddings")
    need(not arch.norm_bias or arch.norm == "layernorm", "RMSNorm has no bias")
    need(not arch.qk_norm or (arch.pe == "rope" and arch.rotary_dim == arch.d_head),
         "QK-norm is described with RoPE on the whole head only (as in Qwen3)")
    need(not arch.post_norm or (arch.task == "lm" and arch.norm == "layernorm" and arch.norm_bias
                                and arch.pe == "learned" and arch.tied_embeddings and not arch.parallel_residual),
         "a post-norm encoder is described as BERT only (LayerNorm with biases, learned positions, a decoder tied "
         "to the embedding or none, sequential blocks)")


def arch_kinds(arch: Arch) -> tuple[str, ...]:
    """KINDS with a nontrivial group in this architecture (a spec's `kinds`, from the Arch alone); a post-norm
    stream has no rotations (docs/MATH.md section 9)."""
    return tuple(k for k in KINDS if (k != "mlp_scale" or arch.mlp in SCALED_MLPS)
                 and (k != "residual_orth" or not arch.post_norm))


def approximate_kinds(arch: Arch) -> frozenset[str]:
    """Kinds allowed but not exact: residual maps under a fixed sinusoidal PE (P_sin Omega != P_sin)."""
    return frozenset({"residual_perm", "residual_orth"} if arch.pe == "sinusoidal" else ())


# ---------------------------------------------------------------------------------------------
# Building a spec


Shape = tuple[int | None, ...]
Axes = tuple[tuple[AxisAction, ...], ...]


def _expected(arch: Arch, params: Params) -> dict[str, tuple[Shape, Axes]]:
    """key -> (shape, actions per axis); None in a shape is a size the Arch does not fix."""
    D, h, hkv, d, m = arch.d_model, arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp
    rep = h // hkv
    R = "residual"
    W, Rd, N = AxisAction(R, "right"), AxisAction(R, "right_inv_t"), AxisAction(R, "norm")  # writer, reader, norm
    out: dict = {}

    def norm(prefix: str) -> None:
        out[f"{prefix}.g"] = ((D,), ((N,),))
        if arch.norm_bias:
            out[f"{prefix}.b"] = ((D,), ((N,),))

    # Embedding: every embedding is a residual writer (docs/MATH.md section 3); learned PE too.
    if arch.task == "lm":
        out["embed.tok"] = ((arch.n_out, D), ((), (W,)))
    else:
        P = params["embed.patch.W"].shape[0] if "embed.patch.W" in params else None
        out["embed.patch.W"] = ((P, D), ((), (W,)))
        out["embed.patch.b"] = ((D,), ((W,),))
        out["embed.cls"] = ((D,), ((W,),))
    if arch.pe == "learned":  # a post-norm encoder's table may start with rows before its first position (RoBERTa)
        out["embed.pos"] = ((None if arch.post_norm else arch.n_ctx, D), ((), (W,)))
    if arch.post_norm:
        out |= _post_norm_outer(arch, params, W, Rd, N)

    for layer in range(arch.n_layers):
        b = f"blocks.{layer}"
        H, KV = AxisAction(f"{b}.heads", "perm"), AxisAction(f"{b}.heads", "perm_kv")
        A_q = AxisAction(f"{b}.qk", "right", by_axis=0, per=rep)  # W_Q^i <- W_Q^{sigma(i)} A_{g(i)}
        A_k = AxisAction(f"{b}.qk", "right_inv_t", by_axis=0)  # W_K^g <- W_K^{tau(g)} A_g^{-T}
        if arch.qk_norm:  # docs/MATH.md section 1, QK-norm: W_Q, W_K move by sign(A) (= sign(A)^{-T}), gains by |A|
            A_q = AxisAction(f"{b}.qk", "right_sign", by_axis=0, per=rep)
            A_k = AxisAction(f"{b}.qk", "right_sign", by_axis=0)
        B_v = AxisAction(f"{b}.vo", "right", by_axis=0)  # W_V^g <- W_V^{tau(g)} B_g
        B_o = AxisAction(f"{b}.vo", "right_inv_t", by_axis=0, per=rep)  # W_O^i <- B_{g(i)}^{-1} W_O^{sigma(i)}
        Pm, S, Si = AxisAction(f"{b}.mlp", "perm"), AxisAction(f"{b}.mlp_scale", "scale"), AxisAction(
            f"{b}.mlp_scale", "inv_scale")
        norm(f"{b}.norm1")
        out[f"{b}.attn.W_Q"] = ((h, D, d), ((H,), (Rd,), (A_q,)))
        out[f"{b}.attn.W_K"] = ((hkv, D, d), ((KV,), (Rd,), (A_k,)))
        out[f"{b}.attn.W_V"] = ((hkv, D, d), ((KV,), (Rd,), (B_v,)))
        out[f"{b}.attn.W_O"] = ((h, d, D), ((H,), (B_o,), (W,)))
        if arch.qk_norm:
            out[f"{b}.attn.q_norm.g"] = ((d,), ((AxisAction(f"{b}.qk", "right_abs"),),))
            out[f"{b}.attn.k_norm.g"] = ((d,), ((AxisAction(f"{b}.qk", "right_inv_t_abs"),),))
        if arch.attn_bias:
            out[f"{b}.attn.b_Q"] = ((h, d), ((H,), (A_q,)))
            out[f"{b}.attn.b_K"] = ((hkv, d), ((KV,), (A_k,)))
            out[f"{b}.attn.b_V"] = ((hkv, d), ((KV,), (B_v,)))
        if arch.out_bias:
            out[f"{b}.attn.b_O"] = ((D,), ((W,),))
        norm(f"{b}.norm2")
        scaled = arch.mlp in SCALED_MLPS  # docs/MATH.md section 2: only these have a scaling group
        up = (Pm, S) if scaled else (Pm,)
        out[f"{b}.mlp.W_in"] = ((D, m), ((Rd,), up))
        if arch.mlp_bias:
            out[f"{b}.mlp.b_in"] = ((m,), (up,))
        if arch.gated:
            out[f"{b}.mlp.W_gate"] = ((D, m), ((Rd,), (Pm,)))  # gate shares the permutation, never scaled
        out[f"{b}.mlp.W_out"] = ((m, D), ((Pm, Si) if scaled else (Pm,), (W,)))
        if arch.mlp_bias:
            out[f"{b}.mlp.b_out"] = ((D,), ((W,),))

    if not arch.post_norm:
        norm("norm_f")
    if not arch.tied_embeddings:  # tied: embed.tok is the reader too, consistent for orthogonal Omega
        out["head.W"] = ((D, arch.n_out), ((Rd,), ()))
    if arch.head_bias:
        out["head.b"] = ((arch.n_out,), ((),))
    return out


def _post_norm_outer(arch: Arch, params: Params, W: AxisAction, Rd: AxisAction, N: AxisAction) -> dict:
    """A post-norm encoder's parameters outside the blocks (docs/MATH.md section 9): token types write to the
    stream, the embedding sum is normed, and the masked-LM head's dense layer (a model with a head bias)
    reads the stream and writes in its basis (the decoder is tied to embed.tok), so it moves on both axes,
    its norm like the stream's. A pooler present in `params` reads the [CLS] stream on its input axis; its
    output and the next-sentence head on it see no stream basis and stay."""
    D = arch.d_model
    n_types = params["embed.segment"].shape[0] if "embed.segment" in params else None
    out = {
        "embed.segment": ((n_types, D), ((), (W,))),
        "embed.norm.g": ((D,), ((N,),)), "embed.norm.b": ((D,), ((N,),)),
    }
    if arch.head_bias:
        out |= {"head.dense.W": ((D, D), ((Rd,), (W,))), "head.dense.b": ((D,), ((W,),)),
                "head.norm.g": ((D,), ((N,),)), "head.norm.b": ((D,), ((N,),))}
    if "head.pool.W" in params:
        out |= {"head.pool.W": ((D, D), ((Rd,), ())), "head.pool.b": ((D,), ((),))}
    if "head.nsp.W" in params:
        out |= {"head.nsp.W": ((D, 2), ((), ())), "head.nsp.b": ((2,), ((),))}
    return out


def norms_are_folded(arch: Arch, params: Params) -> bool:
    """RMSNorm whose every gain is exactly 1: the residual stream may be rotated (docs/MATH.md section 3).
    QK-norm gains act in head space, not on the residual stream: they are not counted."""
    if arch.norm != "rmsnorm":
        return False
    return all(bool((v == 1).all()) for k, v in params.items() if k.endswith(".g") and not is_qk_gain(k))


def is_qk_gain(key: str) -> bool:
    """A QK-norm gain (`blocks.l.attn.q_norm.g`, `.k_norm.g`): in head space, never folded into a reader."""
    return key.endswith((".attn.q_norm.g", ".attn.k_norm.g"))


def build_spec(arch: Arch, params: Params) -> Spec:
    """The symmetry spec of `arch`, validated against the canonical `params`."""
    check_arch(arch)
    expected = _expected(arch, params)
    missing = [k for k in expected if k not in params]
    extra = [k for k in params if k not in expected]
    if missing:
        raise SpecError(f"The {arch.family} spec expects parameter {missing[0]!r}, which the model lacks"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}.")
    if extra:
        raise SpecError(f"Parameter {extra[0]!r} is not described by the {arch.family} symmetry spec"
                        f"{f' (nor are {len(extra) - 1} more)' if len(extra) > 1 else ''}.")
    specs: dict[str, ParamSpec] = {}
    for k, (shape, axes) in expected.items():
        got = tuple(params[k].shape)
        if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
            raise SpecError(f"Parameter {k!r} has shape {list(got)} but the architecture implies "
                            f"{[s if s is not None else '?' for s in shape]}.")
        specs[k] = ParamSpec(k, got, axes)

    a = arch
    sinus = a.pe == "sinusoidal"
    groups: dict[str, Group] = {
        "residual": Group("residual", ("residual_perm", "residual_orth"), "orthogonal", 1, a.d_model, None,
                          exact=not sinus),
    }
    if a.post_norm:  # docs/MATH.md section 9: a norm after every add commutes with permutations only
        groups["residual"] = Group("residual", ("residual_perm",), "permutation", 1, a.d_model, None)
    for layer in range(a.n_layers):
        b = f"blocks.{layer}"
        groups[f"{b}.heads"] = Group(f"{b}.heads", ("heads",), "permutation", 1, a.n_heads, layer)
        if a.qk_norm:
            groups[f"{b}.qk"] = Group(f"{b}.qk", ("qk",), "rope_qk_norm", a.n_kv_heads, a.d_head, layer,
                                      rope_layout=a.rope_layout, rotary_dim=a.rotary_dim)
        elif a.pe == "rope":
            groups[f"{b}.qk"] = Group(f"{b}.qk", ("qk",), "rope_commutant", a.n_kv_heads, a.d_head, layer,
                                      rope_layout=a.rope_layout, rotary_dim=a.rotary_dim)
        else:
            groups[f"{b}.qk"] = Group(f"{b}.qk", ("qk",), "gl", a.n_kv_heads, a.d_head, layer)
        groups[f"{b}.vo"] = Group(f"{b}.vo", ("vo",), "gl", a.n_kv_heads, a.d_head, layer)
        groups[f"{b}.mlp"] = Group(f"{b}.mlp", ("mlp",), "permutation", 1, a.d_mlp, layer)
        if a.mlp in SCALED_MLPS:
            groups[f"{b}.mlp_scale"] = Group(f"{b}.mlp_scale", ("mlp_scale",),
                                             "positive_scaling" if a.mlp == "relu" else "nonzero_scaling",
                                             1, a.d_mlp, layer)
    used = {act.group for p in specs.values() for acts in p.axes for act in acts}
    unknown = used - set(groups)
    if unknown:  # a bug in _expected, not a user error, but say it plainly
        raise SpecError(f"The {a.family} spec names undeclared groups {sorted(unknown)}.")

    kinds = arch_kinds(a)
    if set(kinds) != {k for g in groups.values() for k in g.kinds}:  # a bug in the groups above
        raise SpecError(f"The {a.family} spec's groups do not match its symmetry classes {kinds}.")
    folded = norms_are_folded(arch, params)
    requires: dict[str, str] = {}
    if "residual_orth" not in kinds:  # a post-norm stream: no rotation to prepare for
        pass
    elif a.norm == "layernorm":
        requires["residual_orth"] = ("LayerNorm does not commute with rotations: rewrite the model with "
                                     "layernorm_to_rmsnorm first (docs/MATH.md section 3)")
    elif not folded:
        requires["residual_orth"] = "the RMSNorm gains are not folded into the readers: call fold_norms first"
    return Spec(arch, groups, specs, kinds, approximate_kinds(a), requires, folded)
