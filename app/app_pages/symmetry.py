"""Symmetry: which weight changes leave a Transformer's function unchanged, and how the positional
encoding shapes that group.

Pick a zoo model, a model directory, or a preset config (GPT-2 small, Llama-2, Qwen3, Llama-3.2, OLMo, Phi-2, Gemma). With weights the engine
checks every group numerically (float64: random elements must change the logits by < 1e-10) and runs
the break tests (maps from larger groups that must change them); a config alone gives the group
dimensions, instantly. All numbers come from `engine.report.symmetry_report` (docs/MATH.md;
section 7 for what the checks settled).
"""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from app import downloads, exports, messages, sidebar, url_state
from app.figures import style
from app.figures import symmetry as symmetry_figs
from engine import api

charts = downloads.Charts("Symmetry")  # every chart of this rerun, for the page's figure download

# Published shapes as HF config dicts: symmetry_report(..., dims_only=True) needs no weights.
PRESETS = {
    "GPT-2 small": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                    "vocab_size": 50257},
    "Llama-2-7B": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
                   "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "Llama-2-70B (grouped-query)": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                                    "max_position_embeddings": 4096, "vocab_size": 32000, "rms_norm_eps": 1e-5,
                                    "rope_theta": 10000.0},
    "Qwen3-8B (QK-norm)": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                           "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                           "max_position_embeddings": 40960, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                           "rope_theta": 1000000.0},
    "Llama-3.2-1B (RoPE frequency scaling)": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "vocab_size": 128256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "OLMo-1B (LayerNorm without parameters)": {
        "model_type": "olmo", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 2048, "vocab_size": 50304,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "pad_token_id": 1, "eos_token_id": 50279},
    "Phi-2 (partial RoPE, one norm per block)": {
        "model_type": "phi", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048, "vocab_size": 51200,
        "layer_norm_eps": 1e-5, "hidden_act": "gelu_new",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}},
    "Gemma-2B (multi-query, GeGLU)": {
        "model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 8192,
        "vocab_size": 256000, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "gelu_pytorch_tanh"},
}
SOURCES = {"zoo": "Zoo model", "dir": "Model directory", "preset": "Preset config"}

INTRO = """
A **symmetry** is a change of the weights that leaves the model's function exactly unchanged: relabel the
attention heads or the MLP neurons (permutations), put an invertible map A inside a head on the queries and
undo it on the keys (A⁻ᵀ), a map B on the values undone in the output projection, rotate the whole residual
stream by Ω. Two models trained from different seeds can only be compared, let alone interpolated, after these
are removed, so the size of the group is the size of the search an aligner faces. The positional encoding
decides much of it:

| positional encoding | Q/K map per head | V/O map | residual stream | why |
|---|---|---|---|---|
| none | GL(d): d² | GL(d): d² | O(D) | nothing positional: attention's vanilla group |
| learned | GL(d): d² | GL(d): d² | O(D), plus a shift of the embeddings | the table is added before attention, so attention keeps the vanilla group; a constant moved from the token to the position embeddings cancels |
| sinusoidal | GL(d): d² | GL(d): d² | approximate | the fixed table writes into the residual stream and cannot move: Ω must fix the differences of its rows |
| RoPE | one complex scalar per frequency pair: d | GL(d): d² | O(D) | the rotation R(n − m) sits between q and k; only maps commuting with every such rotation survive |
| RoPE + QK-norm (Qwen3) | one positive scale per frequency pair, for the whole layer: d/2 | GL(d): d² | O(D) | an RMSNorm over each head's q and k sits before RoPE and commutes only with orthogonal maps, so of each complex scalar only a quarter turn (and a sign per KV group) acts on the weights; its modulus moves into the q and k norm gains, which every head shares |
"""

NOTES = """
What the checks settled (docs/MATH.md section 7), all measured: a LayerNorm model keeps every rotation that
fixes the all-ones vector, not just permutations; the key-bias redundancy is h_kv (d − r) dimensions, per KV group
under grouped-query attention; the learned-PE shift E + 1cᵀ, P − 1cᵀ is exact only with untied embeddings; a
sinusoidal model with a context T ≤ D keeps an exact O(D − T + 1); how much the wrong RoPE pairing breaks depends
on the model (0.28-0.88 on random tiny models, 2·10⁻³ on an HF Llama at its default initialisation).
"""


