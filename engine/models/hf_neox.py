"""HF GPT-NeoX / Pythia (`transformers.GPTNeoXForCausalLM`): partial RoPE, parallel residual, LayerNorm.

Native layout quirks the canonical conversion undoes:
- `nn.Linear` stores out x in, so every projection is transposed to the row-vector `x @ W` form;
- `query_key_value` is one fused projection whose output rows run PER HEAD, [h, 3, d]: q, k, v of
  head 0, then of head 1, ... (HF views the output as [B, T, h, 3d] and chunks the last axis in 3),
  unlike GPT-2's Q | K | V blocks; its bias follows the same [h, 3, d] order;
- RoPE rotates only the first r = int(d * partial_rotary_factor) dims of each head (Pythia: 25%)
  with `rotate_half` pairs (j, j + r/2) inside those r dims: Arch.rope_layout "half", rotary_dim r;
- `use_parallel_residual` (the default): x + attn(ln1(x)) + mlp(ln2(x)), both norms reading the same
  x (Arch.parallel_residual); False gives the usual sequential pre-norm block;
- `attention_bias` covers query_key_value and the output projection `dense`; the MLP and both
  LayerNorms always have biases; the unembedding (`embed_out` in hub checkpoints, `lm_head` in the
  module) is untied from `embed_in` unless tie_word_embeddings.

Float64 exactness. Stock HF GPT-NeoX builds its RoPE tables in float32, so a float64 model is only
float32-accurate. Every module this adapter hands out has its rotary embedding switched to a
subclass that computes in float64 when the input is float64 (same formula; other dtypes take HF's
own path unchanged). LayerNorm is torch's own and already exact. Nothing about the weights changes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch, Family, Model, Params
from engine.models.hf_gpt2 import ACTIVATIONS
from engine.models.io import read_config

if TYPE_CHECKING:
    from transformers import GPTNeoXConfig

FAMILY = "hf_neox"
MODEL_TYPE = "gpt_neox"
DISPLAY = "GPT-NeoX / Pythia (Hugging Face transformers)"


def arch(config: GPTNeoXConfig, source: str = "GPT-NeoX config") -> Arch:
    """The architecture summary; refuses GPT-NeoX options the canonical layout cannot express."""
    def refuse(option: str, why: str) -> None:
        raise ModelError(f"{source} uses {option}, which the engine does not support ({why}).")

    rp = nat.rope_parameters(config)
    if rp.get("rope_type", "default") != "default":
        refuse(f"rope_type={rp['rope_type']!r}", "RoPE frequency scaling; only standard RoPE is supported")
    if config.hidden_act not in ACTIVATIONS:
        refuse(f"hidden_act={config.hidden_act!r}", f"supported: {sorted(ACTIVATIONS)}")
    h = config.num_attention_heads
    d = config.hidden_size // h
    prf = float(rp.get("partial_rotary_factor", 1.0))
    r = int(d * prf)  # HF's own rounding (GPTNeoXAttention.rotary_ndims)
    if r < 2 or r % 2:
        refuse(f"partial_rotary_factor={prf}", f"it rotates {r} of the {d} dims of a head; RoPE needs an even, "
               "positive number of them")
    bias = bool(config.attention_bias)
    return Arch(
        family=FAMILY, task="lm", n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=h, n_kv_heads=h, d_head=d, d_mlp=config.intermediate_size, n_out=config.vocab_size,
        n_ctx=config.max_position_embeddings, pe="rope", rope_layout="half", rotary_dim=r,
        rope_base=float(rp.get("rope_theta", 10000.0)), norm="layernorm", norm_bias=True,
        norm_eps=config.layer_norm_eps, mlp=ACTIVATIONS[config.hidden_act], attn_bias=bias,
        out_bias=bias,  # HF's attention_bias covers the output projection `dense` too
        mlp_bias=True, head_bias=False, tied_embeddings=bool(config.tie_word_embeddings), causal=True,
        parallel_residual=bool(config.use_parallel_residual),
    )


def config_from_dict(config: dict, source: str = "The config") -> GPTNeoXConfig:
    """A GPTNeoXConfig from a config.json dict (hub names rotary_pct / rotary_emb_base included)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import GPTNeoXConfig

    try:
        return GPTNeoXConfig(**{k: v for k, v in config.items() if k != "model_type"})
    except (StrictDataclassError, TypeError, ValueError) as e:
        msg = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise ModelError(f"{source} is not a valid GPT-NeoX config ({msg}).") from None


