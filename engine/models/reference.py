"""The reference family: a causal LM and a ViT classifier sharing one pre-norm block.

The controlled instrument for comparing positional encodings: `pe` in {none, learned, sinusoidal,
rope} (RoPE pairing interleaved or half-split, optionally partial), `norm` in {layernorm, rmsnorm},
`mlp` in {gelu, gelu_tanh, relu, silu, swiglu, geglu}, optional biases (all of them, or on Q, K and V alone as
in Qwen2), a sequential or parallel (GPT-NeoX) residual, and QK-norm (a per-head RMSNorm on queries and
keys before RoPE, one gain [d_head] each per layer, as in Qwen3). Everything but the chosen options
is identical across variants. Parameters are stored directly in the canonical head-explicit layout
(engine/models/base.py), so `to_canonical` is the state dict itself.

Saved as config.json + model.safetensors; a reload is bit-identical.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelError
from engine.models.base import GATED_MLPS, MLP_KINDS, NORM_KINDS, PE_KINDS, ROPE_LAYOUTS, Arch, Family, Model, Params
from engine.models.io import check_dataclass_fields

FAMILY = "reference"


@dataclass(frozen=True)
class RefConfig:
    task: str = "lm"  # "lm" | "vit"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads
    d_head: int = 0  # 0: d_model // n_heads
    d_mlp: int = 512
    vocab_size: int = 256  # LM only
    n_ctx: int = 128  # LM context; ViT derives it from the image
    pe: str = "rope"
    rope_layout: str = "interleaved"
    rotary_dim: int = 0  # 0: the whole head
    rope_base: float = 10000.0
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    bias: bool = False  # attention and MLP biases (and LayerNorm bias when norm == layernorm)
    qkv_bias: bool = False  # biases on Q, K and V even without `bias` (Qwen2: none on the output or the MLP)
    head_bias: bool = False
    tied_embeddings: bool = False  # LM only
    image_size: int = 8  # ViT only
    patch_size: int = 2
    in_chans: int = 1
    n_classes: int = 10
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)): both branches read the same x
    qk_norm: bool = False  # RMSNorm over each head's q and k (gains [d_head] shared by the heads), before RoPE
    rope_scaling: str = ""  # a RoPE frequency scaling (rope_scaling(); ROPE_SCALINGS), "" for standard RoPE
    embed_scale: float = 1.0  # LM: the token embedding times this as it enters the stream (Gemma: sqrt(D)); not the head

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ModelError(f"Reference config: {msg}.")

        check_dataclass_fields(self, "Reference config", nonneg=("norm_eps", "rope_base"), positive=(
            "n_layers", "d_model", "n_heads", "d_mlp", "vocab_size", "n_ctx", "image_size",
            "patch_size", "in_chans", "n_classes"))  # types and ranges first: "4" or 0 heads, by name
        need(self.pe != "rope" or self.rope_base > 0, f"rope_base must be positive with RoPE, not {self.rope_base}")
        need(isinstance(self.embed_scale, (int, float)) and not isinstance(self.embed_scale, bool)
             and math.isfinite(self.embed_scale) and self.embed_scale > 0,
             f"embed_scale must be a positive finite number, not {self.embed_scale!r}")
        need(self.embed_scale == 1 or self.task == "lm", "embed_scale scales token embeddings: an LM's only")

        need(self.task in ("lm", "vit"), f"task must be lm or vit, not {self.task!r}")
        need(self.pe in PE_KINDS, f"pe must be one of {PE_KINDS}, not {self.pe!r}")
        need(self.norm in NORM_KINDS, f"norm must be one of {NORM_KINDS}, not {self.norm!r}")
        need(self.mlp in MLP_KINDS, f"mlp must be one of {MLP_KINDS}, not {self.mlp!r}")
        need(self.rope_layout in ROPE_LAYOUTS, f"rope_layout must be one of {ROPE_LAYOUTS}")
        need(self.d_head > 0 or self.d_model % self.n_heads == 0,
             f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        need(self.heads % self.kv_heads == 0, f"n_heads {self.heads} is not a multiple of n_kv_heads {self.kv_heads}")
        need(self.rot_dim % 2 == 0 and self.rot_dim <= self.head_dim,
             f"rotary_dim {self.rot_dim} must be even and at most d_head {self.head_dim}")
        need(self.pe != "sinusoidal" or self.d_model % 2 == 0, "sinusoidal PE needs an even d_model")
        need(self.task == "lm" or self.image_size % self.patch_size == 0,
             f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        need(self.task == "vit" or self.vocab_size >= 1, "vocab_size must be positive")
        need(not self.rope_scaling or self.pe == "rope", "rope_scaling applies to RoPE only")
        if self.rope_scaling:
            try:
                p = json.loads(self.rope_scaling)
                ok = p["rope_type"] in ROPE_SCALINGS and all(float(p[k]) > 0 for k in ROPE_SCALINGS[p["rope_type"]])
            except (ValueError, TypeError, KeyError, AttributeError):
                ok = False
            need(ok, f"rope_scaling must name one of {sorted(ROPE_SCALINGS)} with its positive parameters, not "
                     f"{self.rope_scaling[:200]!r}")
        need(not self.qk_norm or (self.pe == "rope" and self.rot_dim == self.head_dim),
             "qk_norm needs RoPE on the whole head (as in Qwen3), the only QK-norm layout with a symmetry spec")

    heads = property(lambda s: s.n_heads)
    kv_heads = property(lambda s: s.n_kv_heads or s.n_heads)
    head_dim = property(lambda s: s.d_head or s.d_model // s.n_heads)
    rot_dim = property(lambda s: (s.rotary_dim or s.head_dim) if s.pe == "rope" else 0)
    n_patches = property(lambda s: (s.image_size // s.patch_size) ** 2)
    seq_len = property(lambda s: s.n_ctx if s.task == "lm" else s.n_patches + 1)
    n_out = property(lambda s: s.vocab_size if s.task == "lm" else s.n_classes)

    def to_dict(self) -> dict:
        # qk_norm, rope_scaling and embed_scale only when set, so that configs without them (the zoo's) read and
        # compare as they were written
        unset = {"qk_norm": False, "rope_scaling": "", "embed_scale": 1.0}
        return {"family": FAMILY, **{k: v for k, v in asdict(self).items() if k not in unset or v != unset[k]}}

    @classmethod
    def from_dict(cls, d: dict) -> RefConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"family"}
        if unknown:
            raise ModelError(f"Reference config has unknown fields {sorted(unknown)}.")
        return cls(**{k: v for k, v in d.items() if k in known})

    def arch(self) -> Arch:
        return Arch(
            family=FAMILY, task=self.task, n_layers=self.n_layers, d_model=self.d_model,
            n_heads=self.heads, n_kv_heads=self.kv_heads, d_head=self.head_dim, d_mlp=self.d_mlp,
            n_out=self.n_out, n_ctx=self.seq_len, pe=self.pe,
            rope_layout=self.rope_layout if self.pe == "rope" else None, rotary_dim=self.rot_dim,
            rope_base=self.rope_base, norm=self.norm, norm_bias=self.bias and self.norm == "layernorm",
            norm_eps=self.norm_eps, mlp=self.mlp, attn_bias=self.bias or self.qkv_bias, out_bias=self.bias,
            mlp_bias=self.bias, head_bias=self.head_bias,
            tied_embeddings=self.tied_embeddings and self.task == "lm", causal=self.task == "lm",
            parallel_residual=self.parallel_residual, qk_norm=self.qk_norm, rope_scaling=self.rope_scaling,
            embed_scale=float(self.embed_scale),
        )


# ---------------------------------------------------------------------------------------------
# Positional encodings


def sinusoidal_table(n_pos: int, d: int, dtype=torch.float32) -> torch.Tensor:
    """Attention Is All You Need (2017): P[t, 2i] = sin(t / 10000^(2i/d)), P[t, 2i+1] = cos(...)."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]  # [T, 1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    P = torch.zeros(n_pos, d, dtype=torch.float64)
    P[:, 0::2] = torch.sin(pos * inv)
    P[:, 1::2] = torch.cos(pos * inv)
    return P.to(dtype)  # [T, d]


