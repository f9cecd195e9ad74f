"""HF Llama (`transformers.LlamaForCausalLM`): RoPE (half-split pairs), RMSNorm, SwiGLU, GQA.

Native layout quirks the canonical conversion undoes:
- `nn.Linear` stores out x in, so every projection is transposed to the row-vector `x @ W` form;
- `rotate_half` pairs coordinate j with j + d/2 (docs/MATH.md section 1): Arch.rope_layout "half";
- grouped-query attention: k_proj/v_proj have n_kv_heads heads, query head i reads KV head
  i // (n_heads / n_kv_heads) (HF's repeat_kv), the same convention as the reference family;
- SwiGLU `down(silu(gate(x)) * up(x))`: gate_proj -> W_gate, up_proj -> W_in, down_proj -> W_out.
  With mlp_bias the gate has a bias too; the canonical key for it is `mlp.b_gate` [m].

Float64 exactness. Stock HF Llama normalises in float32 (LlamaRMSNorm casts up to float32, which
for a float64 input is a cast down) and builds its RoPE tables in float32, so a float64 model is
only float32-accurate and no symmetry check could reach 1e-10. Every module this adapter hands out
has those two submodules switched to subclasses that compute in float64 when the input is float64
(same formulas; other dtypes take HF's own path unchanged). Nothing about the weights changes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch, Family, Model, Params

if TYPE_CHECKING:
    from transformers import LlamaConfig

FAMILY = "hf_llama"
MODEL_TYPE = "llama"
DISPLAY = "Llama (Hugging Face transformers)"


def arch(config: LlamaConfig, source: str = "Llama config") -> Arch:
    """The architecture summary; refuses Llama options the canonical layout cannot express."""
    def refuse(option: str, why: str) -> None:
        raise ModelError(f"{source} uses {option}, which the engine does not support ({why}).")

    rp = nat.rope_parameters(config)
    if rp.get("rope_type", "default") != "default":
        refuse(f"rope_type={rp['rope_type']!r}", "RoPE frequency scaling; only standard RoPE is supported")
    if config.hidden_act != "silu":
        refuse(f"hidden_act={config.hidden_act!r}", "the gated MLP must be SwiGLU (silu)")
    h, hkv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // h
    return Arch(
        family=FAMILY, task="lm", n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=h, n_kv_heads=hkv, d_head=d, d_mlp=config.intermediate_size, n_out=config.vocab_size,
        n_ctx=config.max_position_embeddings, pe="rope", rope_layout="half", rotary_dim=d,
        rope_base=float(rp.get("rope_theta", 10000.0)), norm="rmsnorm", norm_bias=False,
        norm_eps=config.rms_norm_eps, mlp="swiglu", attn_bias=bool(config.attention_bias),
        out_bias=bool(config.attention_bias),  # HF's attention_bias covers o_proj too
        mlp_bias=bool(config.mlp_bias), head_bias=False,
        tied_embeddings=bool(config.tie_word_embeddings), causal=True,
    )


# ---------------------------------------------------------------------------------------------
# Float64-faithful RMSNorm and RoPE (see the module docstring)


@functools.cache
def _exact_classes() -> tuple[type, type]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    class RMSNorm64(LlamaRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float64:
                return super().forward(x)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    class Rotary64(LlamaRotaryEmbedding):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
            if x.dtype != torch.float64:
                return super().forward(x, position_ids)
            d = self.inv_freq.shape[0] * 2
            base = float(self.config.rope_parameters["rope_theta"])
            inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)  # [d/2]
            freqs = position_ids[..., None].to(torch.float64) * inv  # [B, T, d/2]
            emb = torch.cat((freqs, freqs), -1)  # [B, T, d]: half-split pairs share a frequency
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    return RMSNorm64, Rotary64


def _make_exact(module) -> None:
    """Switch the float32-only submodules to their float64-faithful subclasses (same parameters)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    RMSNorm64, Rotary64 = _exact_classes()
    for m in module.modules():
        if type(m) is LlamaRMSNorm:
            m.__class__ = RMSNorm64
        elif type(m) is LlamaRotaryEmbedding:
            m.__class__ = Rotary64


# ---------------------------------------------------------------------------------------------
# Adapter


def wrap(module, name: str = "", path: Path | None = None, source: str = "Llama config") -> Model:
    """A Model handle around a LlamaForCausalLM (checks the architecture, makes float64 exact)."""
    a = arch(module.config, source)
    _make_exact(module)
    return Model(FAMILY, a, module.eval(), module.config.to_dict(), name=name, path=path)


