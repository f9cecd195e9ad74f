"""HF BERT masked LMs: the post-LayerNorm symmetry group (docs/MATH.md section 9), exact in float64 for every
kind it holds and broken by what it does not; weight matching recovers a planted element; the masked-LM loss.

Tiny BertForMaskedLM models built from configs (hidden 32, 2 layers, 4 heads, intermediate 64), every
parameter random (gains around 1), nothing downloaded.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from engine.align.run import align
from engine.classes import choose_classes
from engine.errors import LMCError, ModelError, SpecError
from engine.interpolate import interpolate
from engine.models import arch_from_config, canonical, hf_bert, model_logits, set_canonical
from engine.spec import build_spec
from engine.symmetry import GroupElement, apply, identity, invert, random_orthogonal, sample

F64 = torch.float64
V = 300  # bytes and a mask token
CFG = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "max_position_embeddings": 32}
KINDS = ("heads", "mlp", "qk", "vo", "residual_perm")


def random_bert(seed: int = 0, layout: str = hf_bert.CLASS, **change) -> hf_bert.Model:
    """A float64 BERT of `layout` with every parameter random, LayerNorm gains around 1."""
    m = hf_bert.build({**CFG, **change}, seed=seed, dtype=F64, layout=layout)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in m.module.named_parameters():
            gain = name.endswith("LayerNorm.weight")
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3 + (1.0 if gain else 0.0))
    return m


def tokens(n: int = 3, T: int = 24, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def moved(m, g: GroupElement, strict: bool = True):
    out = copy.deepcopy(m)
    set_canonical(out, apply(m.arch, g, canonical(m), strict=strict))
    return out


def rel_change(m, other, x) -> float:
    with torch.no_grad():
        y, y2 = model_logits(m, x), model_logits(other, x)
    return float((y2 - y).abs().max() / y.abs().max())


# ---------------------------------------------------------------------------------------------
# The group


def test_the_arch_is_a_post_norm_masked_lm_and_its_spec_has_no_rotations():
    m = random_bert()
    a = m.arch
    assert a.post_norm and not a.causal and a.tied_embeddings and a.head_bias and a.pe == "learned"
    assert arch_from_config({**CFG, "model_type": "bert"}) == a  # the same Arch from a config.json dict
    spec = build_spec(a, canonical(m))
    assert spec.kinds == KINDS  # GELU: no neuron scaling; post-norm: no residual_orth
    assert spec.groups["residual"].structure == "permutation"
    assert "residual_orth" not in spec.requires
    # the head's dense layer is read from the stream and written in its basis (the decoder is tied)
    roles = [x.role for acts in spec.params["head.dense.W"].axes for x in acts]
    assert roles == ["right_inv_t", "right"]
    choice = choose_classes(a, "weight")
    assert choice.classes == frozenset(KINDS)
    assert "only permutations" in choice.left_out["residual_orth"]


@pytest.mark.parametrize("kinds", [(k,) for k in KINDS] + [KINDS], ids=lambda k: "+".join(k))
def test_every_kind_keeps_the_mlm_logits(kinds):
    m, x = random_bert(), tokens()
    g = sample(m.arch, kinds, seed=3)
    other = moved(m, g)
    assert rel_change(m, other, x) < 1e-10
    # and the weights really moved
    pa, pb = canonical(m), canonical(other)
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) > 1e-2


def test_relu_neurons_scale_exactly():
    m = random_bert(hidden_act="relu")
    assert "mlp_scale" in build_spec(m.arch, canonical(m)).kinds
    assert rel_change(m, moved(m, sample(m.arch, ("mlp_scale",), seed=4)), tokens()) < 1e-10


def test_a_residual_rotation_and_a_gelu_neuron_scaling_change_the_output():
    m, x = random_bert(), tokens()
    g0 = identity(m.arch)
    # an orthogonal residual map that is not a permutation: refused by apply, and it breaks the function
    R = random_orthogonal(m.arch.d_model, 1, torch.Generator().manual_seed(1))[0]
    rot = GroupElement(g0.layers, R)
    with pytest.raises(SpecError, match="not a permutation"):
        apply(m.arch, rot, canonical(m))
    assert rel_change(m, moved(m, rot, strict=False), x) > 1e-3
    # a signed permutation (one coordinate flipped): orthogonal, monomial, still not a symmetry
    S = torch.eye(m.arch.d_model, dtype=F64)
    S[0, 0] = -1
    assert rel_change(m, moved(m, GroupElement(g0.layers, S), strict=False), x) > 1e-3
    # GELU neurons do not rescale: the spec has no scaling group to apply, so scale W_in and W_out by hand
    s = torch.exp(torch.linspace(-0.5, 0.5, m.arch.d_mlp, dtype=F64))
    layers = (type(g0.layers[0])(g0.layers[0].head_perm, g0.layers[0].qk, g0.layers[0].vo, g0.layers[0].mlp_perm, s),
              *g0.layers[1:])
    with pytest.raises(SpecError, match="no neuron scaling"):
        apply(m.arch, GroupElement(layers, g0.residual), canonical(m))
    p = canonical(m)
    p["blocks.0.mlp.W_in"], p["blocks.0.mlp.b_in"] = p["blocks.0.mlp.W_in"] * s, p["blocks.0.mlp.b_in"] * s
    p["blocks.0.mlp.W_out"] = p["blocks.0.mlp.W_out"] / s[:, None]
    scaled = copy.deepcopy(m)
    set_canonical(scaled, p)
    assert rel_change(m, scaled, x) > 1e-3


def test_a_residual_sample_of_every_kind_is_a_permutation():
    m = random_bert()
    R = sample(m.arch, ("residual_orth",), seed=2).residual  # kinds the arch lacks stay the identity
    assert torch.equal(R, torch.eye(m.arch.d_model, dtype=F64))
    P = sample(m.arch, seed=2).residual
    assert bool(((P == 0) | (P == 1)).all()) and not torch.equal(P, torch.eye(m.arch.d_model, dtype=F64))


# ---------------------------------------------------------------------------------------------
# The adapter refuses what it cannot express


@pytest.mark.parametrize(("change", "option"), [
    ({"is_decoder": True}, "is_decoder"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"hidden_act": "silu"}, "hidden_act"),
])
def test_unsupported_configs_are_refused_in_one_sentence(change, option):
    with pytest.raises(ModelError, match=option):
        hf_bert.build({**CFG, **change})


def test_other_bert_heads_are_refused_by_name_and_the_three_layouts_load(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from engine.models import load_model

    BertForSequenceClassification(BertConfig(**CFG)).save_pretrained(tmp_path / "cls")
    with pytest.raises(ModelError, match="BertForSequenceClassification; of BERT the engine reads BertForMaskedLM, "
                                         "BertForPreTraining, BertModel checkpoints only"):
        hf_bert.load(tmp_path / "cls")
    for layout in hf_bert.LAYOUTS:
        m = random_bert(layout=layout)
        hf_bert.save(m, tmp_path / layout)
        back = load_model(tmp_path / layout, dtype=F64)
        assert type(back.module).__name__ == layout and back.arch == m.arch
        x = tokens()
        with torch.no_grad():
            assert torch.equal(model_logits(back, x), model_logits(m, x))
    assert hf_bert.is_encoder(load_model(tmp_path / "BertModel").arch)
    assert not hf_bert.is_encoder(load_model(tmp_path / "BertForPreTraining").arch)


# ---------------------------------------------------------------------------------------------
# Planted recovery


def planted_pair(seed: int = 5):
    a = random_bert()
    g_star = sample(a.arch, KINDS, seed=seed)
    return a, moved(a, g_star), g_star


def test_weight_matching_recovers_a_planted_element_and_the_path_is_flat():
    from engine.evaluate import mlm_eval_set

    a, b, g_star = planted_pair()
    al = align(a, b, "weight")
    assert al.classes == frozenset(KINDS)
    want = invert(a.arch, g_star)
    assert torch.equal(al.out.g.residual, want.residual)
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.mlp_perm, exp.mlp_perm)
    assert max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params) < 1e-8
    es = mlm_eval_set("val", 2048, n_ctx=32, vocab=V)
    r = interpolate(al.model_a, al.model_b, es, points=3)
    assert abs(r["barrier"]) < 1e-8
    assert abs(r["loss"][0] - r["loss"][-1]) < 1e-10 and r["loss"][0] > 1.0  # B aligned computes A's loss
    naive = interpolate(a, b, es, points=3)
    assert abs(naive["loss"][1] - naive["loss"][0]) > 0.05  # unaligned, the same two functions' midpoint is another model


@pytest.mark.parametrize("method", ["activation", "learned", "dual"])
def test_data_driven_aligners_run_on_a_bert_pair_through_its_twin_and_recover_a_planted_element(method):
    from engine.evaluate import mlm_eval_set

    a, b, _ = planted_pair()
    tw = hf_bert.twin(a)
    x = tokens()
    with torch.no_grad():  # the twin computes the model's logits from the shared canonical tensors
        assert float((tw.module(x) - model_logits(a, x)).abs().max() / model_logits(a, x).abs().max()) < 1e-12
    assert {k: v.data_ptr() for k, v in tw.module.state_dict().items()} == {
        k: v.data_ptr() for k, v in hf_bert.to_canonical(a).items()}
    al = align(a, b, method, steps=2 if method in ("learned", "dual") else 0)
    assert al.classes == frozenset(KINDS)
    apply(al.pair.arch, al.out.g, al.pair.params_b, strict=True)  # a permutation of the stream, not a rotation
    es = mlm_eval_set("val", 2048, n_ctx=32, vocab=V)
    r = interpolate(al.model_a, al.model_b, es, points=3)
    assert abs(r["loss"][0] - r["loss"][-1]) < 1e-8  # the moved B still computes B's (= A's) function
    if method != "dual":  # dual reports the path in a frame of its own choosing
        assert abs(r["barrier"]) < 1e-6


# ---------------------------------------------------------------------------------------------
# The masked-LM evaluation set


def test_masking_is_seeded_and_follows_bert_s_proportions():
    from engine.data import IGNORE_INDEX, mask_tokens

    w = torch.randint(0, 256, (64, 128), generator=torch.Generator().manual_seed(0))
    x, y = mask_tokens(w, 299, 256, seed=0)
    x2, y2 = mask_tokens(w, 299, 256, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # deterministic: the barrier is a function of the models
    chosen = y != IGNORE_INDEX
    assert torch.equal(y[chosen], w[chosen]) and torch.equal(x[~chosen], w[~chosen])
    n = int(chosen.sum())
    assert abs(n / w.numel() - 0.15) < 0.01
    masked, kept = int((x[chosen] == 299).sum()), int((x[chosen] == w[chosen]).sum())
    assert abs(masked / n - 0.8) < 0.03 and 0.07 < kept / n < 0.13  # kept: 10%, plus random draws equal to the token
    assert not torch.equal(mask_tokens(w, 299, 256, seed=1)[1], y)


def test_mlm_eval_set_reads_the_directory_s_tokenizer_json_and_refuses_a_byte_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine.errors import DataError
    from engine.evaluate import eval_set_for, mlm_eval_set

    with pytest.raises(DataError, match="at least 257 tokens"):
        mlm_eval_set("val", 512, n_ctx=32, vocab=256)
    words = ["[UNK]", "[MASK]", "the", "of", "and", "to", "a", "her", "she", "was"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    m = random_bert()
    hf_bert.save(m, tmp_path / "bert")
    tok.save(str(tmp_path / "bert" / "tokenizer.json"))
    from engine.models import load_model

    es = eval_set_for(load_model(tmp_path / "bert", dtype=F64), "val", 1024)
    assert "tokenizer.json:bert" in es.description and int(es.inputs.max()) < len(words)
    assert bool((es.inputs == 1).any()) and es.size > 0  # [MASK] is id 1


# ---------------------------------------------------------------------------------------------
# The group's dimension


def test_group_dimension_of_a_post_norm_encoder_has_no_residual_part_and_no_rmsnorm_rewrite_note():
    from engine.groups import group_dimension

    a = random_bert().arch
    D, h, d, m, L = a.d_model, a.n_heads, a.d_head, a.d_mlp, a.n_layers
    gd = group_dimension(a)
    assert gd["by_kind"]["residual_orth"] == 0 and gd["by_kind"]["residual_perm"] == 0
    assert gd["by_kind"]["qk"] == L * h * d * d and gd["by_kind"]["vo"] == L * h * d * d
    assert gd["by_kind"]["key_bias"] == L * h * d and gd["by_kind"]["value_bias"] == L * h * d
    # reader columns (Q, K, V, MLP-in per layer, and the head's dense layer) each move along 1/g
    assert gd["by_kind"]["ln_reader_gauge"] == L * (3 * h * d + m) + D
    assert not any("RMSNorm rewrite" in n for n in gd["notes"])
    assert any(n.startswith("post-LayerNorm: counted as given") for n in gd["notes"])
    pre = group_dimension(replace(a, post_norm=False))  # the same shapes, pre-norm: the rewrite note returns
    assert any("RMSNorm rewrite" in n for n in pre["notes"])


# ---------------------------------------------------------------------------------------------
# Learned matching's loss on masked targets


def test_learned_matching_s_mean_loss_weighs_micro_batches_by_their_scored_targets():
    import torch.nn.functional as F

    from engine.align.learned import backward_loss, mean_loss, scored
    from engine.data import IGNORE_INDEX, mask_tokens

    m = random_bert()
    tw = hf_bert.twin(m)
    w = tokens(4, 24, seed=11)
    x, y = mask_tokens(w, V - 1, 256, seed=3)
    y[0, :20] = IGNORE_INDEX  # micro-batches with very different numbers of scored targets
    y[1, 5:] = w[1, 5:]
    counts = [scored(y[i:i + 1]) for i in range(4)]
    assert len(set(counts)) > 2 and scored(y) == sum(counts)
    with torch.no_grad():
        want = float(F.cross_entropy(model_logits(m, x).flatten(0, 1), y.flatten()))  # one mean over the scored
    assert abs(mean_loss(tw.module, x, y, per_pass=1) - want) < 1e-12
    assert abs(mean_loss(tw.module, x, y, per_pass=3) - want) < 1e-12
    p = {k: v.clone().requires_grad_(k == "head.b") for k, v in hf_bert.to_canonical(m).items()}
    assert abs(backward_loss(tw, p, x, y, per_pass=1) - want) < 1e-12
    y[2:] = IGNORE_INDEX  # micro-batches with nothing scored add nothing
    with torch.no_grad():
        want = float(F.cross_entropy(model_logits(m, x).flatten(0, 1), y.flatten()))
    assert abs(mean_loss(tw.module, x, y, per_pass=1) - want) < 1e-12


# ---------------------------------------------------------------------------------------------
# The pre-training layout: the pooler and the next-sentence head (docs/MATH.md section 9)


def nsp_change(m, other, x) -> float:
    with torch.no_grad():
        y, y2 = hf_bert.nsp_logits(m, x), hf_bert.nsp_logits(other, x)
    return float((y2 - y).abs().max() / y.abs().max())


def test_pretraining_layout_carries_the_pooler_and_the_next_sentence_head():
    m = random_bert(layout=hf_bert.PRETRAINING)
    p = canonical(m)
    assert {k for k in p if k.startswith("head.")} == {
        "head.dense.W", "head.dense.b", "head.norm.g", "head.norm.b", "head.b",
        "head.pool.W", "head.pool.b", "head.nsp.W", "head.nsp.b"}
    spec = build_spec(m.arch, p)
    assert spec.kinds == KINDS and spec.params["head.pool.W"].axes[1] == ()
    assert [x.role for x in spec.params["head.pool.W"].axes[0]] == ["right_inv_t"]  # reads the [CLS] stream
    assert spec.params["head.nsp.W"].invariant and spec.params["head.pool.b"].invariant
    x = tokens()
    with torch.no_grad():  # the twin computes the masked-LM logits and carries the pooler and NSP head
        tw = hf_bert.twin(m)
        assert float((tw.module(x) - model_logits(m, x)).abs().max() / model_logits(m, x).abs().max()) < 1e-12
        assert set(tw.module.state_dict()) == set(p)
    set_canonical(m, p)  # a round trip through the canonical params leaves both outputs bit-identical
    with torch.no_grad():
        assert torch.equal(hf_bert.nsp_logits(m, x), hf_bert.nsp_logits(random_bert(layout=hf_bert.PRETRAINING), x))
    with pytest.raises(ModelError, match="no next-sentence head"):
        hf_bert.nsp_logits(random_bert(), x)


@pytest.mark.parametrize("kinds", [(k,) for k in KINDS] + [KINDS], ids=lambda k: "+".join(k))
def test_every_kind_keeps_the_mlm_and_the_next_sentence_logits(kinds):
    m, x = random_bert(layout=hf_bert.PRETRAINING), tokens()
    other = moved(m, sample(m.arch, kinds, seed=3))
    assert rel_change(m, other, x) < 1e-10
    assert nsp_change(m, other, x) < 1e-10
    pa, pb = canonical(m), canonical(other)
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) > 1e-2
    if "residual_perm" in kinds:  # the pooler's input axis took the permutation, its output axis did not
        P = sample(m.arch, kinds, seed=3).residual
        assert torch.equal(pb["head.pool.W"], P.T @ pa["head.pool.W"])
        assert torch.equal(pb["head.nsp.W"], pa["head.nsp.W"]) and torch.equal(pb["head.pool.b"], pa["head.pool.b"])


def test_a_pooler_left_out_of_the_residual_permutation_or_permuted_on_its_output_breaks_the_nsp_logits():
    m, x = random_bert(layout=hf_bert.PRETRAINING), tokens()
    g = sample(m.arch, ("residual_perm",), seed=3)
    P = g.residual
    pa = canonical(m)
    right = apply(m.arch, g, pa)
    for wrong_pool in (pa["head.pool.W"], P.T @ pa["head.pool.W"] @ P):  # not moved; moved on both axes
        p = dict(right, **{"head.pool.W": wrong_pool})
        other = copy.deepcopy(m)
        set_canonical(other, p)
        assert rel_change(m, other, x) < 1e-10  # the masked-LM logits never read the pooler
        assert nsp_change(m, other, x) > 1e-3


def test_weight_matching_recovers_a_planted_element_of_the_pretraining_layout():
    a = random_bert(layout=hf_bert.PRETRAINING)
    g_star = sample(a.arch, KINDS, seed=5)
    b = moved(a, g_star)
    al = align(a, b, "weight")
    assert torch.equal(al.out.g.residual, invert(a.arch, g_star).residual)
    assert max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params) < 1e-8
    x = tokens()
    assert nsp_change(a, al.model_b, x) < 1e-10


# ---------------------------------------------------------------------------------------------
# Weight matching's objective on the head's dense layer, moved on both axes


@pytest.mark.parametrize("layout", [hf_bert.CLASS, hf_bert.PRETRAINING])
def test_weight_matching_objective_is_the_distance_of_the_returned_element_two_sided_head_included(layout):
    from engine.align.pair import prepare_pair
    from engine.align.weight import two_sided, weight_match

    a, b = random_bert(0, layout), random_bert(1, layout)
    pair = prepare_pair(a, b, frozenset(KINDS))
    assert two_sided(pair.spec) == {"head.dense.W"}  # the pooler reads the stream on one axis only
    g, info = weight_match(pair, frozenset(KINDS))
    moved_b = apply(a.arch, g, pair.params_b)
    direct = sum(float(((pair.params_a[k] - moved_b[k]) ** 2).sum()) for k in moved_b)
    assert abs(info["sweeps"][-1]["objective"] - direct) < 1e-9 * direct
    # the head's term is the two-sided distance ||W_A - P^T W_B P||^2 that the objective counts
    P = g.residual
    W_a, W_b = pair.params_a["head.dense.W"], pair.params_b["head.dense.W"]
    assert torch.equal(moved_b["head.dense.W"], P.T @ W_b @ P)
    assert float(((W_a - P.T @ W_b @ P) ** 2).sum()) != pytest.approx(float(((W_a - W_b @ P) ** 2).sum()), rel=1e-3)


# ---------------------------------------------------------------------------------------------
# Encoders without a head (BertModel): the symmetry report and a representation comparison


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory):
    """A BertModel, the same encoder moved by a planted element, and an independent one, saved as directories."""
    root = tmp_path_factory.mktemp("encoders")
    a = random_bert(0, hf_bert.ENCODER)
    dirs = {"a": root / "a", "planted": root / "planted", "other": root / "other"}
    hf_bert.save(a, dirs["a"])
    hf_bert.save(moved(a, sample(a.arch, KINDS, seed=5)), dirs["planted"])
    hf_bert.save(random_bert(1, hf_bert.ENCODER), dirs["other"])
    return dirs


def test_an_encoder_s_symmetry_report_holds_every_kind_exactly_and_breaks_a_rotation(encoder_dirs):
    from engine.report import format_report, symmetry_report

    rep = symmetry_report(encoder_dirs["a"])
    assert rep["kinds"] == list(KINDS) and "head.dense.W" not in canonical(hf_bert.load(encoder_dirs["a"]))
    checks = {r["group"]: r["max_rel_change"] for r in rep["checks"]}
    assert set(KINDS) <= set(checks) and max(checks.values()) < 1e-10  # the Gram output and the pooled vector
    breaks = {r["group"]: r["max_rel_change"] for r in rep["breaks"]}
    assert breaks["residual_orth_post_norm"] > 1e-3 and breaks["mlp_scale_nonhomogeneous"] > 1e-3
    assert rep["group_dim"]["by_kind"]["residual_orth"] == 0
    assert "residual_orth_post_norm" in format_report(rep)
    dims = symmetry_report(encoder_dirs["a"], dims_only=True)  # from the config alone: no rotation kind either
    assert dims["kinds"] == list(KINDS)


def test_the_encoder_s_output_is_basis_free_but_its_hidden_states_are_not(encoder_dirs):
    a, b = hf_bert.load(encoder_dirs["a"], F64), hf_bert.load(encoder_dirs["planted"], F64)
    x = tokens()
    with torch.no_grad():
        assert rel_change(a, b, x) < 1e-10
        ha, hb = hf_bert.hidden(a, x), hf_bert.hidden(b, x)
        assert float((ha - hb).abs().max()) > 1e-2  # the stream is permuted ...
        assert float((ha.sort(-1).values - hb.sort(-1).values).abs().max()) < 1e-10  # ... and only permuted


def test_linear_cka_ignores_orthogonal_maps_and_scale_and_sees_other_features():
    from engine.represent import linear_cka

    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 16, generator=g, dtype=F64)
    R = random_orthogonal(16, 1, g)[0]
    assert abs(linear_cka(X, 3.0 * X @ R) - 1) < 1e-12
    assert linear_cka(X, torch.randn(200, 16, generator=g, dtype=F64)) < 0.3


def test_an_encoder_pair_is_compared_by_its_hidden_states_along_the_path(encoder_dirs):
    from engine.errors import DataError
    from engine.evaluate import eval_set_for
    from engine.represent import UNIT, represent_pair

    kw = {"points": 5, "max_tokens": 1024, "dtype": F64}
    rec = represent_pair(encoder_dirs["a"], encoder_dirs["planted"], "weight", **kw)
    r = rec["representation"]
    assert rec["kind"] == "representation" and r["unit"] == UNIT == "1 - cosine similarity (dimensionless)"
    assert r["lambdas"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert r["representation_barrier"] < 1e-10 and min(r["cka_a"] + r["cka_b"]) > 1 - 1e-10  # one function
    naive = represent_pair(encoder_dirs["a"], encoder_dirs["planted"], "naive", **kw)["representation"]
    assert naive["feature_cosine"][0] == naive["feature_cosine"][-1] == pytest.approx(1.0, abs=1e-12)
    assert naive["representation_barrier"] > 0.05 and naive["barrier_lambda"] not in (0.0, 1.0)
    assert naive["cka_endpoints"] == pytest.approx(1.0, abs=1e-10)  # CKA ignores the permutation itself
    other = {m: represent_pair(encoder_dirs["a"], encoder_dirs["other"], m, **kw)["representation"]
             for m in ("naive", "weight")}  # two independent encoders: weight matching lowers the barrier
    assert 0 < other["weight"]["representation_barrier"] < other["naive"]["representation_barrier"]
    with pytest.raises(LMCError, match="learned optimises the loss along the path"):
        represent_pair(encoder_dirs["a"], encoder_dirs["other"], "learned", **kw)
    with pytest.raises(DataError, match="encoder without a head .*compares its hidden states"):
        eval_set_for(hf_bert.load(encoder_dirs["a"]))  # every loss view (the app's included) says so


def test_the_cli_align_prints_the_representation_barrier_and_writes_its_record(encoder_dirs, tmp_path, capsys):
    import json

    from engine.cli import main

    out = tmp_path / "rec.json"
    argv = ["align", str(encoder_dirs["a"]), str(encoder_dirs["planted"]), "--method", "weight", "--points", "3",
            "--eval-items", "512", "--dtype", "float64", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "weight: representation barrier 0.000000 (1 - cosine similarity (dimensionless))" in text
    rec = json.loads(out.read_text())
    assert rec["representation"]["unit"] == "1 - cosine similarity (dimensionless)" and len(rec["representation"]["lambdas"]) == 3
    assert main(argv) == 0  # an earlier representation record is replaced
    assert main(["align", str(encoder_dirs["a"]), str(encoder_dirs["planted"]), "--method", "dual"]) == 2
    assert "dual optimises the loss along the path" in capsys.readouterr().err


def test_a_masked_lm_directory_storing_the_pretraining_heads_is_read_as_pretraining(tmp_path):
    import json

    from engine.models import load_model

    m = random_bert(layout=hf_bert.PRETRAINING)
    hf_bert.save(m, tmp_path / "bert-base")
    cfg = json.loads((tmp_path / "bert-base" / "config.json").read_text())
    (tmp_path / "bert-base" / "config.json").write_text(json.dumps({**cfg, "architectures": [hf_bert.CLASS]}))
    back = load_model(tmp_path / "bert-base", dtype=F64)
    assert type(back.module).__name__ == hf_bert.PRETRAINING
    with torch.no_grad():
        assert torch.equal(hf_bert.nsp_logits(back, tokens()), hf_bert.nsp_logits(m, tokens()))