# Frequency scalings the reference family computes, as HF's rope_parameters name them, with the parameters each reads
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_scaling(params: dict) -> str:
    """The canonical form of a RoPE frequency scaling (Arch.rope_scaling, RefConfig.rope_scaling): the
    rope_parameters that set the frequencies beyond the base, as sorted JSON; "" for standard RoPE."""
    kind = params.get("rope_type", "default")
    if kind == "default":
        return ""
    return json.dumps({"rope_type": kind, **{k: params[k] for k in ROPE_SCALINGS[kind]}}, sort_keys=True)


def rope_frequencies(rot_dim: int, base: float, scaling: str = "") -> torch.Tensor:
    """omega_j = base^(-2j / r), j < r/2 (RoFormer): distinct, in (0, 1]; then the frequency scaling, in
    float64: linear (every omega_j / factor) or Llama 3's (wavelengths beyond original_max / low_freq_factor
    divided by factor, below original_max / high_freq_factor kept, a smooth blend between). Scaled
    frequencies stay distinct, so the RoPE group (one complex scalar per pair) is the same."""
    w = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)  # [r/2]
    if not scaling:
        return w
    p = json.loads(scaling)
    factor = float(p["factor"])
    if p["rope_type"] == "linear":
        return w / factor
    n, lo, hi = float(p["original_max_position_embeddings"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    wavelen = 2 * math.pi / w
    scaled = torch.where(wavelen > n / lo, w / factor, w)
    smooth = (n / wavelen - lo) / (hi - lo)
    medium = ~(wavelen < n / hi) & ~(wavelen > n / lo)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_pairs(rot_dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (first, second) of the coordinates of each frequency pair j (docs/MATH.md section 1)."""
    j = torch.arange(rot_dim // 2)
    if layout == "interleaved":
        return 2 * j, 2 * j + 1  # (2j, 2j+1): RoFormer, GPT-J
    return j, j + rot_dim // 2  # (j, j + r/2): rotate_half, HF Llama / NeoX


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate pair j of every position t by angle t * omega_j; x [B, h, T, r], cos/sin [T, r/2].

    The pairs of `rope_pairs`, read as views (no index gathers): (2j, 2j+1) interleaved, (j, j + r/2)
    in the half layout. Computed in the wider of the two dtypes, rounded back to x's: under bfloat16
    autocast q/k arrive in bfloat16 while the tables follow the (float32) residual stream.
    """
    n = cos.shape[-1]
    ct = torch.promote_types(x.dtype, cos.dtype)
    if layout == "interleaved":
        pairs = x.unflatten(-1, (n, 2))  # [B, h, T, r/2, 2]
        a, b = pairs[..., 0].to(ct), pairs[..., 1].to(ct)  # [B, h, T, r/2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)  # [B, h, T, r]
    a, b = x[..., :n].to(ct), x[..., n:].to(ct)  # [B, h, T, r/2]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)  # [B, h, T, r]


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], r: int, layout: str) -> torch.Tensor:
    """RoPE on the first r dims of every head [B, h, T, d]; the other d - r pass through (partial rotary)."""
    if r == x.shape[-1]:
        return apply_rope(x, *rope, layout)
    return torch.cat([apply_rope(x[..., :r], *rope, layout), x[..., r:]], -1)


# ---------------------------------------------------------------------------------------------
# Modules (parameter names are the canonical keys)


class Norm(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.g = nn.Parameter(torch.ones(cfg.d_model))
        self.b = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.norm == "layernorm" and cfg.bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], self.g, self.b, self.eps)
        # x g / sqrt(mean(x^2) + eps): one reduction and two products (CPU F.rms_norm makes five passes)
        r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + self.eps)  # [..., 1]
        y = x * r
        return y * self.g if torch.is_grad_enabled() else y.mul_(self.g)  # in place only where nothing is traced


