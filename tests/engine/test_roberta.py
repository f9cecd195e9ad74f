"""HF RoBERTa and XLM-RoBERTa: BERT's post-LayerNorm symmetry group (docs/MATH.md section 9) under other keys and
with positions numbered from pad_token_id + 1. The engine computes what transformers computes; every kind of the
group keeps the output exactly in float64 and what lies outside it does not; weight matching recovers a planted
element; a moved or merged model saves as an ordinary transformers directory; encoders without a head are
compared by their hidden states; unsupported configs are refused before any weight is read.

Tiny models built from configs (hidden 32, 2 layers, 4 heads, intermediate 64, a context of 32), every parameter
random (gains around 1), nothing downloaded.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from ref_models import rel_err

from engine.align.run import align
from engine.errors import ModelError, SpecError
from engine.interpolate import LinearPath, interpolate
from engine.models import arch_from_config, canonical, hf_bert, hf_roberta, load_model, model_logits, set_canonical
from engine.spec import build_spec
from engine.symmetry import GroupElement, apply, invert, random_orthogonal, sample

F64 = torch.float64
V, T, PAD = 300, 32, 1  # bytes, a mask token and a few more; the context; RoBERTa's padding id
CFG = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "max_position_embeddings": T + PAD + 1, "type_vocab_size": 1, "layer_norm_eps": 1e-5}
KINDS = ("heads", "mlp", "qk", "vo", "residual_perm")


def randomised(module, seed: int = 0):
    """A transformers `module` with every parameter random, LayerNorm gains around 1."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in module.named_parameters():
            gain = name.endswith(("LayerNorm.weight", "layer_norm.weight"))
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (1.0 if gain else 0.0))
    return module


def random_roberta(seed: int = 0, layout: str = hf_roberta.CLASS, **change):
    """A float64 RoBERTa of `layout` (XLM-RoBERTa for an XLM class) with every parameter random."""
    build = hf_roberta.build_xlm if layout in hf_roberta.XLM_LAYOUTS else hf_roberta.build
    m = build({**CFG, **change}, seed=seed, dtype=F64, layout=layout)
    randomised(m.module, seed)
    return m


def tokens(n: int = 3, length: int = T, seed: int = 7, pad: bool = False) -> torch.Tensor:
    """Token ids [n, length] without the padding id (one padding token in row 0 with `pad`)."""
    x = torch.randint(PAD + 1, V, (n, length), generator=torch.Generator().manual_seed(seed))
    if pad:
        x[0, 5] = PAD
    return x


def moved(m, g: GroupElement, strict: bool = True):
    out = copy.deepcopy(m)
    set_canonical(out, apply(m.arch, g, canonical(m), strict=strict))
    return out


def rel_change(m, other, x) -> float:
    with torch.no_grad():
        return rel_err(model_logits(other, x), model_logits(m, x))


# ---------------------------------------------------------------------------------------------
# The engine computes transformers' function


def test_a_saved_roberta_loads_and_its_logits_are_transformers_logits(tmp_path):
    from transformers import RobertaConfig, RobertaForMaskedLM

    from engine.models import family_of

    hf = randomised(RobertaForMaskedLM(RobertaConfig(**CFG)).to(F64).eval())
    hf.save_pretrained(tmp_path / "roberta")
    m = load_model(tmp_path / "roberta", dtype=F64)
    assert family_of(tmp_path / "roberta").name == m.family == hf_roberta.FAMILY
    a = m.arch
    assert a.n_ctx == T and a.post_norm and a.head_bias and a.tied_embeddings and not a.causal and a.pe == "learned"
    assert arch_from_config(json.loads((tmp_path / "roberta" / "config.json").read_text())) == a
    p = canonical(m)
    assert p["embed.pos"].shape == (PAD + 1 + T, 32)  # the whole table: the rows up to the padding id first
    assert {k for k in p if k.startswith("head.")} == {"head.dense.W", "head.dense.b", "head.norm.g", "head.norm.b",
                                                       "head.b"}
    x = tokens()
    with torch.no_grad():
        want = hf(input_ids=x).logits
        assert rel_err(model_logits(m, x), want) < 1e-10
        # positions pad + 1, pad + 2, ... for a sequence without padding
        explicit = hf(input_ids=x, position_ids=torch.arange(T)[None] + PAD + 1).logits
        assert torch.equal(explicit, want)
        assert rel_err(hf_bert.twin(m).module(x), want) < 1e-12  # the aligners' twin computes the same
        xp = tokens(pad=True)  # a padding token takes position pad and the later tokens keep counting, as in HF
        assert rel_err(hf_bert.twin(m).module(xp), hf(input_ids=xp).logits) < 1e-12
    with pytest.raises(ModelError, match=f"Input length {T + 1} exceeds the model's context of {T}"):
        model_logits(m, tokens(length=T + 1))