@st.cache_data(show_spinner=False)
def diagnose(target: str, dims_only: bool, stamp: int) -> dict:
    """engine.api.symmetry_view of a zoo name, a directory or a preset name (a zoo model's is precomputed
    by `cache build`); `stamp` (api.symmetry_stamp) renews it when the weights or the stored view change."""
    return api.symmetry_view(PRESETS.get(target, target), dims_only=dims_only or target in PRESETS)


@st.cache_data(show_spinner=False)
def precomputed(name: str, stamp: int) -> bool:
    """Whether `cache build` stored zoo model `name`'s view (the check reads the view and hashes the weights,
    so it is kept until `stamp`, api.symmetry_stamp, changes)."""
    return api.has_precomputed_symmetry(name)


def pick_target() -> tuple[str, bool, int] | None:
    """(target, dims_only, stamp) from the pickers, or None while there is nothing to diagnose."""
    left, right = st.columns([2, 3], gap="large")
    url_state.bind("sym_source", "source", list(SOURCES))
    source = left.radio("Diagnose", list(SOURCES), format_func=SOURCES.get, horizontal=True, key="sym_source")
    with right:
        return _pick(source)


def _pick(source: str) -> tuple[str, bool, int] | None:
    if source == "preset":
        url_state.bind("sym_preset", "preset", list(PRESETS))
        name = st.selectbox("Preset", list(PRESETS), key="sym_preset",
                            help="Published shapes as config dicts: group dimensions only, no weights.")
        return name, True, 0
    if source == "dir":
        url_state.bind("sym_dir", "dir")
        url_state.bind("sym_dims_only", "dims", kind=bool)
        path = st.text_input("Model directory", key="sym_dir", placeholder="path/to/model",
                             help="A directory with config.json (and model.safetensors for the checks).").strip()
        dims_only = st.checkbox("Dimensions only (config.json, no checks)", key="sym_dims_only")
        return (path, dims_only, api.symmetry_stamp(path)) if path else None
    names = api.built_zoo()
    if not names:
        st.info("The zoo is not built yet: `python -m engine zoo build` trains it into assets/zoo/.")
        return None
    a = sidebar.selection().model_a
    url_state.bind("sym_model", "model", names, default=a if a in names else names[0])
    name = st.selectbox("Zoo model", names, key="sym_model",
                        help="The sidebar's model A by default.")
    return name, False, api.symmetry_stamp(name)


def run(target: str, dims_only: bool, stamp: int) -> dict | None:
    """The cached engine call; full checks show a status box (seconds to tens of seconds on a busy CPU,
    at once for a zoo model whose report `cache build` stored)."""
    if target not in PRESETS and messages.check_model(target) is None:  # the message every page gives
        return None
    if dims_only or target in PRESETS or (target in api.ENTRIES and precomputed(target, stamp)):
        try:
            return diagnose(target, dims_only, stamp)
        except api.LMCError as e:
            messages.error(e)
            return None
    error = None
    with st.status("Checking every symmetry in float64…", expanded=False) as status:
        try:
            out = diagnose(target, False, stamp)
        except api.LMCError as e:
            error = str(e)
            status.update(label="Diagnostics failed", state="error")
        else:
            rep = out["report"]
            status.update(label=f"{len(rep['checks'])} invariance checks, {len(rep['breaks'])} break tests",
                          state="complete")
    if error:
        messages.error(error)
        return None
    return out


def arch_line(a: dict) -> str:
    rope = f", {a['rope_layout']} pairs, {a['rotary_dim']} of {a['d_head']} dims rotated" if a["pe"] == "rope" else ""
    rope += f", {json.loads(a['rope_scaling'])['rope_type']} frequency scaling" if a.get("rope_scaling") else ""
    rope += ", QK-norm" if a.get("qk_norm") else ""
    kv = f" ({a['n_kv_heads']} KV groups)" if a["n_kv_heads"] < a["n_heads"] else ""
    return (f"{a['family']} {a['task'].upper() if a['task'] == 'lm' else 'ViT'}: {a['n_layers']} layers, "
            f"D = {a['d_model']:,}, h = {a['n_heads']}{kv} heads of d = {a['d_head']}, MLP {a['d_mlp']:,} "
            f"({a['mlp']}), {a['norm']}, context {a['n_ctx']:,}, "
            f"{style.PE_NAMES.get(a['pe'], a['pe'])}{rope}"
            + (", tied embeddings" if a["tied_embeddings"] else "") + ".")


VERDICTS = {"exact": "exact", "approximate": "small change", "break": "changes the output", None: "not measured"}


