"""timm ViT (`timm.models.vision_transformer.VisionTransformer`), class-token classifier.

Supported: the original ViT (An Image is Worth 16x16 Words, ICLR 2021) as timm builds it: Conv2d patch embedding,
class token, learned position embedding covering the class position too, pre-norm blocks with a
fused qkv projection, LayerNorm, exact-GELU MLP, final LayerNorm, linear head on the class token.
Every other timm option (register tokens, layer-scale, qk-norm, average pooling, ...) is refused by
name: it changes the symmetry group or the canonical layout.

Native layout quirks the canonical conversion undoes:
- the Conv2d patch kernel [D, C, p, p] becomes embed.patch.W [C*p*p, D], flattened in (C, p, p)
  order, the reference family's patchify order;
- qkv.weight [3*h*d, D] has rows Q | K | V, each head-major; nn.Linear stores out x in.

Two directory formats load:
- the engine's: config.json {"family": "timm_vit", "model_args": {VisionTransformer kwargs}} +
  model.safetensors (optionally "architecture": a registered timm name the kwargs override);
- timm's own hub layout: config.json {"architecture", "num_classes", "model_args", ...} +
  model.safetensors, built with timm.create_model(..., pretrained=False).
Saving always writes the engine's format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch, Family, Model, Params
from engine.models.io import read_config, read_safetensors, refuse_pickles, write_checkpoint

FAMILY = "timm_vit"
DISPLAY = "Vision Transformer (timm)"

# model_args whose values the canonical layout cannot express: option -> (is_unsupported, what it is).
UNSUPPORTED_ARGS = {
    "class_token": (lambda v: not v, "no class token"),
    "global_pool": (lambda v: v != "token", "only class-token pooling ('token') is supported"),
    "reg_tokens": (lambda v: bool(v), "register tokens"),
    "no_embed_class": (lambda v: bool(v), "a class token without a position embedding"),
    "pos_embed": (lambda v: v != "learn", "only a learned position embedding is supported"),
    "init_values": (lambda v: v is not None and v != 0, "layer-scale"),
    "qk_norm": (lambda v: bool(v), "normalised queries and keys"),
    "scale_attn_norm": (lambda v: bool(v), "a norm inside attention"),
    "scale_mlp_norm": (lambda v: bool(v), "a norm inside the MLP"),
    "pre_norm": (lambda v: bool(v), "a norm before the first block"),
    "fc_norm": (lambda v: bool(v), "a norm after pooling"),
    "final_norm": (lambda v: not v, "no final norm"),
    "dynamic_img_size": (lambda v: bool(v), "resampled position embeddings"),
    "dynamic_img_pad": (lambda v: bool(v), "padded images"),
    "num_classes": (lambda v: not v, "no classifier head"),
}


# Checked before timm builds anything (a string where a size belongs, zero heads, ...).
MODEL_ARG_RULES = {
    "img_size": "size_or_pair", "patch_size": "size_or_pair", "in_chans": "size", "num_classes": "count",
    "embed_dim": "size", "depth": "size", "num_heads": "size", "mlp_ratio": "positive", "reg_tokens": "count",
    "global_pool": "str", "pos_embed": "str", "weight_init": "str", "fc_norm": "opt_bool",
    **{k: "bool" for k in ("qkv_bias", "qk_norm", "scale_attn_norm", "scale_mlp_norm", "proj_bias", "class_token",
                           "no_embed_class", "pre_norm", "final_norm", "dynamic_img_size", "dynamic_img_pad",
                           "pool_include_prefix", "fix_init")},
    **{k: "opt_fraction" for k in ("drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate",
                                   "attn_drop_rate", "drop_path_rate")},
}
CONFIG_RULES = {"architecture": "opt_str", "num_classes": "count", "model_args": "opt_dict"}
# Keys of a pretrained_cfg that make timm read weights from somewhere: a config never may.
WEIGHT_SOURCES = ("file", "url", "hf_hub_id", "hf_hub_filename", "state_dict", "source")


def _model_arg_names() -> frozenset[str]:
    """The options model_args may hold: VisionTransformer's own keyword arguments, nothing that
    create_model would interpret (checkpoint_path, pretrained, pretrained_cfg, ...)."""
    import inspect

    from timm.models.vision_transformer import VisionTransformer

    return frozenset(inspect.signature(VisionTransformer.__init__).parameters) - {"self", "device", "dtype"}


def check_config(config: dict, source: str) -> None:
    """Refuse a config that would make timm read a file or that has fields of the wrong type."""
    from engine.models.io import check_fields

    check_fields(config, CONFIG_RULES, source)
    if "checkpoint_path" in config:
        raise ModelError(f"{source} names a checkpoint_path; the engine reads weights only from the "
                         "directory's model.safetensors, never from a file a config names.")
    for key in ("pretrained_cfg", "pretrained_cfg_overlay"):
        pc = config.get(key)
        if pc is not None and not isinstance(pc, dict):
            raise ModelError(f"{source}: {key} must be an object, not {type(pc).__name__}.")
        named = [k for k in WEIGHT_SOURCES if (pc or {}).get(k)]
        if named:
            raise ModelError(f"{source}: {key} names a weight source ({', '.join(named)}); the engine reads "
                             "weights only from the directory's model.safetensors.")
    args = config.get("model_args") or {}
    unknown = sorted(set(args) - _model_arg_names())
    if unknown:
        raise ModelError(f"{source}: model_args has {', '.join(map(repr, unknown[:3]))}, which "
                         f"{'is not a VisionTransformer option' if len(unknown) == 1 else 'are not VisionTransformer options'}; "
                         "the engine builds timm models from their options alone (no pretrained weights, no files).")
    check_fields(args, MODEL_ARG_RULES, f"{source}: model_args")


def _refuse(source: str, option: str, why: str) -> None:
    raise ModelError(f"{source} uses the timm option {option}, which the engine does not support ({why}).")


def check_args(model_args: dict, source: str) -> None:
    """Refuse unsupported options by name before timm builds anything."""
    for k, (bad, why) in UNSUPPORTED_ARGS.items():
        if k in model_args and bad(model_args[k]):
            _refuse(source, f"{k}={model_args[k]!r}", why)


def arch(module: nn.Module, source: str = "timm VisionTransformer") -> Arch:
    """Validate a built VisionTransformer against what the canonical layout expresses; summarise it.

    Checked on the module, not the kwargs, because registered timm architectures set their own
    defaults (a CLIP ViT has pre_norm, a DeiT-3 layer-scale, ...).
    """
    from timm.layers import Mlp, PatchEmbed
    from timm.layers.attention import Attention
    from timm.models.vision_transformer import Block, VisionTransformer

    def need(ok: bool, option: str, why: str) -> None:
        if not ok:
            _refuse(source, option, why)

    m = module
    need(type(m) is VisionTransformer, f"model class {type(m).__name__}", "only the plain VisionTransformer")
    need(m.cls_token is not None, "class_token=False", "no class token")
    need(m.reg_token is None, f"reg_tokens={m.num_reg_tokens}", "register tokens")
    need(m.pos_embed is not None, "pos_embed='none'", "no position embedding")
    need(not m.no_embed_class, "no_embed_class=True", "a class token without a position embedding")
    need(not m.dynamic_img_size, "dynamic_img_size=True", "resampled position embeddings")
    need(m.global_pool == "token" and m.attn_pool is None, f"global_pool={m.global_pool!r}",
         "only class-token pooling ('token') is supported")
    need(isinstance(m.patch_drop, nn.Identity), "patch_drop_rate", "dropped patches")
    need(isinstance(m.norm_pre, nn.Identity), "pre_norm=True", "a norm before the first block")
    need(isinstance(m.fc_norm, nn.Identity), "fc_norm=True", "a norm after pooling")
    need(type(m.norm) in _layernorms(), "final_norm / norm_layer", "the final norm must be a LayerNorm")
    need(isinstance(m.head, nn.Linear), "num_classes=0", "no classifier head")
    pe = m.patch_embed
    need(type(pe) is PatchEmbed and isinstance(pe.norm, nn.Identity) and pe.flatten and not pe.dynamic_img_pad,
         "embed_layer / embed_norm_layer", "the patch embedding must be a plain Conv2d")
    p = pe.patch_size
    need(p[0] == p[1] and pe.proj.kernel_size == p and pe.proj.stride == p and pe.proj.bias is not None,
         f"patch_size={p}", "square, non-overlapping patches with a bias")
    eps = m.norm.eps
    for blk in m.blocks:
        need(type(blk) is Block, f"block_fn={type(blk).__name__}", "only the standard pre-norm block")
        need(isinstance(blk.ls1, nn.Identity) and isinstance(blk.ls2, nn.Identity), "init_values", "layer-scale")
        at, mlp = blk.attn, blk.mlp
        need(type(at) is Attention, f"attn_layer={type(at).__name__}", "only the standard attention")
        need(isinstance(at.q_norm, nn.Identity) and isinstance(at.k_norm, nn.Identity), "qk_norm=True",
             "normalised queries and keys")
        need(isinstance(at.norm, nn.Identity), "scale_attn_norm=True", "a norm inside attention")
        need(getattr(at, "gate", None) is None, "gated attention", "a sigmoid gate on the attention output")
        need(type(mlp) is Mlp and isinstance(mlp.fc1, nn.Linear), f"mlp_layer={type(mlp).__name__}",
             "only the standard two-layer MLP")
        need(isinstance(mlp.norm, nn.Identity), "scale_mlp_norm=True", "a norm inside the MLP")
        need(_is_exact_gelu(mlp.act), f"act_layer={type(mlp.act).__name__}", "the MLP activation must be exact GELU")
        for norm in (blk.norm1, blk.norm2):
            need(type(norm) in _layernorms() and norm.bias is not None and norm.eps == eps,
                 f"norm_layer={type(norm).__name__}", "every norm must be a LayerNorm with bias and one eps")
    at, mlp = m.blocks[0].attn, m.blocks[0].mlp
    H, W = pe.grid_size
    return Arch(
        family=FAMILY, task="vit", n_layers=len(m.blocks), d_model=m.embed_dim, n_heads=at.num_heads,
        n_kv_heads=at.num_heads, d_head=at.head_dim, d_mlp=mlp.fc1.out_features, n_out=m.head.out_features,
        n_ctx=H * W + 1,  # patches + the class token
        pe="learned", rope_layout=None, rotary_dim=0, rope_base=0.0,  # rope_base unused without RoPE
        norm="layernorm", norm_bias=True, norm_eps=float(eps), mlp="gelu",
        attn_bias=at.qkv.bias is not None, out_bias=at.proj.bias is not None,
        mlp_bias=mlp.fc1.bias is not None, head_bias=m.head.bias is not None,
        tied_embeddings=False, causal=False,
    )


def _layernorms() -> tuple[type, ...]:
    from timm.layers import LayerNorm

    return (LayerNorm, nn.LayerNorm)


def _is_exact_gelu(act: nn.Module) -> bool:
    from timm.layers.activations import GELU

    return (type(act) is nn.GELU and act.approximate == "none") or type(act) is GELU


# ---------------------------------------------------------------------------------------------
# Adapter


def module_from_config(config: dict, source: str) -> nn.Module:
    """Build the module a config describes: plain VisionTransformer kwargs, or a registered name."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    check_config(config, source)
    model_args = dict(config.get("model_args") or {})
    if "num_classes" in config:  # timm's hub layout keeps the head size at the top level
        model_args["num_classes"] = config["num_classes"]
    check_args(model_args, source)
    model_args.pop("weight_init", None)
    try:
        if config.get("architecture"):
            module = timm.create_model(config["architecture"], pretrained=False, **model_args)
        else:
            module = VisionTransformer(weight_init="skip", **model_args)
    except (AssertionError, TypeError, ValueError, KeyError, RuntimeError, ArithmeticError, AttributeError) as e:
        raise ModelError(f"{source}: timm could not build the model ({type(e).__name__}: {e}).") from None
    return module