def build(config: LlamaConfig | dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    """A freshly initialised Llama (HF's own init) for tests and the model zoo."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if isinstance(config, dict):
        config = LlamaConfig(**config)
    arch(config)  # refuse before spending time on construction
    config._attn_implementation = "sdpa"  # eager attention runs softmax in float32
    with nat.seeded(seed):
        module = LlamaForCausalLM(config)
    return wrap(module.to(dtype))


def detect(path: Path) -> bool:
    return nat.hf_model_type(path) == MODEL_TYPE


def load(path: Path, dtype: torch.dtype = torch.float32) -> Model:
    from transformers import LlamaForCausalLM

    path = Path(path)
    module = nat.load_hf(LlamaForCausalLM, path, dtype, MODEL_TYPE, DISPLAY)
    return wrap(module, name=path.name, path=path, source=f"Model directory {path}")


def save(model: Model, path: Path) -> None:
    nat.save_hf(model.module, Path(path))


def to_canonical(model: Model) -> Params:
    a, lm = model.arch, model.module.model
    h, hkv = a.n_heads, a.n_kv_heads
    p: Params = {"embed.tok": lm.embed_tokens.weight}
    for l, layer in enumerate(lm.layers):
        pre, at, mlp = f"blocks.{l}.", layer.self_attn, layer.mlp
        p |= {
            pre + "norm1.g": layer.input_layernorm.weight,
            pre + "attn.W_Q": nat.heads_in(at.q_proj.weight.T, h),  # [h, D, d]
            pre + "attn.W_K": nat.heads_in(at.k_proj.weight.T, hkv),  # [h_kv, D, d]
            pre + "attn.W_V": nat.heads_in(at.v_proj.weight.T, hkv),  # [h_kv, D, d]
            pre + "attn.W_O": nat.heads_out(at.o_proj.weight.T, h),  # [h, d, D]
            pre + "norm2.g": layer.post_attention_layernorm.weight,
            pre + "mlp.W_in": mlp.up_proj.weight.T,  # [D, m]
            pre + "mlp.W_gate": mlp.gate_proj.weight.T,  # [D, m]
            pre + "mlp.W_out": mlp.down_proj.weight.T,  # [m, D]
        }
        if a.attn_bias:
            p |= {
                pre + "attn.b_Q": at.q_proj.bias.reshape(h, -1),  # [h, d]
                pre + "attn.b_K": at.k_proj.bias.reshape(hkv, -1),  # [h_kv, d]
                pre + "attn.b_V": at.v_proj.bias.reshape(hkv, -1),  # [h_kv, d]
                pre + "attn.b_O": at.o_proj.bias,
            }
        if a.mlp_bias:
            p |= {pre + "mlp.b_in": mlp.up_proj.bias, pre + "mlp.b_gate": mlp.gate_proj.bias,
                  pre + "mlp.b_out": mlp.down_proj.bias}
    p["norm_f.g"] = lm.norm.weight
    if not a.tied_embeddings:
        p["head.W"] = model.module.lm_head.weight.T  # [D, V]
    return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them


def from_canonical(model: Model, params: Params) -> None:
    a = model.arch
    n: dict[str, torch.Tensor] = {"model.embed_tokens.weight": params["embed.tok"]}
    for l in range(a.n_layers):
        pre, at, mlp = f"blocks.{l}.", f"model.layers.{l}.self_attn.", f"model.layers.{l}.mlp."
        n |= {
            f"model.layers.{l}.input_layernorm.weight": params[pre + "norm1.g"],
            at + "q_proj.weight": nat.heads_in_native(params[pre + "attn.W_Q"]).T,  # [h*d, D]
            at + "k_proj.weight": nat.heads_in_native(params[pre + "attn.W_K"]).T,  # [h_kv*d, D]
            at + "v_proj.weight": nat.heads_in_native(params[pre + "attn.W_V"]).T,  # [h_kv*d, D]
            at + "o_proj.weight": nat.heads_out_native(params[pre + "attn.W_O"]).T,  # [D, h*d]
            f"model.layers.{l}.post_attention_layernorm.weight": params[pre + "norm2.g"],
            mlp + "up_proj.weight": params[pre + "mlp.W_in"].T,  # [m, D]
            mlp + "gate_proj.weight": params[pre + "mlp.W_gate"].T,  # [m, D]
            mlp + "down_proj.weight": params[pre + "mlp.W_out"].T,  # [D, m]
        }
        if a.attn_bias:
            n |= {at + f"{r.lower()}_proj.bias": params[pre + f"attn.b_{r}"].reshape(-1) for r in "QKV"}  # [h*d]
            n[at + "o_proj.bias"] = params[pre + "attn.b_O"]
        if a.mlp_bias:
            n |= {mlp + "up_proj.bias": params[pre + "mlp.b_in"], mlp + "gate_proj.bias": params[pre + "mlp.b_gate"],
                  mlp + "down_proj.bias": params[pre + "mlp.b_out"]}
    n["model.norm.weight"] = params["norm_f.g"]
    if not a.tied_embeddings:  # tied: lm_head.weight is embed_tokens.weight, already written above
        n["lm_head.weight"] = params["head.W"].T  # [V, D]
    nat.copy_into(model.module, n)


logits = nat.causal_lm_logits


ENTRY = Family(
    name=FAMILY,
    display_name=DISPLAY,
    reference="LLaMA (2023); RoPE: RoFormer (2021); transformers.LlamaForCausalLM",
    detect=detect, load=load, save=save, to_canonical=to_canonical,
    from_canonical=from_canonical, logits=logits,
)