# ---------------------------------------------------------------------------------------------
# Float64-faithful RoPE (see the module docstring)


@functools.cache
def _rotary64() -> type:
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    class Rotary64(GPTNeoXRotaryEmbedding):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
            if x.dtype != torch.float64:
                return super().forward(x, position_ids)
            r = self.inv_freq.shape[0] * 2
            base = float(self.config.rope_parameters["rope_theta"])
            inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64, device=x.device) / r)  # [r/2]
            freqs = position_ids[..., None].to(torch.float64) * inv  # [B, T, r/2]
            emb = torch.cat((freqs, freqs), -1)  # [B, T, r]: half-split pairs share a frequency
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    return Rotary64


def _make_exact(module) -> None:
    """Switch the float32-only rotary embedding to its float64-faithful subclass (same buffers)."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    for m in module.modules():
        if type(m) is GPTNeoXRotaryEmbedding:
            m.__class__ = _rotary64()


# ---------------------------------------------------------------------------------------------
# Adapter


def wrap(module, name: str = "", path: Path | None = None, source: str = "GPT-NeoX config") -> Model:
    """A Model handle around a GPTNeoXForCausalLM (checks the architecture, makes float64 exact)."""
    a = arch(module.config, source)
    _make_exact(module)
    return Model(FAMILY, a, module.eval(), module.config.to_dict(), name=name, path=path)


def build(config: GPTNeoXConfig | dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    """A freshly initialised GPT-NeoX (HF's own init) for tests."""
    from transformers import GPTNeoXForCausalLM

    if isinstance(config, dict):
        config = config_from_dict(config)
    arch(config)  # refuse before spending time on construction
    config._attn_implementation = "sdpa"  # eager attention runs softmax in float32
    with nat.seeded(seed):
        module = GPTNeoXForCausalLM(config)
    return wrap(module.to(dtype))


def detect(path: Path) -> bool:
    return nat.hf_model_type(path) == MODEL_TYPE


def load(path: Path, dtype: torch.dtype = torch.float32) -> Model:
    from transformers import GPTNeoXForCausalLM

    path = Path(path)
    if detect(path):  # refuse a bad or unsupported config in one sentence before HF reads any weights
        arch(config_from_dict(read_config(path), f"The config.json of model directory {path}"),
             f"Model directory {path}")
    module = nat.load_hf(GPTNeoXForCausalLM, path, dtype, MODEL_TYPE, DISPLAY)
    return wrap(module, name=path.name, path=path, source=f"Model directory {path}")


def save(model: Model, path: Path) -> None:
    nat.save_hf(model.module, Path(path))


def to_canonical(model: Model) -> Params:
    a, nx = model.arch, model.module.gpt_neox
    D, h = a.d_model, a.n_heads
    p: Params = {"embed.tok": nx.embed_in.weight}
    for l, layer in enumerate(nx.layers):
        pre, at, mlp = f"blocks.{l}.", layer.attention, layer.mlp
        qkv = at.query_key_value.weight.T.reshape(D, h, 3, -1)  # [D, h, 3, d]: per-head q, k, v
        p |= {
            pre + "norm1.g": layer.input_layernorm.weight, pre + "norm1.b": layer.input_layernorm.bias,
            pre + "attn.W_Q": qkv[:, :, 0].permute(1, 0, 2),  # [h, D, d]
            pre + "attn.W_K": qkv[:, :, 1].permute(1, 0, 2),  # [h, D, d]
            pre + "attn.W_V": qkv[:, :, 2].permute(1, 0, 2),  # [h, D, d]
            pre + "attn.W_O": nat.heads_out(at.dense.weight.T, h),  # [h, d, D]
            pre + "norm2.g": layer.post_attention_layernorm.weight,
            pre + "norm2.b": layer.post_attention_layernorm.bias,
            pre + "mlp.W_in": mlp.dense_h_to_4h.weight.T, pre + "mlp.b_in": mlp.dense_h_to_4h.bias,  # [D, m]
            pre + "mlp.W_out": mlp.dense_4h_to_h.weight.T, pre + "mlp.b_out": mlp.dense_4h_to_h.bias,  # [m, D]
        }
        if a.attn_bias:
            b = at.query_key_value.bias.reshape(h, 3, -1)  # [h, 3, d]
            p |= {pre + "attn.b_Q": b[:, 0], pre + "attn.b_K": b[:, 1], pre + "attn.b_V": b[:, 2],
                  pre + "attn.b_O": at.dense.bias}
    p |= {"norm_f.g": nx.final_layer_norm.weight, "norm_f.b": nx.final_layer_norm.bias}
    if not a.tied_embeddings:
        p["head.W"] = model.module.lm_head.weight.T  # [D, V]
    return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them


def from_canonical(model: Model, params: Params) -> None:
    a = model.arch
    D = a.d_model
    n: dict[str, torch.Tensor] = {"gpt_neox.embed_in.weight": params["embed.tok"]}
    for l in range(a.n_layers):
        pre, hf = f"blocks.{l}.", f"gpt_neox.layers.{l}."
        qkv = torch.stack([params[pre + f"attn.W_{r}"] for r in "QKV"], 1)  # [h, 3, D, d]
        n |= {
            hf + "input_layernorm.weight": params[pre + "norm1.g"], hf + "input_layernorm.bias": params[pre + "norm1.b"],
            hf + "attention.query_key_value.weight": qkv.permute(0, 1, 3, 2).reshape(-1, D),  # [h*3*d, D]
            hf + "attention.dense.weight": nat.heads_out_native(params[pre + "attn.W_O"]).T,  # [D, h*d]
            hf + "post_attention_layernorm.weight": params[pre + "norm2.g"],
            hf + "post_attention_layernorm.bias": params[pre + "norm2.b"],
            hf + "mlp.dense_h_to_4h.weight": params[pre + "mlp.W_in"].T, hf + "mlp.dense_h_to_4h.bias": params[pre + "mlp.b_in"],
            hf + "mlp.dense_4h_to_h.weight": params[pre + "mlp.W_out"].T, hf + "mlp.dense_4h_to_h.bias": params[pre + "mlp.b_out"],
        }
        if a.attn_bias:
            n[hf + "attention.query_key_value.bias"] = torch.stack(
                [params[pre + f"attn.b_{r}"] for r in "QKV"], 1).reshape(-1)  # [h, 3, d] -> [h*3*d]
            n[hf + "attention.dense.bias"] = params[pre + "attn.b_O"]
    n |= {"gpt_neox.final_layer_norm.weight": params["norm_f.g"], "gpt_neox.final_layer_norm.bias": params["norm_f.b"]}
    if not a.tied_embeddings:  # tied: lm_head.weight is embed_in.weight, already written above
        n["lm_head.weight"] = params["head.W"].T  # [V, D]
    nat.copy_into(model.module, n)


logits = nat.causal_lm_logits


ENTRY = Family(
    name=FAMILY,
    display_name=DISPLAY,
    reference="GPT-NeoX-20B (2022); Pythia (2023); RoPE: RoFormer (2021); transformers.GPTNeoXForCausalLM",
    detect=detect, load=load, save=save, to_canonical=to_canonical,
    from_canonical=from_canonical, logits=logits,
)