def test_the_head_s_activation_is_gelu_whatever_hidden_act_says():
    m, x = random_roberta(hidden_act="relu"), tokens()
    assert m.arch.mlp == "relu"
    with torch.no_grad():
        assert rel_err(hf_bert.twin(m).module(x), model_logits(m, x)) < 1e-12


def test_a_published_roberta_base_config_reads_a_context_of_512():
    base = {"architectures": ["RobertaForMaskedLM"], "model_type": "roberta", "hidden_size": 768,
            "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "hidden_act": "gelu",
            "max_position_embeddings": 514, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
            "type_vocab_size": 1, "vocab_size": 50265, "layer_norm_eps": 1e-05}
    a = arch_from_config(base)
    assert (a.family, a.n_ctx, a.n_out, a.d_head, a.mlp) == ("hf_roberta", 512, 50265, 64, "gelu")
    assert arch_from_config({**base, "model_type": "xlm-roberta", "architectures": ["XLMRobertaForMaskedLM"],
                             "vocab_size": 250002}).family == "hf_xlm_roberta"


# ---------------------------------------------------------------------------------------------
# The group: BERT's


def test_the_spec_is_bert_s():
    m = random_roberta()
    spec = build_spec(m.arch, canonical(m))
    assert spec.kinds == KINDS and spec.groups["residual"].structure == "permutation"
    assert [x.role for acts in spec.params["head.dense.W"].axes for x in acts] == ["right_inv_t", "right"]


@pytest.mark.parametrize("kinds", [(k,) for k in KINDS] + [KINDS], ids=lambda k: "+".join(k))
def test_every_kind_keeps_the_mlm_logits(kinds):
    m, x = random_roberta(), tokens(pad=True)
    other = moved(m, sample(m.arch, kinds, seed=3))
    assert rel_change(m, other, x) < 1e-10
    pa, pb = canonical(m), canonical(other)
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) > 1e-2


def test_relu_neurons_scale_exactly():
    m = random_roberta(hidden_act="relu")
    assert "mlp_scale" in build_spec(m.arch, canonical(m)).kinds
    assert rel_change(m, moved(m, sample(m.arch, ("mlp_scale",), seed=4)), tokens()) < 1e-10


def test_what_lies_outside_the_group_changes_the_output():
    m, x = random_roberta(), tokens(pad=True)
    g0 = sample(m.arch, (), seed=0)  # the identity
    R = random_orthogonal(m.arch.d_model, 1, torch.Generator().manual_seed(1))[0]
    with pytest.raises(SpecError, match="not a permutation"):
        apply(m.arch, GroupElement(g0.layers, R), canonical(m))
    assert rel_change(m, moved(m, GroupElement(g0.layers, R), strict=False), x) > 1e-3
    S = torch.eye(m.arch.d_model, dtype=F64)
    S[0, 0] = -1  # a signed permutation: orthogonal and monomial, still not a symmetry
    assert rel_change(m, moved(m, GroupElement(g0.layers, S), strict=False), x) > 1e-3
    # the rows before the first position are residual writers too: left unpermuted, a padding token sees it
    g = sample(m.arch, ("residual_perm",), seed=3)
    p = apply(m.arch, g, canonical(m))
    p["embed.pos"][: PAD + 1] = canonical(m)["embed.pos"][: PAD + 1]
    other = copy.deepcopy(m)
    set_canonical(other, p)
    assert rel_change(m, other, tokens()) < 1e-10 and rel_change(m, other, x) > 1e-3