def head_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """QK-norm: RMSNorm over the last (head) axis of q or k [..., d], times the gain g [d] (Qwen3's q_norm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


class HeadNorm(nn.Module):
    """The gain of a QK-norm (parameter `g` [d_head], shared by every head of the layer)."""

    def __init__(self, d: int):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))


class Attention(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        D, h, hkv, d = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.W_Q = nn.Parameter(torch.empty(h, D, d))
        self.W_K = nn.Parameter(torch.empty(hkv, D, d))
        self.W_V = nn.Parameter(torch.empty(hkv, D, d))
        self.W_O = nn.Parameter(torch.empty(h, d, D))
        if cfg.bias or cfg.qkv_bias:
            self.b_Q = nn.Parameter(torch.zeros(h, d))
            self.b_K = nn.Parameter(torch.zeros(hkv, d))
            self.b_V = nn.Parameter(torch.zeros(hkv, d))
        if cfg.bias:
            self.b_O = nn.Parameter(torch.zeros(D))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = HeadNorm(d), HeadNorm(d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        cfg = self.cfg
        B, T = x.shape[:2]
        h, hkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        # one product for q, k and v: the [n, D, d] weights side by side as [D, (h + 2 h_kv) d]
        W = torch.cat([self.W_Q, self.W_K, self.W_V]).permute(1, 0, 2).flatten(1)  # [D, (h+2h_kv)*d]
        bias = torch.cat([self.b_Q, self.b_K, self.b_V]).flatten() if cfg.bias or cfg.qkv_bias else None  # [(h+2h_kv)*d]
        qkv = F.linear(x, W.T, bias).view(B, T, h + 2 * hkv, d).transpose(1, 2)  # [B, h+2h_kv, T, d]
        q, k, v = qkv.split([h, hkv, hkv], 1)  # [B, h, T, d], [B, h_kv, T, d] x 2
        if cfg.qk_norm:  # before RoPE, as in Qwen3
            q, k = head_norm(q, self.q_norm.g, cfg.norm_eps), head_norm(k, self.k_norm.g, cfg.norm_eps)
        if rope is not None:
            q, k = rotate(q, rope, cfg.rot_dim, cfg.rope_layout), rotate(k, rope, cfg.rot_dim, cfg.rope_layout)
        if hkv != h:  # grouped-query: query head i reads KV group i // (h / h_kv)
            rep = h // hkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, h, T, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=cfg.task == "lm")  # [B, h, T, d]
        o = o.transpose(1, 2).reshape(B, T, h * d)  # [B, T, h*d]
        return F.linear(o, self.W_O.flatten(0, 1).T, self.b_O if cfg.bias else None)  # [B, T, D]


def mlp_activation(kind: str, u: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's hidden activations from its pre-activations u (and, for a gated MLP, the gate's)."""
    if kind == "swiglu":
        return F.silu(gate) * u
    if kind == "geglu":
        return F.gelu(gate, approximate="tanh") * u
    if kind == "gelu":
        return F.gelu(u)
    if kind == "gelu_tanh":
        return F.gelu(u, approximate="tanh")
    if kind == "relu":
        return F.relu(u)
    return F.silu(u)


