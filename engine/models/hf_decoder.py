"""HF decoders in the Llama layout (Llama, Qwen2, Qwen3, Mistral): one adapter, parametrised by a `LlamaLayout`.

These families share the module tree `model.embed_tokens`, `model.layers[i].{input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `model.norm`, `lm_head`,
and the maths: RMSNorm, RoPE with half-split pairs, SwiGLU, grouped-query attention. They differ in
which projections carry biases, whether attention may slide, whether queries and keys are normalised
per head before RoPE (QK-norm: `self_attn.q_norm`, `self_attn.k_norm`, Qwen3), and their transformers
classes; a family's adapter file names those in one `LlamaLayout` and exposes its bound methods.

Native layout quirks the canonical conversion undoes:
- `nn.Linear` stores out x in, so every projection is transposed to the row-vector `x @ W` form;
- `rotate_half` pairs coordinate j with j + d/2 (docs/MATH.md section 1): Arch.rope_layout "half";
- grouped-query attention: k_proj/v_proj have n_kv_heads heads, query head i reads KV head
  i // (n_heads / n_kv_heads) (HF's repeat_kv), the same convention as the reference family;
- SwiGLU `down(silu(gate(x)) * up(x))`: gate_proj -> W_gate, up_proj -> W_in, down_proj -> W_out.
  With an MLP bias the gate has a bias too; the canonical key for it is `mlp.b_gate` [m].
- QK-norm: q_norm.weight, k_norm.weight [d] -> attn.q_norm.g, attn.k_norm.g (one gain per layer, shared
  by every head).

Float64 exactness. Stock HF normalises in float32 (its RMSNorm casts up to float32, which for a
float64 input is a cast down) and builds its RoPE tables in float32, so a float64 model is only
float32-accurate and no symmetry check could reach 1e-10. Every module this adapter hands out has
those two submodules switched to subclasses that compute in float64 when the input is float64 (same
formulas; other dtypes take HF's own path unchanged); the QK-norms are RMSNorm modules of the same
class and are switched too. Nothing about the weights changes.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelError
from engine.models import native as nat
from engine.models.base import Arch, Family, Model, Params

# ---------------------------------------------------------------------------------------------
# Float64-faithful RMSNorm and RoPE (see the module docstring)


@functools.cache
def _hf_classes(model_type: str, prefix: str) -> tuple[type, type]:
    """transformers' RMSNorm and rotary-embedding classes of one family, e.g. LlamaRMSNorm."""
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return getattr(mod, f"{prefix}RMSNorm"), getattr(mod, f"{prefix}RotaryEmbedding")


@functools.cache
def _exact_classes(model_type: str, prefix: str) -> tuple[type, type]:
    RMSNorm, Rotary = _hf_classes(model_type, prefix)

    class RMSNorm64(RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float64:
                return super().forward(x)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    class Rotary64(Rotary):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
            if x.dtype != torch.float64:
                return super().forward(x, position_ids)
            d = self.inv_freq.shape[0] * 2
            base = float(self.config.rope_parameters["rope_theta"])
            inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)  # [d/2]
            freqs = position_ids[..., None].to(torch.float64) * inv  # [B, T, d/2]
            emb = torch.cat((freqs, freqs), -1)  # [B, T, d]: half-split pairs share a frequency
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    RMSNorm64.__name__ = RMSNorm64.__qualname__ = f"{prefix}RMSNorm64"
    Rotary64.__name__ = Rotary64.__qualname__ = f"{prefix}RotaryEmbedding64"
    return RMSNorm64, Rotary64


# ---------------------------------------------------------------------------------------------
# The layout of one family


def no_window(config, refuse: Callable[[str, str], None]) -> int | None:
    return None


def sliding_layers_window(config, refuse: Callable[[str, str], None]) -> int | None:
    """The window of the layers `layer_types` marks sliding (Qwen2, Qwen3: their configs set sliding_window to
    None without use_sliding_window), None when no layer slides."""
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    if config.sliding_window is None:
        refuse("layer_types with sliding_attention layers", "they have no window: use_sliding_window is false "
               "or sliding_window is null, and transformers cannot run them")
    return config.sliding_window


