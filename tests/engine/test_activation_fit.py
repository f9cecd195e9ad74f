"""Activation matching's residual rows and V/O maps: well posed whatever the activations' scale and rank."""

import torch

from engine.align.activation import boundary_rows
from engine.align.context import F64View
from engine.align.run import align
from engine.align.weight import within_head
from engine.models.reference import RefConfig, build

F64 = torch.float64


def test_every_block_boundary_weighs_the_same_in_the_residual_fit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=F64)  # [B, T, D]
    rows = boundary_rows(x)  # [15, 8]
    assert rows.shape == (15, 8) and abs(float(rows.square().mean()) - 1) < 1e-12
    for s in (1e-3, 300.0):  # a boundary's raw scale does not matter
        assert float((boundary_rows(x * s) - rows).abs().max()) < 1e-12
    assert float((boundary_rows(x + 1) - rows).abs().max()) > 1e-3


def test_activation_matching_fits_vo_maps_on_the_weights():
    cfg = RefConfig(task="vit", n_layers=2, d_model=32, n_heads=4, d_mlp=64, pe="learned", bias=True)
    a, b = build(cfg, seed=0, dtype=F64), build(cfg, seed=1, dtype=F64)
    al = align(a, b, "activation", classes=("heads", "vo"))
    pa, pb = F64View(al.pair.params_a), F64View(al.pair.params_b)
    for layer, el in enumerate(al.out.g.layers):
        _, B = within_head(al.pair.arch, "gl", pa, pb, layer, el.head_perm, frozenset({"vo"}))
        assert float((el.vo - B).abs().max()) < 1e-9
        assert float(torch.linalg.cond(el.vo).max()) < 1e3  # bounded, not run off along missing directions