def check_rows(rep: dict) -> list[dict]:
    """The checks and break tests as table rows in words (no engine code names, no empty cells): what is
    changed, the exact transform, the measured change and the band it falls in."""
    rows = []
    for r, is_break in [(r, False) for r in rep["checks"]] + [(r, True) for r in rep["breaks"]]:
        c = r["max_rel_change"]
        status = symmetry_figs.check_status(r, is_break)
        rows.append({"test": "break test" if is_break else "symmetry", "what is changed": symmetry_figs.check_name(r["group"]),
                     "transform": r["kind"], "max relative change": "not measured" if c is None else f"{c:.2e}",
                     "claimed": {"exact": "exact", "approximate": "approximate", "break": "not a symmetry"}[status],
                     "measured": VERDICTS[symmetry_figs.change_band(c, api.EXACT_TOL)],
                     "exact (measured)": "-" if c is None else "yes" if c < api.EXACT_TOL else "no",
                     "note": r.get("note") or "-"})
    return rows


COMPACT = ["test", "what is changed", "transform", "max relative change", "measured"]


def checks_table(rep: dict, key: str, compact: bool = False) -> None:
    """The rows coloured by their measured change: green exact, yellow a small change, red a broken output."""
    rows = check_rows(rep)
    cols = COMPACT if compact else list(rows[0]) if rows else []
    band = {v: k for k, v in VERDICTS.items()}
    tint = [style.CHECK_TINTS[band[r["measured"]]] for r in rows]
    df = pd.DataFrame(rows, columns=cols)  # a Styler colours the rows
    styled = df.style.apply(lambda row: [f"background-color: {tint[row.name]}"] * len(row), axis=1)
    st.dataframe(styled, hide_index=True, key=key,
                 column_config={"transform": st.column_config.TextColumn(width="medium"),
                                "note": st.column_config.TextColumn(width="large")})


def checks_section(rep: dict, statement: str) -> None:
    st.subheader("Invariance checks and break tests")
    if rep["dims_only"]:
        st.caption("From the config alone: no weights, so no numerical checks. Pick a zoo model or a directory with "
                   "weights to run them.")
        return
    st.markdown(f"Each **symmetry** is applied as random group elements to a float64 copy of the model; the largest "
                f"relative change of the logits must stay below {api.EXACT_TOL:.0e} (float error). Each **break test** "
                "applies a map from a larger group that is *not* a symmetry (GL(d) on a RoPE model's Q/K, the other "
                "RoPE pairing, GL(D) on the residual, scaling a GELU neuron) and must change the output.")
    st.info(statement, icon=":material/fact_check:")
    checks_table(rep, "checks_table")
    charts.show(symmetry_figs.invariance_figure(rep["checks"], rep["breaks"], api.EXACT_TOL, symmetry_figs.TEST_NAMES),
                key="checks_chart")


def dims_section(rep: dict, by_pe: dict[str, dict]) -> None:
    gd, a = rep["group_dim"], rep["arch"]
    st.subheader("Group dimension")
    st.markdown("The continuous part of the group, counted as the number of free parameters in it (the "
                "permutations of heads, neurons and residual coordinates are discrete: dimension 0). These are "
                "directions in weight space along which the function does not change at all.")
    layer0 = gd["per_layer"][0] if gd["per_layer"] else {}
    c = st.columns(4)
    c[0].metric("Attention per layer", f"{layer0.get('attention', 0):,}",
                help="Q/K and V/O maps plus bias redundancies, one layer.")
    c[1].metric("Q/K per layer", f"{layer0.get('qk', 0):,}")
    c[2].metric("Residual stream", f"{gd['by_kind'].get('residual_orth', 0):,}")
    c[3].metric(f"Whole model ({a['n_layers']} layers)", f"{gd['total']:,}",
                help="Every layer's parts, the residual rotation and the embedding shift.")
    left, right = st.columns(2, gap="large")
    with left:
        charts.show(symmetry_figs.group_dim_figure(gd["by_kind"], what="whole model"), key="dims_chart")
    with right:
        charts.show(symmetry_figs.group_dim_per_layer_figure(gd["per_layer"]), key="dims_layer_chart")
    for note in gd.get("notes", []):
        st.caption(f"Note: {note}.")
    if a.get("qk_norm"):
        st.caption(f"QK-norm: the Q/K part is {a['d_head'] // 2} per layer, not per KV group: one positive scale per "
                   "RoPE pair, carried by the q and k norm gains that every head shares. The quarter turns and signs "
                   "that also survive are discrete (docs/MATH.md section 1).")
    st.markdown(f"**The same shape under each positional encoding.** RoPE shrinks the Q/K part from "
                f"d² = {a['d_head'] ** 2:,} to d = {a['d_head']} per KV group, and QK-norm (RoPE + QK-norm) to "
                f"d/2 = {a['d_head'] // 2} per layer; a sinusoidal table leaves only the rotations fixing its row "
                "differences; a learned table adds a shift of the embeddings.")
    charts.show(symmetry_figs.pe_comparison_figure(by_pe), key="pe_chart")


