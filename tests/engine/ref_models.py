"""Small float64 models shared by the engine tests: reference configs, random weights, inputs, the families
with a planted symmetry element, and a prepared pair. Every builder is seeded, so each test sees the same
models on every run; nothing is downloaded."""

import torch

from engine.align.pair import model_for, prepare_pair
from engine.classes import default_classes
from engine.models import Model, canonical, set_canonical
from engine.models.reference import RefConfig, build
from engine.spec import build_spec
from engine.symmetry import apply, sample

F64 = torch.float64


def tiny(task="lm", **kw) -> RefConfig:
    """Two layers, width 32, four heads, context 16, a 40-token vocabulary (ViT: 8x8 images in 2x2 patches);
    `kw` overrides any field."""
    base = {"task": task, "n_layers": 2, "d_model": 32, "n_heads": 4, "d_mlp": 64, "n_ctx": 16, "vocab_size": 40,
            "image_size": 8, "patch_size": 2}
    return RefConfig(**{**base, **kw})


def byte_tiny(task="lm", **kw) -> RefConfig:
    """`tiny` over the 256 byte values, the vocabulary of the text that lm_eval_set and training read."""
    return tiny(task, **{"vocab_size": 256, **kw})


def random_model(cfg: RefConfig, seed: int = 0, std: float = 0.3):
    """Float64 model with O(1) activations, non-unit gains and nonzero biases (so folding matters)."""
    m = build(cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in m.module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.3 * noise if k.endswith(".g") else std * noise)
    return m


def inputs(cfg: RefConfig, batch: int = 3, seed: int = 0) -> torch.Tensor:
    """`batch` random token rows of the full context (LM) or random float64 images in [0, 1) (ViT)."""
    g = torch.Generator().manual_seed(seed)
    if cfg.task == "lm":
        return torch.randint(0, cfg.vocab_size, (batch, cfg.n_ctx), generator=g)
    return torch.rand(batch, cfg.in_chans, cfg.image_size, cfg.image_size, generator=g, dtype=torch.float64)


def rel(y: torch.Tensor, y0: torch.Tensor) -> float:
    """Relative error of `y` against `y0` in the Frobenius norm."""
    return float((y - y0).norm() / y0.norm())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest entry error of `a` against `b`, relative to `b`'s largest entry."""
    return float((a - b).abs().max() / b.abs().max())


def randomise_norms(m: Model, seed: int, gain: float = 0.2, bias: float = 0.1) -> Model:
    """Gains around 1 and LayerNorm biases nonzero, so folding and the residual maps are exercised (OLMo's norms
    have no parameters: its model is returned as it is)."""
    if m.family == "hf_olmo":
        return m
    g = torch.Generator().manual_seed(seed)
    p = canonical(m)
    for k, v in p.items():
        if k.endswith(".g"):
            p[k] = 1 + gain * torch.randn(v.shape, generator=g, dtype=F64)
        elif k.endswith((".norm1.b", ".norm2.b", "norm_f.b")):
            p[k] = bias * torch.randn(v.shape, generator=g, dtype=F64)
    if m.family == "hf_phi":  # one LayerNorm reads for both branches: norm2 is norm1
        p |= {k.replace("norm1.", "norm2."): v for k, v in p.items() if ".norm1." in k}
    set_canonical(m, p)
    return m


def _with_qkv_biases(m: Model, seed: int = 6) -> Model:
    """Random Q/K/V biases (HF initialises them to zero), so that matching must carry them along."""
    g = torch.Generator().manual_seed(seed)
    p = canonical(m)
    set_canonical(m, {k: 0.3 * torch.randn(v.shape, generator=g, dtype=F64) if ".attn.b_" in k else v
                      for k, v in p.items()})
    return m