def _config(model_args: dict, architecture: str | None) -> dict:
    cfg = {"family": FAMILY, "model_args": model_args}
    if architecture:
        cfg["architecture"] = architecture
    return cfg


def wrap(module: nn.Module, model_args: dict, architecture: str | None = None, name: str = "",
         path: Path | None = None, source: str = "timm VisionTransformer") -> Model:
    """A Model handle; `model_args` (+ `architecture`) must rebuild `module` when saved."""
    a = arch(module, source)
    return Model(FAMILY, a, module.eval(), _config(model_args, architecture), name=name, path=path)


def build(model_args: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    """A freshly initialised VisionTransformer (timm's own init) for tests and the model zoo."""
    source = "timm VisionTransformer config"
    check_args(model_args, source)
    json.dumps(model_args)  # the kwargs are saved as JSON: fail now rather than at save time
    with nat.seeded(seed):
        from timm.models.vision_transformer import VisionTransformer

        try:
            module = VisionTransformer(**model_args)
        except (AssertionError, TypeError, ValueError, KeyError) as e:
            raise ModelError(f"{source}: timm could not build the model ({type(e).__name__}: {e}).") from None
    return wrap(module.to(dtype), dict(model_args), source=source)


def _hub_architecture(cfg: dict) -> str | None:
    """The timm architecture name of a hub-layout config, if it is a vision_transformer model."""
    name = cfg.get("architecture")
    if "family" in cfg or not isinstance(name, str):
        return None
    import timm

    if not timm.is_model(name):
        return None
    return name if timm.models.model_entrypoint(name).__module__ == "timm.models.vision_transformer" else None


def detect(path: Path) -> bool:
    try:
        cfg = read_config(Path(path))
    except ModelError:
        return False
    if cfg.get("family") == FAMILY:
        return True
    return _hub_architecture(cfg) is not None


def load(path: Path, dtype: torch.dtype = torch.float32) -> Model:
    path = Path(path)
    source = f"Model directory {path}"
    if not path.is_dir():
        raise ModelError(f"Model path {path} is not a directory.")
    refuse_pickles(path)
    cfg = read_config(path)
    if cfg.get("family") not in (FAMILY, None):
        raise ModelError(f"{source} holds a {cfg['family']!r} model, not {FAMILY!r}.")
    hub = cfg.get("family") is None
    if hub and _hub_architecture(cfg) is None:
        raise ModelError(f"{source} does not name a timm vision_transformer architecture in config.json.")
    with torch.device("meta"):  # shapes only: nothing is allocated before the weights are known to fit
        shapes = module_from_config(cfg, source)
    arch(shapes, source)  # refuse unsupported options before reading any weights
    state = read_safetensors(path / "model.safetensors", shapes.state_dict())  # checks keys, shapes, dtypes, NaN
    module = module_from_config(cfg, source).to(dtype)  # before loading: a float32 module would round float64 weights
    module.load_state_dict(state)
    model_args = dict(cfg.get("model_args") or {})
    if hub and "num_classes" in cfg:
        model_args["num_classes"] = cfg["num_classes"]
    return wrap(module, model_args, cfg.get("architecture"), name=path.name, path=path, source=source)


def save(model: Model, path: Path) -> None:
    write_checkpoint(Path(path), model.config, dict(model.module.state_dict()))


def to_canonical(model: Model) -> Params:
    a, m = model.arch, model.module
    h, D = a.n_heads, a.d_model
    conv = m.patch_embed.proj.weight  # [D, C, p, p]
    p: Params = {
        "embed.patch.W": conv.reshape(D, -1).T,  # [C*p*p, D], (C, p, p) order as the reference's patchify
        "embed.patch.b": m.patch_embed.proj.bias,
        "embed.cls": m.cls_token.reshape(D),  # [D]
        "embed.pos": m.pos_embed.reshape(-1, D),  # [N+1, D], row 0 is the class position
    }
    for l, blk in enumerate(m.blocks):
        pre, at, mlp = f"blocks.{l}.", blk.attn, blk.mlp
        W = at.qkv.weight.T  # [D, 3*h*d], columns Q | K | V
        hd = h * a.d_head
        p |= {
            pre + "norm1.g": blk.norm1.weight, pre + "norm1.b": blk.norm1.bias,
            pre + "attn.W_Q": nat.heads_in(W[:, :hd], h),  # [h, D, d]
            pre + "attn.W_K": nat.heads_in(W[:, hd:2 * hd], h),  # [h, D, d]
            pre + "attn.W_V": nat.heads_in(W[:, 2 * hd:], h),  # [h, D, d]
            pre + "attn.W_O": nat.heads_out(at.proj.weight.T, h),  # [h, d, D]
            pre + "norm2.g": blk.norm2.weight, pre + "norm2.b": blk.norm2.bias,
            pre + "mlp.W_in": mlp.fc1.weight.T,  # [D, m]
            pre + "mlp.W_out": mlp.fc2.weight.T,  # [m, D]
        }
        if a.attn_bias:
            b = at.qkv.bias.reshape(3, h, -1)  # [3, h, d]
            p |= {pre + "attn.b_Q": b[0], pre + "attn.b_K": b[1], pre + "attn.b_V": b[2]}
        if a.out_bias:
            p[pre + "attn.b_O"] = at.proj.bias
        if a.mlp_bias:
            p |= {pre + "mlp.b_in": mlp.fc1.bias, pre + "mlp.b_out": mlp.fc2.bias}
    p |= {"norm_f.g": m.norm.weight, "norm_f.b": m.norm.bias, "head.W": m.head.weight.T}  # head.W [D, n]
    if a.head_bias:
        p["head.b"] = m.head.bias
    return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them


def from_canonical(model: Model, params: Params) -> None:
    a, m = model.arch, model.module
    conv = m.patch_embed.proj.weight
    n: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": params["embed.patch.W"].T.reshape(conv.shape),  # [D, C, p, p]
        "patch_embed.proj.bias": params["embed.patch.b"],
        "cls_token": params["embed.cls"].reshape(1, 1, -1),  # [1, 1, D]
        "pos_embed": params["embed.pos"][None],  # [1, N+1, D]
    }
    for l in range(a.n_layers):
        pre, tb = f"blocks.{l}.", f"blocks.{l}."
        n |= {
            tb + "norm1.weight": params[pre + "norm1.g"], tb + "norm1.bias": params[pre + "norm1.b"],
            tb + "attn.qkv.weight": torch.cat(
                [nat.heads_in_native(params[pre + f"attn.W_{r}"]) for r in "QKV"], 1).T,  # [3*h*d, D]
            tb + "attn.proj.weight": nat.heads_out_native(params[pre + "attn.W_O"]).T,  # [D, h*d]
            tb + "norm2.weight": params[pre + "norm2.g"], tb + "norm2.bias": params[pre + "norm2.b"],
            tb + "mlp.fc1.weight": params[pre + "mlp.W_in"].T,  # [m, D]
            tb + "mlp.fc2.weight": params[pre + "mlp.W_out"].T,  # [D, m]
        }
        if a.attn_bias:
            n[tb + "attn.qkv.bias"] = torch.cat([params[pre + f"attn.b_{r}"].reshape(-1) for r in "QKV"])  # [3*h*d]
        if a.out_bias:
            n[tb + "attn.proj.bias"] = params[pre + "attn.b_O"]
        if a.mlp_bias:
            n |= {tb + "mlp.fc1.bias": params[pre + "mlp.b_in"], tb + "mlp.fc2.bias": params[pre + "mlp.b_out"]}
    n |= {"norm.weight": params["norm_f.g"], "norm.bias": params["norm_f.b"],
          "head.weight": params["head.W"].T}  # [n, D]
    if a.head_bias:
        n["head.bias"] = params["head.b"]
    nat.copy_into(m, n)


def logits(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    """Images [B, C, H, W] -> class logits [B, n_classes]."""
    dtype = model.module.patch_embed.proj.weight.dtype
    try:
        return model.module(inputs.to(dtype))
    except AssertionError as e:  # timm asserts the image size it was built for
        raise ModelError(f"Images of shape {tuple(inputs.shape)} do not fit this ViT ({e}).") from None


ENTRY = Family(
    name=FAMILY,
    display_name=DISPLAY,
    reference="An Image is Worth 16x16 Words (ViT, ICLR 2021); timm.models.vision_transformer.VisionTransformer",
    detect=detect, load=load, save=save, to_canonical=to_canonical,
    from_canonical=from_canonical, logits=logits,
)