def rope_section(rep: dict) -> None:
    a = rep["arch"]
    st.subheader("How strongly RoPE breaks GL(d), pair by pair")
    scaled = (f" before its {json.loads(a['rope_scaling'])['rope_type']} frequency scaling (which changes the "
              "frequencies, not the group)") if a.get("rope_scaling") else ""
    st.markdown(f"Frequency pair j turns by ω_j = {a['rope_base']:g}^(−2j/r) per position{scaled}. A Q/K map that mixes the "
                f"two coordinates of pair j beyond a complex scalar changes attention by about |sin(ω_j n)| at "
                f"offset n; over a context of T = {a['n_ctx']:,} the worst case is what is drawn. Fast pairs "
                "(ω·T ≫ 1) are fully broken; slow pairs barely rotate within the context, so on them the lost "
                "GL(2) is *almost* a symmetry, an approximate symmetry an aligner could still exploit.")
    charts.show(symmetry_figs.rope_breaking_figure(rep["rope"]), key="rope_chart")


def sinusoidal_section(rep: dict, spectrum: dict, full_rotations: int) -> None:
    st.subheader("The sinusoidal table's spectrum")
    s = spectrum
    exact = rep["group_dim"]["by_kind"].get("residual_orth", 0)
    st.markdown(f"The fixed table P ({s['n_pos']} positions × D = {s['d_model']}) is written into the residual "
                "stream and cannot be rotated with it, so an exact residual map must fix every difference of its "
                f"rows: only {exact:,} of the {full_rotations:,} dimensions of O(D) are left exact. Its singular "
                f"values fall steeply: {s['n_below_rtol']} of {len(s['singular_values'])} lie below {s['rtol']:g} "
                f"σ_max (condition number {s['condition']:.1e}), so many of those constraints are almost empty and "
                "the remaining rotations are *nearly* symmetries. The residual check above therefore rotates only "
                "the directions the table does not reach (exact) or reaches below that level (approximate, a "
                "change of that order); a generic rotation moves the table and is a break test. Residual "
                "alignment of a sinusoidal model is approximate; the endpoint check on the Alignment page reports "
                "by how much.")
    charts.show(symmetry_figs.sinusoidal_spectrum_figure(s["singular_values"], s["rtol"]), key="spectrum_chart")


def report_downloads(out: dict, name: str, key: str) -> None:
    """The report as JSON and Markdown (app.exports: no machine path in either)."""
    rep = out["report"]
    stem = exports.safe(exports.scrub(name))
    c1, c2 = st.columns(2)
    c1.download_button("Symmetry report (JSON)", lambda: exports.symmetry_json(rep), f"{stem}__symmetry.json",
                       "application/json", key=f"{key}_json", on_click="ignore", icon=":material/download:")
    c2.download_button("Symmetry report (Markdown)", lambda: exports.symmetry_markdown(rep, out["statement"]),
                       f"{stem}__symmetry.md", "text/markdown", key=f"{key}_md", on_click="ignore",
                       icon=":material/download:")


def one_model() -> None:
    picked = pick_target()
    out = run(*picked) if picked else None
    if not out:
        return
    rep = out["report"]
    name = api.display_name(rep["model"]) if picked[0] not in PRESETS else picked[0]
    st.markdown(f"**{name}**: {arch_line(rep['arch'])}")
    checks_section(rep, out["statement"])
    dims_section(rep, out["by_pe"])
    if rep.get("rope"):
        rope_section(rep)
    if out.get("spectrum"):
        sinusoidal_section(rep, out["spectrum"], out["by_pe"]["none"]["by_kind"]["residual_orth"])
    report_downloads(out, name, "symmetry_export")
    charts.download_button(key="symmetry_figures", subject=name)