@dataclass(frozen=True)
class LlamaLayout:
    """What distinguishes one Llama-layout family; its methods are that family's adapter."""

    family: str  # registry name, "hf_llama"
    model_type: str  # config.json's model_type, also transformers' module name: "llama"
    prefix: str  # transformers' class prefix: "Llama" for LlamaConfig, LlamaForCausalLM, LlamaRMSNorm
    display: str
    reference: str
    biases: Callable[[object], tuple[bool, bool, bool]]  # config -> biases of (q/k/v_proj, o_proj, mlp)
    # (config, refuse) -> the sliding-attention window, None if attention never slides; refuse(option, why) raises
    window: Callable[[object, Callable[[str, str], None]], int | None] = no_window
    qk_norm: bool = False  # self_attn.q_norm / k_norm: RMSNorm over each head's q and k before RoPE

    def _classes(self) -> tuple[type, type]:
        import transformers

        return getattr(transformers, f"{self.prefix}Config"), getattr(transformers, f"{self.prefix}ForCausalLM")

    def config(self, config: dict):
        """The family's transformers config from a config.json dict (already checked by native.check_hf_config)."""
        return self._classes()[0](**{k: v for k, v in config.items() if k != "model_type"})

    def arch(self, config, source: str = "") -> Arch:
        """The architecture summary; refuses options the canonical layout cannot express."""
        source = source or f"{self.prefix} config"

        def refuse(option: str, why: str) -> None:
            raise ModelError(f"{source} uses {option}, which the engine does not support ({why}).")

        rp = nat.rope_parameters(config)
        if rp.get("rope_type", "default") != "default":
            refuse(f"rope_type={rp['rope_type']!r}", "RoPE frequency scaling; only standard RoPE is supported")
        if config.hidden_act != "silu":
            refuse(f"hidden_act={config.hidden_act!r}", "the gated MLP must be SwiGLU (silu)")
        n_ctx, w = config.max_position_embeddings, self.window(config, refuse)
        if w is not None and w < n_ctx:
            refuse(f"sliding_window={w}", f"attention to the last {w} tokens only, shorter than its context of "
                   f"max_position_embeddings={n_ctx}, is not full causal attention")
        h, hkv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // h
        attn_bias, out_bias, mlp_bias = self.biases(config)
        return Arch(
            family=self.family, task="lm", n_layers=config.num_hidden_layers, d_model=config.hidden_size,
            n_heads=h, n_kv_heads=hkv, d_head=d, d_mlp=config.intermediate_size, n_out=config.vocab_size,
            n_ctx=n_ctx, pe="rope", rope_layout="half", rotary_dim=d,
            rope_base=float(rp.get("rope_theta", 10000.0)), norm="rmsnorm", norm_bias=False,
            norm_eps=config.rms_norm_eps, mlp="swiglu", attn_bias=attn_bias, out_bias=out_bias,
            mlp_bias=mlp_bias, head_bias=False, tied_embeddings=bool(config.tie_word_embeddings), causal=True,
            qk_norm=self.qk_norm,
        )

    def make_exact(self, module) -> None:
        """Switch the float32-only submodules to their float64-faithful subclasses (same parameters)."""
        RMSNorm, Rotary = _hf_classes(self.model_type, self.prefix)
        RMSNorm64, Rotary64 = _exact_classes(self.model_type, self.prefix)
        for m in module.modules():
            if type(m) is RMSNorm:
                m.__class__ = RMSNorm64
            elif type(m) is Rotary:
                m.__class__ = Rotary64

    # -----------------------------------------------------------------------------------------
    # Adapter

    def wrap(self, module, name: str = "", path: Path | None = None, source: str = "") -> Model:
        """A Model handle around the family's ForCausalLM (checks the architecture, makes float64 exact)."""
        a = self.arch(module.config, source)
        self.make_exact(module)
        return Model(self.family, a, module.eval(), module.config.to_dict(), name=name, path=path)

    def build(self, config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
        """A freshly initialised model (HF's own init) for tests and the model zoo."""
        Config, ForCausalLM = self._classes()
        if isinstance(config, dict):
            config = Config(**config)
        self.arch(config)  # refuse before spending time on construction
        config._attn_implementation = "sdpa"  # eager attention runs softmax in float32
        with nat.seeded(seed):
            module = ForCausalLM(config)
        return self.wrap(module.to(dtype))

    def detect(self, path: Path) -> bool:
        return nat.hf_model_type(path) == self.model_type

    def load(self, path: Path, dtype: torch.dtype = torch.float32) -> Model:
        path = Path(path)
        module = nat.load_hf(self._classes()[1], path, dtype, self.model_type, self.display)
        return self.wrap(module, name=path.name, path=path, source=f"Model directory {path}")

    def save(self, model: Model, path: Path) -> None:
        nat.save_hf(model.module, Path(path))

    def to_canonical(self, model: Model) -> Params:
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
            if a.qk_norm:
                p |= {pre + "attn.q_norm.g": at.q_norm.weight, pre + "attn.k_norm.g": at.k_norm.weight}  # [d]
            if a.attn_bias:
                p |= {
                    pre + "attn.b_Q": at.q_proj.bias.reshape(h, -1),  # [h, d]
                    pre + "attn.b_K": at.k_proj.bias.reshape(hkv, -1),  # [h_kv, d]
                    pre + "attn.b_V": at.v_proj.bias.reshape(hkv, -1),  # [h_kv, d]
                }
            if a.out_bias:
                p[pre + "attn.b_O"] = at.o_proj.bias
            if a.mlp_bias:
                p |= {pre + "mlp.b_in": mlp.up_proj.bias, pre + "mlp.b_gate": mlp.gate_proj.bias,
                      pre + "mlp.b_out": mlp.down_proj.bias}
        p["norm_f.g"] = lm.norm.weight
        if not a.tied_embeddings:
            p["head.W"] = model.module.lm_head.weight.T  # [D, V]
        return {k: v.detach() for k, v in p.items()}  # views: engine.models.canonical copies them

    def from_canonical(self, model: Model, params: Params) -> None:
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
            if a.qk_norm:
                n |= {at + "q_norm.weight": params[pre + "attn.q_norm.g"], at + "k_norm.weight": params[pre + "attn.k_norm.g"]}
            if a.attn_bias:
                n |= {at + f"{r.lower()}_proj.bias": params[pre + f"attn.b_{r}"].reshape(-1) for r in "QKV"}  # [h*d]
            if a.out_bias:
                n[at + "o_proj.bias"] = params[pre + "attn.b_O"]
            if a.mlp_bias:
                n |= {mlp + "up_proj.bias": params[pre + "mlp.b_in"], mlp + "gate_proj.bias": params[pre + "mlp.b_gate"],
                      mlp + "down_proj.bias": params[pre + "mlp.b_out"]}
        n["model.norm.weight"] = params["norm_f.g"]
        if not a.tied_embeddings:  # tied: lm_head.weight is embed_tokens.weight, already written above
            n["lm_head.weight"] = params["head.W"].T  # [V, D]
        nat.copy_into(model.module, n)

    def entry(self) -> Family:
        return Family(
            name=self.family, display_name=self.display, reference=self.reference, detect=self.detect,
            load=self.load, save=self.save, to_canonical=self.to_canonical, from_canonical=self.from_canonical,
            logits=nat.causal_lm_logits,
        )
