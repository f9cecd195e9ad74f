"""Small float64 reference models shared by the engine tests."""

import torch

from engine.models.reference import RefConfig, build


def tiny(task="lm", **kw) -> RefConfig:
    base = {"task": task, "n_layers": 2, "d_model": 32, "n_heads": 4, "d_mlp": 64, "n_ctx": 16, "vocab_size": 40,
            "image_size": 8, "patch_size": 2}
    return RefConfig(**{**base, **kw})


def random_model(cfg: RefConfig, seed: int = 0, std: float = 0.3):
    """Float64 model with O(1) activations, non-unit gains and nonzero biases (so folding matters)."""
    m = build(cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in m.module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.3 * noise if k.endswith(".g") else std * noise)
    return m