class MLP(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        D, m = cfg.d_model, cfg.d_mlp
        self.kind, self.bias = cfg.mlp, cfg.bias
        self.W_in = nn.Parameter(torch.empty(D, m))
        if cfg.mlp in GATED_MLPS:
            self.W_gate = nn.Parameter(torch.empty(D, m))
        self.W_out = nn.Parameter(torch.empty(m, D))
        if cfg.bias:
            self.b_in = nn.Parameter(torch.zeros(m))
            self.b_out = nn.Parameter(torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.linear(x, self.W_in.T, self.b_in if self.bias else None)  # [B, T, m], the bias added by the product
        a = mlp_activation(self.kind, u, x @ self.W_gate if self.kind in GATED_MLPS else None)
        return F.linear(a, self.W_out.T, self.b_out if self.bias else None)  # [B, T, D]


class Block(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.norm1, self.attn = Norm(cfg), Attention(cfg)
        self.norm2, self.mlp = Norm(cfg), MLP(cfg)
        self.parallel = cfg.parallel_residual

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX order of the sum: mlp + attn + x
            return self.mlp(self.norm2(x)) + self.attn(self.norm1(x), rope) + x
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        D = cfg.d_model
        if cfg.task == "lm":
            self.tok = nn.Parameter(torch.empty(cfg.vocab_size, D))
        else:
            self.patch = nn.ParameterDict({
                "W": nn.Parameter(torch.empty(cfg.in_chans * cfg.patch_size**2, D)),
                "b": nn.Parameter(torch.zeros(D)),
            })
            self.cls = nn.Parameter(torch.zeros(D))
        if cfg.pe == "learned":
            self.pos = nn.Parameter(torch.empty(cfg.seq_len, D))


class Head(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        if not (cfg.task == "lm" and cfg.tied_embeddings):
            self.W = nn.Parameter(torch.empty(cfg.d_model, cfg.n_out))
        if cfg.head_bias:
            self.b = nn.Parameter(torch.zeros(cfg.n_out))


def tables(cfg: RefConfig) -> dict[str, torch.Tensor]:
    """The model's fixed (non-learned) buffers: the sinusoidal PE table or the RoPE angle tables."""
    if cfg.pe == "sinusoidal":
        return {"pos_sin": sinusoidal_table(cfg.seq_len, cfg.d_model)}
    if cfg.pe == "rope":
        w = rope_frequencies(cfg.rot_dim, cfg.rope_base, cfg.rope_scaling)  # [r/2]
        ang = torch.arange(cfg.seq_len, dtype=torch.float64)[:, None] * w  # [T, r/2]
        # Kept in float64: `.to(dtype)` rounds them for float32 models, while float64 models get
        # exact tables (needed to match other RoPE implementations to 1e-10).
        return {"rope_cos": ang.cos(), "rope_sin": ang.sin()}
    return {}


class Transformer(nn.Module):
    """Reference LM (inputs [B, T] token ids) or ViT (inputs [B, C, H, W] images) -> logits."""

    def __init__(self, cfg: RefConfig, init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = Norm(cfg)
        self.head = Head(cfg)
        for k, v in tables(cfg).items():
            self.register_buffer(k, v, persistent=False)
        if init:  # init=False leaves the parameters as allocated (uninitialised): they are about to be loaded
            self.reset_parameters(torch.Generator().manual_seed(0))

    def reset_parameters(self, g: torch.Generator) -> None:
        """GPT-2 style init: N(0, 0.02), residual writers scaled by 1/sqrt(2 n_layers)."""
        std, std_out = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith((".g",)):
                    p.fill_(1.0)
                elif name.split(".")[-1].startswith("b") or name == "embed.cls":
                    p.zero_()
                else:
                    s = std_out if name.endswith(("W_O", "W_out")) else std
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * s)

    def embed_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.task == "lm":
            x = self.embed.tok[inputs]  # [B, T, D]
            if cfg.embed_scale != 1:  # as Gemma: the scale in the weights' dtype, the head reading E unscaled
                x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype, device=x.device)
        else:
            B, C, H, W = inputs.shape
            p = cfg.patch_size
            patches = inputs.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)  # [B, H/p, W/p, C, p, p]
            patches = patches.reshape(B, (H // p) * (W // p), C * p * p)  # [B, N, P]
            x = patches.to(self.embed.patch["W"].dtype) @ self.embed.patch["W"] + self.embed.patch["b"]  # [B, N, D]
            x = torch.cat([self.embed.cls.expand(B, 1, -1), x], 1)  # [B, N + 1, D]
        T = x.shape[1]
        if cfg.pe == "learned":
            x = x + self.embed.pos[:T]
        elif cfg.pe == "sinusoidal":
            x = x + self.pos_sin[:T].to(x.dtype)
        return x

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embed_inputs(inputs)
        T = x.shape[1]
        if T > self.cfg.seq_len:
            raise ModelError(f"Input length {T} exceeds the model's context of {self.cfg.seq_len}.")
        rope = self.rope_tables(x)
        for block in self.blocks:
            x = block(x, rope)
        return self.readout(x)

    def rope_tables(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [T, r/2] for the positions of x [B, T, D] in x's dtype; None without RoPE."""
        if self.cfg.pe != "rope":
            return None
        T = x.shape[1]
        return self.rope_cos[:T].to(x.dtype), self.rope_sin[:T].to(x.dtype)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the last block's output: the final norm, the class token (ViT), the head."""
        x = self.norm_f(x)
        if self.cfg.task == "vit":
            x = x[:, 0]  # [B, D] class token
        W = self.embed.tok.T if self.cfg.task == "lm" and self.cfg.tied_embeddings else self.head.W
        logits = x @ W
        return logits + self.head.b if self.cfg.head_bias else logits


# ---------------------------------------------------------------------------------------------
# Adapter


def build(cfg: RefConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    module = Transformer(cfg, init=False)
    module.reset_parameters(torch.Generator().manual_seed(seed))
    module.to(dtype)
    return Model(FAMILY, cfg.arch(), module, cfg.to_dict())


def detect(path: Path) -> bool:
    from engine.models.io import read_config

    try:
        return read_config(Path(path)).get("family") == FAMILY
    except ModelError:
        return False


def load(path: Path, dtype: torch.dtype = torch.float32) -> Model:
    from engine.models.io import read_config, read_safetensors

    path = Path(path)
    cfg = RefConfig.from_dict(read_config(path))
    with torch.device("meta"):  # shapes only: a config far larger than its weights is refused unallocated
        expected = Transformer(cfg, init=False).state_dict()
    state = read_safetensors(path / "model.safetensors", expected)
    module = Transformer(cfg, init=False).to(dtype)  # before loading: a float32 module would round float64 weights
    module.load_state_dict(state)
    return Model(FAMILY, cfg.arch(), module, cfg.to_dict(), name=path.name, path=path)


def save(model: Model, path: Path) -> None:
    from engine.models.io import write_checkpoint

    write_checkpoint(Path(path), model.config, dict(model.module.state_dict()))


def module_from_params(cfg: RefConfig, params: Params) -> Transformer:
    """A module whose parameters ARE the tensors of `params` (views of another model's storage, say):
    nothing is allocated or initialised but its fixed tables, in the parameters' dtype and device."""
    ref = next(iter(params.values()))
    with torch.device("meta"):
        module = Transformer(cfg, init=False)
    module.load_state_dict({k: v.detach() for k, v in params.items()}, strict=True, assign=True)
    for k, v in tables(cfg).items():
        setattr(module, k, v.to(dtype=ref.dtype, device=ref.device))
    return module


def to_canonical(model: Model) -> Params:
    return {k: v.detach() for k, v in model.module.state_dict().items()}  # views: engine.models.canonical copies them


def from_canonical(model: Model, params: Params) -> None:
    with torch.no_grad():
        for k, v in model.module.state_dict().items():
            v.copy_(params[k])


def logits(model: Model, inputs: torch.Tensor) -> torch.Tensor:
    return model.module(inputs)


ENTRY = Family(
    name=FAMILY,
    display_name="Reference Transformer (PE-switchable)",
    reference="Pre-norm Transformer (GPT-2 / ViT style); RoPE: RoFormer (2021); sinusoidal: Attention Is All You Need (2017)",
    detect=detect, load=load, save=save, to_canonical=to_canonical,
    from_canonical=from_canonical, logits=logits,
)