def side_targets() -> tuple[list[str], str, str]:
    """What either side may show (built zoo models, then presets) and the defaults: a RoPE LM beside a
    sinusoidal one when the zoo has both, else Llama-2 (RoPE) beside GPT-2 (learned positions)."""
    names = api.built_zoo()

    def first(pe: str) -> str | None:
        return next((n for n in names if api.ENTRIES[n].pe == pe and api.ENTRIES[n].task == "lm"), None)

    rope, sin = first("rope"), first("sinusoidal")
    return names + list(PRESETS), rope or "Llama-2-7B", sin or "GPT-2 small"


def side_parts(reps: list[dict]) -> list[str]:
    """The group parts either side has (in the page's part order): both sides draw the same bars, a part
    one side lacks as a 0."""
    order = list(style.PART_LABELS)
    kinds = {k for rep in reps for k, v in rep["group_dim"]["by_kind"].items() if v}
    return [k for k in order if k in kinds] + sorted(kinds - set(order))


def side(target: str, out: dict, key: str, parts: list[str], top: int) -> None:
    """One side of the teaching mode: the model, its group part by part in words (per layer and whole model
    told apart), a chart on the axis both sides share, the coloured checks, its downloads."""
    rep = out["report"]
    gd, a = rep["group_dim"], rep["arch"]
    st.caption(arch_line(a))
    st.markdown("**The group, part by part.** What each part may change without changing the output, and its "
                "continuous dimension in one layer and in the whole model.")
    st.dataframe(pd.DataFrame(symmetry_figs.group_parts(a, gd)), hide_index=True, key=f"parts_table_{key}",
                 column_config={"group": st.column_config.TextColumn(width="large")})
    layer0 = gd["per_layer"][0] if gd["per_layer"] else {}
    c = st.columns(2)
    c[0].metric("Dimension per layer", f"{layer0.get('total', 0):,}", help="One layer's parts, added up.")
    c[1].metric(f"Whole model ({a['n_layers']} layers)", f"{gd['total']:,}",
                help="Every layer's parts, the residual rotation and the embedding shift.")
    charts.show(symmetry_figs.group_dim_figure(gd["by_kind"], parts=parts, top=top,
                                               what=f"whole model, {a['n_layers']} layers"),
                key=f"dims_chart_{key}", name=f"Group dimension by part, whole model: {side_name(target, rep)}")
    if rep["dims_only"]:
        st.caption("A published shape: group dimensions from its config, no weights to check.")
    else:
        st.markdown(out["statement"])
        checks_table(rep, f"checks_table_{key}", compact=True)
    report_downloads(out, side_name(target, rep), f"symmetry_side_{key}")


def side_name(target: str, rep: dict) -> str:
    """What a side shows, by name: the preset's, or the zoo model's or directory's (never its path)."""
    return target if target in PRESETS else api.display_name(rep["model"])


def side_by_side() -> None:
    options, left_default, right_default = side_targets()
    st.markdown("Two models or two published shapes next to each other: what each positional encoding keeps of "
                "the symmetry group, measured on the weights where there are weights. Rows are coloured by the "
                "measured change: **green** exact (float error), **yellow** a small change, **red** a changed "
                "output.")
    cols = st.columns(2, gap="large")
    picked = {}
    for col, key, default in ((cols[0], "left", left_default), (cols[1], "right", right_default)):
        with col:
            target = st.selectbox("Model or shape", options, index=options.index(default), key=f"sym_{key}",
                                  format_func=lambda n: n if n in PRESETS else f"{n} (zoo)")
            out = run(target, target in PRESETS, 0 if target in PRESETS else api.symmetry_stamp(target))
            if out:
                picked[key] = (col, target, out)
    reps = [out["report"] for _, _, out in picked.values()]
    parts = side_parts(reps)
    top = max((rep["group_dim"]["by_kind"].get(k, 0) for rep in reps for k in parts), default=1)
    for key, (col, target, out) in picked.items():
        with col:
            side(target, out, key, parts, top)
    if picked:
        names = " vs ".join(side_name(t, o["report"]) for _, t, o in picked.values())
        charts.download_button(key="symmetry_side_figures", subject=names)


st.title("Symmetry")
st.caption("Which weight changes leave a Transformer's function unchanged, checked numerically, and how the "
           "positional encoding changes that group.")
with st.expander("Four positional encodings, four symmetry groups (and QK-norm)", expanded=False):
    st.markdown(INTRO)
    st.caption(NOTES)

url_state.bind("sym_mode", "view", ["one", "side"], default="one")
mode = st.segmented_control("View", ["one", "side"], key="sym_mode", required=True,
                            format_func={"one": "One model", "side": "Side by side"}.get)
if mode == "side":
    side_by_side()
else:
    one_model()