# ---------------------------------------------------------------------------------------------
# Planted recovery, and a moved or merged model saved for transformers


def test_weight_matching_recovers_a_planted_element_and_the_path_is_flat():
    from engine.evaluate import mlm_eval_set

    a = random_roberta()
    g_star = sample(a.arch, KINDS, seed=5)
    b = moved(a, g_star)
    al = align(a, b, "weight")
    assert al.classes == frozenset(KINDS)
    want = invert(a.arch, g_star)
    assert torch.equal(al.out.g.residual, want.residual)
    for got, exp in zip(al.out.g.layers, want.layers):
        assert torch.equal(got.head_perm, exp.head_perm) and torch.equal(got.mlp_perm, exp.mlp_perm)
    assert max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params) < 1e-8
    es = mlm_eval_set("val", 2048, n_ctx=T, vocab=V)
    r = interpolate(al.model_a, al.model_b, es, points=3)
    assert abs(r["barrier"]) < 1e-8 and abs(r["loss"][0] - r["loss"][-1]) < 1e-10 and r["loss"][0] > 1.0
    naive = interpolate(a, b, es, points=3)
    assert abs(naive["loss"][1] - naive["loss"][0]) > 0.05


def test_activation_matching_runs_through_the_twin_and_recovers_a_planted_element():
    a = random_roberta()
    b = moved(a, sample(a.arch, KINDS, seed=5))
    al = align(a, b, "activation")
    assert al.classes == frozenset(KINDS)
    assert max(float((al.moved_params[k] - al.pair.params_a[k]).abs().max()) for k in al.moved_params) < 1e-6


def test_a_moved_and_a_merged_roberta_save_as_transformers_directories(tmp_path):
    from transformers import RobertaForMaskedLM

    from engine.models import save_model

    a, b = random_roberta(0), random_roberta(1)
    al = align(a, b, "weight")
    merged = LinearPath(al.model_a, al.model_b).at(0.5)
    x = tokens(pad=True)
    for name, m in (("moved", al.model_b), ("merged", merged)):
        save_model(m, tmp_path / name)
        hf = RobertaForMaskedLM.from_pretrained(str(tmp_path / name), dtype=F64).eval()
        with torch.no_grad():
            assert torch.equal(hf(input_ids=x).logits, model_logits(m, x)), name
    with torch.no_grad():  # the moved B is B's function, the merged model another one
        assert rel_change(b, al.model_b, x) < 1e-10 and rel_change(a, merged, x) > 1e-2


# ---------------------------------------------------------------------------------------------
# XLM-RoBERTa: the same modules under another model_type


def test_xlm_roberta_is_read_as_its_own_family_with_the_same_group(tmp_path):
    m = random_roberta(layout=hf_roberta.XLM_CLASS)
    hf_roberta.XLM.save(m, tmp_path / "xlmr")
    back = load_model(tmp_path / "xlmr", dtype=F64)
    assert back.family == hf_roberta.XLM_FAMILY and type(back.module).__name__ == hf_roberta.XLM_CLASS
    x = tokens(pad=True)
    with torch.no_grad():
        assert torch.equal(model_logits(back, x), model_logits(m, x))
        assert rel_err(hf_bert.twin(back).module(x), model_logits(m, x)) < 1e-12
    assert build_spec(back.arch, canonical(back)).kinds == KINDS
    assert rel_change(back, moved(back, sample(back.arch, KINDS, seed=2)), x) < 1e-10


# ---------------------------------------------------------------------------------------------
# Encoders without a head (RobertaModel): the symmetry report and the representation comparison


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("roberta_encoders")
    a = random_roberta(0, hf_roberta.ENCODER)
    dirs = {"a": root / "a", "planted": root / "planted"}
    hf_roberta.save(a, dirs["a"])
    hf_roberta.save(moved(a, sample(a.arch, KINDS, seed=5)), dirs["planted"])
    return dirs