def _hf_cases() -> dict:
    from engine.models import hf_gemma, hf_gpt2, hf_llama, hf_mistral, hf_olmo, hf_phi, hf_qwen2, hf_qwen3, timm_vit

    llama = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16, "bos_token_id": 0,
             "eos_token_id": 0, "rope_theta": 500.0}
    return {
        "hf_gpt2": lambda: hf_gpt2.build({"vocab_size": 256, "n_positions": 16, "n_embd": 32, "n_layer": 2,
                                          "n_head": 4, "bos_token_id": 0, "eos_token_id": 0}, seed=0, dtype=F64),
        "hf_llama": lambda: hf_llama.build({"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                            "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0,
                                            "rope_theta": 500.0}, seed=0, dtype=F64),
        "hf_qwen2": lambda: _with_qkv_biases(hf_qwen2.build(llama, seed=0, dtype=F64)),
        # Llama 3's RoPE frequency scaling (the original context short enough to scale the tiny model's frequencies)
        "hf_llama_llama3": lambda: hf_llama.build({**{k: v for k, v in llama.items() if k != "rope_theta"},
                                                   "rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0,
                                                                       "factor": 8.0, "low_freq_factor": 1.0,
                                                                       "high_freq_factor": 4.0,
                                                                       "original_max_position_embeddings": 8}},
                                                  seed=0, dtype=F64),
        "hf_mistral": lambda: hf_mistral.build({**llama, "head_dim": 12}, seed=0, dtype=F64),
        # LayerNorms without parameters, biases on all four attention projections (randomised)
        "hf_olmo": lambda: _with_qkv_biases(hf_olmo.build({**llama, "attention_bias": True, "pad_token_id": 0}, seed=0,
                                                          dtype=F64)),
        # QK-norm, with biases on all four attention projections (randomised: HF initialises them to zero)
        "hf_qwen3": lambda: _with_qkv_biases(hf_qwen3.build({**llama, "head_dim": 8, "attention_bias": True}, seed=0,
                                                            dtype=F64)),  # Qwen3Config's own head_dim is 128
        # gains stored as offsets from 1, the embedding scaled by sqrt(D), GeGLU, multi-query, tied, no biases (as
        # the released models)
        "hf_gemma": lambda: hf_gemma.build({**llama, "num_key_value_heads": 1, "head_dim": 8,
                                            "hidden_act": "gelu_pytorch_tanh"}, seed=0, dtype=F64),
        # one LayerNorm shared by the parallel attention and MLP, RoPE on half of each head, biases everywhere
        "hf_phi": lambda: hf_phi.build({k: v for k, v in llama.items() if k != "rope_theta"} | {
            "num_key_value_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                          "partial_rotary_factor": 0.5}}, seed=0, dtype=F64),
        "timm_vit": lambda: timm_vit.build({"img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10,
                                            "embed_dim": 32, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0},
                                           seed=0, dtype=F64),
    }


REF_CASES = {
    "lm-none": {"pe": "none"}, "lm-learned": {"pe": "learned"}, "lm-sinusoidal": {"pe": "sinusoidal"},
    "lm-rope": {"pe": "rope"}, "vit-learned": {"task": "vit", "pe": "learned"}, "vit-rope": {"task": "vit", "pe": "rope"},
    "lm-rope-half-gqa-swiglu": {"pe": "rope", "rope_layout": "half", "n_kv_heads": 2, "mlp": "swiglu"},
    "lm-partial-rope-relu": {"pe": "rope", "rotary_dim": 4, "mlp": "relu"},
    "lm-layernorm-bias-relu": {"pe": "learned", "norm": "layernorm", "bias": True, "mlp": "relu"},
    "lm-rope-qk-norm-gqa": {"pe": "rope", "rope_layout": "half", "qk_norm": True, "n_kv_heads": 2, "mlp": "swiglu"},
}
CASES = [*REF_CASES, "hf_gpt2", "hf_llama", "hf_llama_llama3", "hf_qwen2", "hf_qwen3", "hf_mistral", "hf_olmo", "hf_gemma", "hf_phi", "timm_vit"]


def make_case(name: str) -> Model:
    """The family `name` of CASES: a byte_tiny reference variant or a small HF/timm model, seed 0, norms randomised."""
    if name in REF_CASES:
        m = build(byte_tiny(**REF_CASES[name]), seed=0, dtype=F64)
    else:
        m = _hf_cases()[name]()
    return randomise_norms(m, 5)


def planted(a: Model, seed: int = 3):
    """B = g*(A) for a random g* of every default class (A norm-folded first when g* rotates).

    The default rotates a LayerNorm model's residual stream after rewriting it as RMSNorm, and unties a tied
    head whose final gain is not 1 (Gemma's); a rotation planted there would make B a reference-family twin, so
    B gets a residual permutation in A's own coordinates instead (same family), which the rewrite carries over
    exactly: centring commutes with permutations and the permuted gains fold into the permuted readers. Returns
    B, g*, the default classes.
    """
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    rewritten = a.arch.norm == "layernorm" or a.arch.tied_embeddings
    plant = kinds - {"residual_orth"} | {"residual_perm"} if rewritten else kinds
    pair = prepare_pair(a, a, plant)
    g = sample(pair.arch, plant, seed=seed)
    b = model_for(pair.model_a, pair.arch, apply(pair.arch, g, pair.params_a))
    return b, g, kinds


def rope_pair(seed_b: int = 1, dtype: torch.dtype = F64):
    """Two byte_tiny RoPE LMs (seeds 0 and `seed_b`) prepared for their default classes; returns the pair and
    the classes."""
    cfg = byte_tiny(pe="rope")
    a, b = build(cfg, seed=0, dtype=dtype), build(cfg, seed=seed_b, dtype=dtype)
    kinds = default_classes(build_spec(a.arch, canonical(a)))
    return prepare_pair(a, b, kinds), kinds


def dims_only_report(directory, config: dict, capsys) -> dict:
    """The JSON report of `python -m engine symmetry DIR --dims-only --json` on a directory holding `config` alone."""
    import json

    from engine.cli import main

    (directory / "config.json").write_text(json.dumps(config))
    assert main(["symmetry", str(directory), "--dims-only", "--json"]) == 0
    return json.loads(capsys.readouterr().out)
