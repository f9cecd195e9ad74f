"""Function-preserving rewrites of a model's parameters (docs/MATH.md section 3).

- `fold_norms` moves RMSNorm gains into the readers after each norm (all gains become 1);
- `layernorm_to_rmsnorm` rewrites a LayerNorm model as an RMSNorm model of the reference family;
- `fold_norms_` and `layernorm_to_rmsnorm_` do the same in place, one tensor at a time, into the
  tensors they are given (a model's own, for a run that needs no copy of it);
- `reference_config_from_arch` gives the reference-family config whose module computes what an Arch
  describes, so that a rewritten model has a module to run in.

Residual rotations (engine/symmetry.py) need one of the first two first: an RMSNorm with unit gains
commutes with every orthogonal map of the stream, a gain or a LayerNorm's centring does not.
QK-norm gains (`attn.q_norm.g`, `attn.k_norm.g`) act in head space, after the readers: neither rewrite
touches them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from engine.errors import ModelError, SpecError
from engine.models.base import Arch, Params
from engine.models.reference import RefConfig
from engine.spec import build_spec, check_arch

__all__ = ["fold_norms", "fold_norms_", "layernorm_to_rmsnorm", "layernorm_to_rmsnorm_", "reference_config_from_arch"]


# ---------------------------------------------------------------------------------------------
# Norm folding and the LayerNorm rewrite


def _readers(arch: Arch, norm: str, layer: int | None) -> list[tuple[str, str | None, str]]:
    """(weight, its bias or None, contraction) of every reader that follows a norm."""
    if norm == "norm_f":
        return [("head.W", "head.b", "D,Dn->n")]
    b = f"blocks.{layer}"
    if norm == "norm1":
        return [(f"{b}.attn.W_{x}", f"{b}.attn.b_{x}", "D,hDd->hd") for x in "QKV"]
    rs = [(f"{b}.mlp.W_in", f"{b}.mlp.b_in", "D,Dm->m")]
    if arch.gated:
        rs.append((f"{b}.mlp.W_gate", None, "D,Dm->m"))  # the gate has no bias in the canonical layout
    return rs


def _norms(arch: Arch) -> list[tuple[str, int | None]]:
    return [(f"blocks.{i}.{n}", i) for i in range(arch.n_layers) for n in ("norm1", "norm2")] + [("norm_f", None)]


def _fold_gain_(W: Tensor, g: Tensor) -> None:
    """W <- diag(g) W on the residual (input) axis of a reader: axis 0 of [D, n], axis 1 of [h, D, d]."""
    W.mul_(g[:, None] if W.dim() == 2 else g[None, :, None])


def _copy(params: Params) -> Params:
    return {k: v.clone() for k, v in params.items()}


def fold_norms(arch: Arch, params: Params) -> tuple[Arch, Params]:
    """Move every RMSNorm gain into the readers after it; all gains become 1 (docs/MATH.md section 3).

    RMSNorm(x) W = (x / rms(x)) diag(g) W, so the readers absorb diag(g) exactly. Tied embeddings are
    untied when the final gain is not all ones (the unembedding becomes diag(g) E^T while E, a writer,
    stays); the returned Arch then belongs to the reference family, whose module can hold the untied
    head. Otherwise the family is unchanged and the Params fit the original model. `params` are not
    changed: fold_norms_ on a copy.
    """
    return fold_norms_(arch, _copy(params))


@torch.no_grad()
def fold_norms_(arch: Arch, params: Params) -> tuple[Arch, Params]:
    """fold_norms written into the tensors of `params` themselves (views of a model: no copy is made).

    Returns the new Arch and the folded Params: the same tensors, plus a new untied head where one is
    needed (then the module the views belong to no longer computes the folded function: only a
    reference-family model built from the returned Params does).
    """
    if arch.norm != "rmsnorm":
        raise SpecError(f"fold_norms folds RMSNorm gains, but this model uses {arch.norm}; "
                        "call layernorm_to_rmsnorm instead.")
    build_spec(arch, params)
    p = dict(params)
    untie = arch.tied_embeddings and not bool((p["norm_f.g"] == 1).all())
    if untie:
        p["head.W"] = p["embed.tok"].T.clone()  # [D, V]
    for name, layer in _norms(arch):
        g = p[f"{name}.g"]
        for W, _, _ in _readers(arch, name.split(".")[-1], layer):
            if W in p:
                _fold_gain_(p[W], g)
        g.fill_(1)
    new = replace(arch, tied_embeddings=False, family="reference") if untie else arch
    return new, p


def layernorm_to_rmsnorm(arch: Arch, params: Params) -> tuple[Arch, Params]:
    """Rewrite a LayerNorm model as an RMSNorm model of the reference family (docs/MATH.md section 3).

    Every writer is centred (W <- W (I - 11^T/D)), so the residual stream has zero mean and
    LayerNorm(x) = RMSNorm(x) with the same eps; the gain is folded into the readers (diag(g) W) and
    the bias beta into the readers' biases (b_W <- b_W + beta W), which are created, zero, where the
    model had none. All gains become 1. Tied embeddings are untied unless the final norm has gain 1
    (then C E^T serves as the unembedding, since the readers only see centred vectors, and beta E^T
    goes into the head bias).
    Fixed sinusoidal PE cannot be centred (it is not a parameter), so such a model is refused, as is a
    SwiGLU model with a LayerNorm bias (its gate branch has no bias to absorb beta).
    `params` are not changed: layernorm_to_rmsnorm_ on a copy.
    """
    return layernorm_to_rmsnorm_(arch, _copy(params))


@torch.no_grad()
def layernorm_to_rmsnorm_(arch: Arch, params: Params) -> tuple[Arch, Params]:
    """layernorm_to_rmsnorm written into the tensors of `params` themselves, one tensor at a time.

    Returns the new Arch and Params: the same tensors (changed in place), plus the new ones the
    rewrite needs (gains of 1, absent biases as zeros, an untied head). The module the views belong
    to does not compute the rewritten function (it is no longer its family's): a reference-family
    model built from the returned Params does.
    """
    if arch.norm != "layernorm":
        raise SpecError(f"layernorm_to_rmsnorm rewrites LayerNorm models, but this model uses {arch.norm}; "
                        "call fold_norms instead.")
    if arch.pe == "sinusoidal":
        raise SpecError("A LayerNorm model with fixed sinusoidal PE cannot be rewritten as RMSNorm: the "
                        "sinusoidal table is a residual writer whose rows are not centred and cannot be changed.")
    if arch.post_norm:
        raise SpecError("A post-LayerNorm model cannot be rewritten as RMSNorm: its norms sit in the residual "
                        "stream itself, not in front of readers (docs/MATH.md section 9).")
    build_spec(arch, params)
    D = arch.d_model
    p = dict(params)
    beta = {name: p.get(f"{name}.b") for name, _ in _norms(arch)}
    if arch.gated and any(b is not None and bool((b != 0).any()) for n, b in beta.items() if "norm2" in n):
        raise SpecError("A gated-MLP model with a LayerNorm bias cannot be rewritten: the gate branch has no bias "
                        "to absorb it.")
    bias = arch.attn_bias or arch.out_bias or arch.mlp_bias or arch.norm_bias
    g_f, b_f = p["norm_f.g"], beta["norm_f"]
    ref = {"dtype": g_f.dtype, "device": g_f.device}
    keep_tied = arch.tied_embeddings and bool((g_f == 1).all())
    untie = arch.tied_embeddings and not keep_tied
    head_bias = arch.head_bias or b_f is not None
    if untie:
        p["head.W"] = p["embed.tok"].T.clone()  # [D, V] before centring: the reader sees E^T
    if bias:  # the reference family has all of these biases or none; absent ones are zero
        h, hkv, d, m = arch.n_heads, arch.n_kv_heads, arch.d_head, arch.d_mlp
        for i in range(arch.n_layers):
            b = f"blocks.{i}"
            for k, shape in ((f"{b}.attn.b_Q", (h, d)), (f"{b}.attn.b_K", (hkv, d)), (f"{b}.attn.b_V", (hkv, d)),
                             (f"{b}.attn.b_O", (D,)), (f"{b}.mlp.b_in", (m,)), (f"{b}.mlp.b_out", (D,))):
                p.setdefault(k, torch.zeros(shape, **ref))
    if head_bias:
        p.setdefault("head.b", torch.zeros(arch.n_out, **ref))

    # readers: beta into the bias (with the weight before the gain), then the gain into the weight
    for name, layer in _norms(arch):
        g, b = p.pop(f"{name}.g"), p.pop(f"{name}.b", None)
        for W, bW, eq in _readers(arch, name.split(".")[-1], layer):
            tied = W not in p  # kept tied: the unembedding is the centred embedding itself (gain 1)
            if b is not None and bW is not None:  # in float32 at least, rounded once (bfloat16: no bfloat16 product)
                wd = torch.promote_types(b.dtype, torch.float32)
                p[bW].add_(torch.einsum(eq, b.to(wd), (p["embed.tok"].T if tied else p[W]).to(wd)))
            if not tied:
                _fold_gain_(p[W], g)
        p[f"{name}.g"] = torch.ones(D, **ref)  # a new tensor: the model's own gain is left as it was

    # writers: centre along D, x (I - 11^T/D)
    writers = ["embed.tok", "embed.pos", "embed.patch.W", "embed.patch.b", "embed.cls"]
    for i in range(arch.n_layers):
        writers += [f"blocks.{i}.attn.W_O", f"blocks.{i}.attn.b_O", f"blocks.{i}.mlp.W_out", f"blocks.{i}.mlp.b_out"]
    for k in writers:
        if k in p:
            p[k].sub_(p[k].mean(-1, keepdim=True))  # [..., D] every writer's D axis is last
    new = replace(arch, family="reference", norm="rmsnorm", norm_bias=False, attn_bias=bias, out_bias=bias,
                  mlp_bias=bias, head_bias=head_bias, tied_embeddings=keep_tied)
    build_spec(new, p)
    return new, p


# ---------------------------------------------------------------------------------------------
# The reference-family config of an Arch


def reference_config_from_arch(arch: Arch, *, in_chans: int | None = None, patch_size: int | None = None,
                               image_size: int | None = None, patch_dim: int | None = None) -> RefConfig:
    """The reference-family config whose module computes the same function as `arch` describes.

    A ViT's image geometry is not part of an Arch: give in_chans / patch_size / image_size, or the
    patch dimension P = C p^2 (the rows of embed.patch.W), from which C in (3, 1) and p are inferred.
    Raises SpecError if the reference family cannot express the architecture (mixed bias flags, ...).
    """
    check_arch(arch)
    a = arch
    bias = a.out_bias  # all biases; or, without it, Q/K/V biases alone (qkv_bias)
    if not (a.mlp_bias == bias and a.norm_bias == (bias and a.norm == "layernorm") and (a.attn_bias or not bias)):
        raise SpecError("The reference family has attention, MLP and LayerNorm biases all or none, or biases on Q, K "
                        f"and V alone; this {a.family} architecture mixes them differently.")
    if a.causal != (a.task == "lm"):
        raise SpecError(f"The reference family's {a.task} is {'' if a.task == 'lm' else 'not '}causal, "
                        "unlike this model.")
    kw: dict = {
        "task": a.task, "n_layers": a.n_layers, "d_model": a.d_model, "n_heads": a.n_heads,
        "n_kv_heads": a.n_kv_heads, "d_head": a.d_head, "d_mlp": a.d_mlp, "pe": a.pe,
        "rope_layout": a.rope_layout or "interleaved", "rotary_dim": a.rotary_dim, "rope_base": a.rope_base,
        "norm": a.norm, "norm_eps": a.norm_eps, "mlp": a.mlp, "bias": bias, "qkv_bias": a.attn_bias and not bias,
        "head_bias": a.head_bias,
        "tied_embeddings": a.tied_embeddings, "parallel_residual": a.parallel_residual, "qk_norm": a.qk_norm,
        "rope_scaling": a.rope_scaling, "embed_scale": a.embed_scale,
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