def test_an_encoder_holds_every_kind_and_its_hidden_states_are_only_permuted(encoder_dirs):
    from engine.report import symmetry_report

    a, b = load_model(encoder_dirs["a"], F64), load_model(encoder_dirs["planted"], F64)
    assert type(a.module).__name__ == hf_roberta.ENCODER and hf_bert.is_encoder(a.arch)
    assert "head.dense.W" not in canonical(a) and "head.pool.W" in canonical(a)
    x = tokens()
    with torch.no_grad():
        assert rel_change(a, b, x) < 1e-10  # the Gram output and the pooled vector
        ha, hb = hf_bert.hidden(a, x), hf_bert.hidden(b, x)
        assert float((ha - hb).abs().max()) > 1e-2
        assert float((ha.sort(-1).values - hb.sort(-1).values).abs().max()) < 1e-10
        assert rel_err(hf_bert.twin(a).module(x), model_logits(a, x)) < 1e-12
    rep = symmetry_report(encoder_dirs["a"])
    checks = {r["group"]: r["max_rel_change"] for r in rep["checks"]}
    assert rep["kinds"] == list(KINDS) and set(KINDS) <= set(checks) and max(checks.values()) < 1e-10
    breaks = {r["group"]: r["max_rel_change"] for r in rep["breaks"]}
    assert breaks["residual_orth_post_norm"] > 1e-3 and breaks["mlp_scale_nonhomogeneous"] > 1e-3


def test_an_encoder_pair_is_compared_by_its_hidden_states_and_has_no_loss(encoder_dirs):
    from engine.errors import DataError
    from engine.evaluate import eval_set_for
    from engine.represent import represent_pair

    kw = {"points": 3, "max_tokens": 512, "dtype": F64}
    r = represent_pair(encoder_dirs["a"], encoder_dirs["planted"], "weight", **kw)["representation"]
    assert r["representation_barrier"] < 1e-10
    naive = represent_pair(encoder_dirs["a"], encoder_dirs["planted"], "naive", **kw)["representation"]
    assert naive["representation_barrier"] > 0.05
    with pytest.raises(DataError, match=r"RoBERTa encoder without a head \(RobertaModel\)"):
        eval_set_for(load_model(encoder_dirs["a"]))


# ---------------------------------------------------------------------------------------------
# Bad inputs: one sentence naming the directory, before any weight is read


@pytest.mark.parametrize(("change", "option"), [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ({"is_decoder": True}, "is_decoder or add_cross_attention"),
    ({"add_cross_attention": True}, "is_decoder or add_cross_attention"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ({"hidden_act": "silu"}, "hidden_act='silu'"),
    ({"pad_token_id": None}, "pad_token_id=None"),
    ({"pad_token_id": V}, f"pad_token_id={V}"),
    ({"max_position_embeddings": PAD + 1}, f"max_position_embeddings={PAD + 1} with pad_token_id={PAD}"),
])
def test_an_unsupported_config_is_refused_before_any_weight_is_read(tmp_path, change, option):
    path = tmp_path / "roberta"
    hf_roberta.save(hf_roberta.build(CFG), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError) as e:
        load_model(path)
    msg = str(e.value)
    assert msg.startswith(f"Model directory {path} uses {option}, which the engine does not support") and "\n" not in msg
    with pytest.raises(ModelError, match="RoBERTa config uses"):
        hf_roberta.build({**CFG, **change})


def test_other_roberta_heads_are_refused_by_name(tmp_path):
    from transformers import RobertaConfig, RobertaForSequenceClassification

    RobertaForSequenceClassification(RobertaConfig(**CFG)).save_pretrained(tmp_path / "cls")
    with pytest.raises(ModelError, match="RobertaForSequenceClassification; of RoBERTa the engine reads "
                                         "RobertaForMaskedLM, RobertaModel checkpoints only"):
        load_model(tmp_path / "cls")
