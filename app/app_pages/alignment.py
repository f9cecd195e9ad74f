"""Alignment: the group element that moves model B onto model A, shown layer by layer.

For the sidebar's pair and method it opens the cached record (or the Connectivity page's live run of
the same pair and method) and draws, first and above the fold, a sentence naming the layer that aligned
worst and the chart it comes from: where the barrier lives (the record's `attribution`: each block
interpolated alone, what each class buys), or for a record without one the matching cost per layer.
Then the record's `alignment` field: head and neuron permutations, within-head maps, the residual map,
matching cost before and after, and the method's own diagnostics.
Everything drawn is already in the record; the engine is not run here.
"""

from __future__ import annotations

import streamlit as st

from app import downloads, messages, sidebar, url_state
from app.figures import alignment as alignment_figs
from app.figures import style
from engine import api

# What each symmetry class lets an aligner change (docs/MATH.md sections 1-3), in the reader's words.
CLASS_INFO = {
    "heads": "which of B's attention heads plays each of A's heads",
    "mlp": "which of B's hidden MLP neurons plays each of A's neurons",
    "mlp_scale": "a scale per hidden neuron, undone in the output weights (ReLU: positive; SwiGLU: the up branch)",
    "qk": "a map A inside each KV group on queries, undone on keys as A⁻ᵀ: any invertible map without RoPE, "
          "one complex scalar per frequency pair with RoPE",
    "vo": "an invertible map B inside each KV group on values, undone in the output projection",
    "residual_perm": "a permutation of the residual-stream coordinates",
    "residual_orth": "a rotation Ω of the whole residual stream (the norm gains are folded into the readers first)",
}
SIDES = {"relative": "g_A⁻¹ g_B: B moved onto A (what the path uses)", "a": "g_A: A's own transform"}
charts = downloads.Charts("Alignment")  # every chart of this rerun, for the page's figure download


@st.cache_data(show_spinner=False)
def load_record(model_a: str, model_b: str, method: str, store: str, stamp: int) -> dict | None:
    """The stored record of one pair and method (an unusable one is its error); `stamp` renews it after a
    rebuild."""
    return api.pair_record(model_a, model_b, method, store)


def cached(sel: sidebar.Selection) -> dict | None:
    if sel.custom:
        return None  # the store is keyed by zoo names; directories only ever run live
    return load_record(sel.model_a, sel.model_b, sel.method, str(api.cache_dir()),
                       api.record_stamp(sel.model_a, sel.model_b, sel.method))


def live(sel: sidebar.Selection) -> dict | None:
    """The Connectivity page's live run of this pair and method, if it made one this session."""
    return st.session_state.get("live_runs", {}).get((sel.model_a, sel.model_b), {}).get(sel.method)


def pick_record(sel: sidebar.Selection) -> dict | None:
    try:
        rec_cached = cached(sel)
    except api.LMCError as e:
        messages.error(e)
        rec_cached = None
    rec_live = live(sel)
    if rec_cached and rec_live:
        url_state.bind("align_source", "record", ["live", "cached"])
        source = st.radio("Record", ["live", "cached"], horizontal=True, key="align_source",
                          format_func={"live": "live run (Connectivity page)", "cached": "cached result"}.get)
        return rec_live if source == "live" else rec_cached
    return rec_live or rec_cached


def classes_table(rec: dict) -> None:
    """Which symmetry classes the aligner used, what each one moves, and whether the run was an ablation."""
    al = rec["alignment"]
    used, groups = al.get("classes", []), al.get("groups", {})
    asked = tuple(rec.get("config", {}).get("classes") or ())
    if rec["method"] == "naive":
        st.markdown("**Classes used: none.** Naive interpolation moves nothing: B is interpolated as trained, "
                    "the baseline every aligner is measured against.")
    elif asked:
        st.markdown(f"**Ablation:** the run was restricted to {', '.join(f'`{c}`' for c in asked)}. "
                    "Compare its barrier with a default run on the Connectivity page to see what the other "
                    "classes contribute.")
    else:
        st.markdown("**Default classes:** every exact symmetry of this architecture, with the residual stream as a "
                    "rotation wherever one is exact (RMSNorm gains folded, LayerNorm rewritten as RMSNorm first). "
                    "To measure what one class contributes, rerun with fewer: `python -m engine align A B --method "
                    f"{rec['method']} --classes heads mlp`.")
    approx = set(rec.get("endpoint_check", {}).get("approximate_classes") or [])
    left_out = rec.get("classes_left_out") or {}  # the engine's reasons (records before it: unused_reason)
    arch = rec.get("arch") or {}
    gqa = 0 < arch.get("n_kv_heads", 0) < arch.get("n_heads", 0)

    def info(c: str) -> str:
        text = CLASS_INFO.get(c, "")
        if c == "heads" and gqa:
            return text + " (under grouped-query attention: whole KV groups, then query heads within a group)"
        return text if gqa else text.replace("each KV group", "each head")
    # A markdown table wraps its long cells, where a dataframe would cut them off.
    lines = ["| | class | group | what it lets the aligner change |", "|---|---|---|---|"]
    for c in sorted(api.class_names(), key=lambda c: c not in used):
        why = f": {left_out[c]}" if c in left_out else unused_reason(c, used, arch)
        group = groups.get(c, "") + (" (approximate)" if c in approx else "") if c in used else f"*not used{why}*"
        lines.append(f"| {'✓' if c in used else '–'} | `{c}` | {group} | {info(c)} |")
    st.markdown("\n".join(lines))


def unused_reason(c: str, used: list[str], arch: dict) -> str:
    """Why a class is missing, for records without classes_left_out (docs/MATH.md sections 2-3); '' otherwise."""
    if c == "mlp_scale" and arch.get("mlp") and arch["mlp"] not in api.SCALED_MLPS:
        return f": not a symmetry of a {arch['mlp']} MLP"
    if c == "residual_perm" and "residual_orth" in used:
        return ": the rotations contain it"
    if c == "residual_orth" and "residual_perm" in used and arch.get("norm") == "layernorm":
        return ": would rewrite LayerNorm as RMSNorm, out of the model's family"
    return ""


def summary(rec: dict) -> None:
    al, check = rec["alignment"], rec.get("endpoint_check") or {}
    res = (al.get("element") or {}).get("residual", {})
    unit = style.loss_unit(rec)
    cols = st.columns(4)
    cols[0].metric("Barrier", f"{rec['barrier']:.4f}", help=f"Largest rise of the test loss above the chord, {unit}.")
    cols[1].metric("Alignment time", f"{al.get('seconds', 0):.1f} s")
    if check:
        cols[2].metric("Endpoint check", "exact" if check.get("exact") else "approximate",
                       f"{check.get('rel_diff', 0):.1e} relative", delta_color="off", delta_arrow="off",
                       help="Test loss of the moved B against B as trained: an exact symmetry leaves it unchanged "
                            f"up to float error (tolerance {check.get('tolerance', 0):g}).")
    if res.get("kind") == "orthogonal":
        cols[3].metric("Ω from identity", f"{res['distance_from_identity']:.2f}",
                       help="Frobenius distance ‖Ω − I‖ of the residual rotation; a random rotation of "
                            f"R^{len(res['matrix'])} sits near {(2 * len(res['matrix'])) ** 0.5:.1f}.")
    else:
        cols[3].metric("Residual map", res.get("kind", "none"))


COST_TEXT = ("The normalised squared distance between A's and B's weights (1: unrelated, 0: identical) before "
             "alignment and after the method moved B.")


def first_chart(rec: dict, names: dict[str, str], custom: bool) -> bool:
    """The page's first chart, under a sentence naming the worst-aligned layer: where the barrier lives (each
    block interpolated alone, what each class buys: the record's `attribution`, engine/attribution.py), or,
    for a record without one, the matching cost per layer; True when it drew the matching cost."""
    method = names.get(rec["method"], rec["method"])
    missing = alignment_figs.attribution_missing(rec, custom)
    if missing:
        sentence = alignment_figs.matching_sentence(rec, method)
        if sentence:
            st.markdown(sentence)
            charts.show(alignment_figs.matching_cost_figure(rec["alignment"]["matching_cost"], rec["method"], method),
                        key="cost_chart")
            st.caption(COST_TEXT)
        st.info(missing)
        return sentence is not None
    st.markdown(alignment_figs.attribution_sentence(rec))
    left, right = st.columns([3, 2], gap="large")
    with left:
        charts.show(alignment_figs.attribution_figure(rec, method), key="attribution_blocks")
        st.caption(alignment_figs.attribution_caption(rec))
    with right:
        fig = alignment_figs.class_rise_figure(rec, method)
        if fig is None:
            st.caption(alignment_figs.class_rise_note(rec))
        else:
            charts.show(fig, key="attribution_classes")
            st.caption("A bar: how much the midpoint barrier rises when the class is taken out of the aligned "
                       "element, B keeping its own coordinates for it; at or below zero (grey) it buys nothing here.")
    return False


def overview(rec: dict, element: dict, colour: str, names: dict[str, str], cost_drawn: bool) -> None:
    """Every layer at once; the matching cost unless the page drew it first (`cost_drawn`)."""
    arch, layers = rec["arch"], element["layers"]
    if not cost_drawn:
        st.markdown(f"**Matching cost per layer.** {COST_TEXT}")
        charts.show(alignment_figs.matching_cost_figure(rec["alignment"]["matching_cost"], rec["method"],
                                                        names.get(rec["method"], rec["method"])), key="cost_chart")
    st.markdown("**Head permutations, every layer.** A filled cell pairs A's head (row) with the B head "
                "(column) it is interpolated with; the diagonal would mean no head moved."
                + (" Outlined blocks are KV groups: query heads move only with their group." if
                   arch["n_kv_heads"] < arch["n_heads"] else ""))
    charts.show(alignment_figs.head_permutations_overview([L["head_perm"] for L in layers], arch["n_kv_heads"], colour),
                 key="heads_overview")
    left, right = st.columns(2, gap="large")
    with left:
        st.markdown(f"**Matched MLP neurons.** How alike each of A's {arch['d_mlp']:,} hidden neurons per layer "
                    "is to its matched B partner (cosine of their weights, median), against the B neuron of the "
                    "same index.")
        sims = [L.get("mlp_similarity") for L in layers]
        if all(sims):
            charts.show(alignment_figs.mlp_similarity_overview(sims, colour), key="mlp_similarity")
        else:
            st.caption(unmatched(rec))
    with right:
        res = element.get("residual", {})
        fig = alignment_figs.residual_concentration_figure(res, colour)
        st.markdown(f"**Residual map** ({res.get('kind', 'none')}).")
        if fig is None:
            st.caption("The identity: the residual stream was not aligned.")
        else:
            st.caption("For each of A's residual coordinates, the largest share it takes from one B coordinate: "
                       "1 everywhere for a permutation, small when the rotation spreads it over many.")
            charts.show(fig, key="residual_map")


def unmatched(rec: dict) -> str:
    """Why a record has no head costs or neuron similarities to draw."""
    if rec["method"] == "naive":
        return "Naive interpolation matches nothing: A's head or neuron i meets B's of the same index."
    return ("This record predates the matching view (head costs, matched-neuron similarities): press **Run** on "
            "the Connectivity page to recompute it with them.")


def layer_detail(rec: dict, element: dict, colour: str) -> None:
    arch, layers, used = rec["arch"], element["layers"], rec["alignment"].get("classes", [])
    if len(layers) > 1:
        url_state.bind("align_layer", "layer", range(len(layers)), int)
    i = st.select_slider("Layer", list(range(len(layers))), key="align_layer") if len(layers) > 1 else 0
    L = layers[i]
    group = alignment_figs.group_name(arch["n_kv_heads"], arch["n_heads"])
    left, right = st.columns(2, gap="large")
    with left:
        if L.get("head_cost"):
            charts.show(alignment_figs.head_cost_figure(L["head_cost"], L["head_perm"], arch["n_kv_heads"],
                                                        f"Head cost and the chosen permutation, layer {i}"),
                        key="head_cost")
            st.caption("What the matching saw: the distance between the heads' Q/K and V/O circuits (dark: alike), "
                       "with B in A's residual frame; the squares are the pairs it chose.")
        else:
            charts.show(alignment_figs.head_permutation_figure(L["head_perm"], arch["n_kv_heads"], colour,
                                                               f"Head permutation, layer {i}"), key="head_perm")
    with right:
        if L.get("mlp_similarity"):
            charts.show(alignment_figs.mlp_similarity_figure(L["mlp_similarity"], colour,
                                                             f"Matched MLP neurons, layer {i}"), key="mlp_similarity_layer")
            st.caption("Every neuron of A, sorted: the cosine of its weights (in, gate, out) with its matched B "
                       "neuron, and with B's neuron of the same index.")
        else:
            st.caption(unmatched(rec))
    st.markdown("**Within-head maps**")
    if "rope_scalars" in L:
        left, right = st.columns(2, gap="large")
        with left:
            z = L["rope_scalars"]
            charts.show(alignment_figs.rope_scalars_figure(z["abs"], z["angle"], api.rope_frequencies(arch),
                                                           f"Q/K: RoPE complex scalars, layer {i}", group),
                        key="rope_scalars")
            st.markdown(r"RoPE leaves the Q/K map one complex number $z = r\,e^{i\varphi}$ per frequency pair: "
                        r"$q$ turns by $\varphi$ and scales by $r$, $k$ turns by $\varphi$ and scales by $1/r$; "
                        r"$r = 1,\ \varphi = 0$ is no change.")
        with right:
            if L.get("vo_singular_values"):
                charts.show(alignment_figs.singular_values_figure({"V/O map": L["vo_singular_values"]}, group),
                            key="singular_values")
                st.markdown(r"V/O may be any invertible map $B \in GL(d)$: its singular values $\sigma_k$ say how "
                            r"far from a rotation it is (all $\sigma_k = 1$).")
    elif L.get("qk_singular_values") or L.get("vo_singular_values"):
        maps = {"Q/K map": L.get("qk_singular_values"), "V/O map": L.get("vo_singular_values")}
        charts.show(alignment_figs.singular_values_figure(maps, group), key="singular_values")
        st.markdown(r"Without RoPE both maps may be any invertible $d \times d$ matrix, $GL(d)$; singular values "
                    r"$\sigma_k$ all one would be a rotation.")
    else:
        st.caption("Not aligned: " + ("the method moves no weights." if rec["method"] == "naive" else
                   "the run used neither the `qk` nor the `vo` class."))
    missing = [c for c in ("qk", "vo") if c in used and not L.get(f"{c}_singular_values")]
    if missing:
        st.caption(f"The record carries no maps for {', '.join(missing)}.")


@st.cache_data(show_spinner=False)
def load_ablation(model_a: str, model_b: str, store: str, stamp: int) -> dict | None:
    return api.ablation_record(model_a, model_b, store)


def ablation(sel: sidebar.Selection, unit: str) -> None:
    """The pair's class ablation (`python -m engine cache build --ablation`): what each class buys alone."""
    f = api.ablation_file(sel.model_a, sel.model_b)
    abl = None if sel.custom else load_ablation(sel.model_a, sel.model_b, str(api.cache_dir()),
                                                f.stat().st_mtime_ns if f.is_file() else 0)
    if not abl or not abl.get("runs"):
        st.caption("No class ablation is stored for this pair: `python -m engine cache build --ablation` computes it "
                   "(weight matching with each class alone and all together).")
        return
    st.markdown("**Class ablation.** Weight matching restricted to one symmetry class at a time, and with all of "
                "them, against naive interpolation: how much of the barrier each class removes on its own.")
    charts.show(alignment_figs.ablation_figure(abl["runs"], unit), key="ablation_chart")
    sets = sorted({r["eval_set"] for r in abl["runs"] if r.get("eval_set")})
    st.caption(f"A reduced evaluation ({'; '.join(sets)}, {abl['points']} points on λ), so its barriers differ "
               "slightly from the full records on the Connectivity page.")


def diagnostics(rec: dict, names: dict[str, str]) -> None:
    d, method = rec["alignment"].get("diagnostics") or {}, rec["method"]
    unit = style.loss_unit(rec)
    if d.get("sweeps"):
        st.markdown(f"**Coordinate descent** stopped after {len(d['sweeps'])} sweeps: heads, within-head maps and "
                    "neurons per layer, then the residual map, until the permutations hold and the objective stalls.")
        charts.show(alignment_figs.sweeps_figure(d["sweeps"], method), key="sweeps_chart")
    if d.get("mlp_matched_correlation"):
        st.markdown(f"**Activation statistics** over {d.get('tokens', 0):,} tokens: the mean correlation of each "
                    "A neuron with the B neuron it was matched to.")
        charts.show(alignment_figs.correlation_figure(d["mlp_matched_correlation"], method), key="correlation_chart")
    if d.get("history"):
        batch = (d.get("settings") or {}).get("batch")  # set where a run chose it (the store's small LM records)
        per_step = f" of {batch} {'images' if unit == 'nats/image' else 'sequences'}" if batch else ""
        k, heads = ((d.get("settings") or {}).get(key) for key in ("candidates", "keep_heads"))
        kept = [what for what, held in (("head permutation", heads),
                                        ("MLP permutation (one candidate per neuron)", k == 1)) if held]
        mlp = "" if not k or k == 1 else f" Each MLP neuron chooses among {k} candidate partners."
        if kept:
            mlp += f" The {' and the '.join(kept)} {'are' if len(kept) > 1 else 'is'} the start's; the other " \
                   "classes are learned."
        st.markdown(f"**Optimisation** ({d['steps']:,} steps{per_step}, Adam on the transform's latents, the "
                    "models frozen): the kept transform is the one with the lowest validation barrier (the largest "
                    f"excess over the chord at λ = 0.1, 0.3, …, 0.9), step {d['best_step']}, "
                    f"{d['best_val_barrier']:.4f} {unit}.{mlp}")
        charts.show(alignment_figs.history_figure(d, method, unit, names), key="history_chart")
        notes = []
        if (d.get("one_sided_same_budget") or {}).get("from_learned_record"):
            notes.append("The dashed one-sided run is the stored learned record's: the very optimisation this "
                         "comparison runs (same start, data, λ draws and steps), taken rather than run again.")
        if d.get("one_sided_skipped"):
            notes.append(f"No one-sided comparison: {d['one_sided_skipped']}.")
        if d.get("resumed_at"):
            steps = ", ".join(f"{s:,}" for s in d["resumed_at"])
            notes.append(f"The run was interrupted and resumed from its saved state at step"
                         f"{'s' if len(d['resumed_at']) > 1 else ''} {steps}; a resumed "
                         "run ends exactly where the uninterrupted one would.")
        start = d.get("start_element")
        if start:
            barrier = start.get("barrier")
            made = f"a {start['method']} run" if start.get("method") else "an earlier run"
            steps = f" of {start['steps']:,} steps" if start.get("steps") else ""
            notes.append(f"Started from {start['file']}, the element {made}{steps} saved"
                         + (f" (barrier {barrier:.4f} {unit})" if isinstance(barrier, (int, float)) else "")
                         + ", not from weight matching: step 0 is that run's kept element.")
        if notes:
            st.caption(" ".join(notes))
    ident = d.get("identity")
    if ident:
        st.markdown("**Dual / one-sided identity** (docs/MATH.md section 4.5). Every action is linear and exact, "
                    "so the dual path's loss equals the one-sided loss of the relative transform g_A⁻¹ g_B at every λ.")
        c = st.columns(3)
        c[0].metric("Loss, max relative gap", f"{ident['max_relative_error']:.1e}")
        c[1].metric("Logits, max relative gap", f"{ident['max_logit_relative_error']:.1e}")
        one = d.get("one_sided_same_budget")
        if one:
            c[2].metric("Dual − one-sided", f"{one['dual_minus_one_sided_barrier']:+.4f}", delta_color="off",
                        help=f"Best validation barrier ({unit}) at the same {one['steps']} steps: a difference is "
                             "an optimisation effect, not a different optimum.")
        st.dataframe([{"λ": lam, "dual": a, "one-sided": b}
                      for lam, a, b in zip(ident["lambdas"], ident["loss_dual"], ident["loss_one_sided"])],
                     hide_index=True)
    if not (d.get("sweeps") or d.get("mlp_matched_correlation") or d.get("history")):
        st.caption("Nothing to show: the method has no iterations." if method == "naive" else
                   "The record carries no diagnostics for this method.")


st.title("Alignment")
st.caption("The group element g that moves model B onto model A before the two are interpolated: which heads and "
           "neurons are paired, the maps inside each head, the rotation of the residual stream. Since g is a "
           "symmetry, g·θ_B computes exactly what θ_B does; only the path between the models changes.")

sel = sidebar.selection()
names = sidebar.methods()
st.subheader(sel.title)
description = messages.check_pair(sel)  # the same message for the same problem as on every page
if description:
    st.caption(f"Model A `{api.display_name(sel.model_a)}`, model B `{api.display_name(sel.model_b)}`, "
               f"{names.get(sel.method, sel.method)}: {description}")
rec = pick_record(sel) if description else None
if description and rec is None:
    st.info(f"No record of {names.get(sel.method, sel.method)} for this pair: press **Run** on the Connectivity "
            "page (its result appears here), or precompute it with `python -m engine cache build --methods "
            f"{sel.method}`.")
elif rec is not None and not rec.get("alignment"):
    st.warning("This record has no alignment field: it was written before the aligners recorded their element.")
elif rec is not None:
    colour = style.method_colour(rec["method"])
    cost_drawn = first_chart(rec, names, sel.custom)  # above the fold: the numbers and tables come after it
    summary(rec)
    classes_table(rec)
    element = rec["alignment"]["element"]
    if rec["alignment"].get("element_a"):
        url_state.bind("align_side", "side", list(SIDES))
        side = st.radio("Transform", list(SIDES), format_func=SIDES.get, horizontal=True, key="align_side",
                        help="Dual matching moves both models toward a shared path; interpolating between "
                             "g_A·θ_A and g_B·θ_B is the same as between θ_A and g_A⁻¹ g_B·θ_B.")
        element = rec["alignment"]["element_a"] if side == "a" else element
    layer = st.session_state.get("align_layer")
    if layer is not None:  # a closed "One layer" tab draws no slider: its layer is kept for when it opens again
        if layer < len(element["layers"]):
            st.session_state["align_layer"] = layer
        else:
            del st.session_state["align_layer"]
    # Only the open tab runs (a tab switch reruns the page): a page switch builds, sends and draws its charts
    # alone, not every tab's (4 of 9 charts for weight matching, 2 of 4 for naive).
    tabs = ["All layers", "One layer", "Method diagnostics", "Class ablation"]
    url_state.bind("align_tab", "tab", tabs)
    tab_all, tab_layer, tab_opt, tab_ablation = st.tabs(tabs, key="align_tab", on_change="rerun")
    if tab_all.open:
        with tab_all:
            overview(rec, element, colour, names, cost_drawn)
    if tab_layer.open:
        with tab_layer:
            layer_detail(rec, element, colour)
    if tab_opt.open:
        with tab_opt:
            diagnostics(rec, names)
    if tab_ablation.open:
        with tab_ablation:
            ablation(sel, style.loss_unit(rec))
    with st.expander("Export", icon=":material/download:"):
        downloads.record_downloads(rec, key="align_export")
        charts.download_button(key="align_figures", label="Every figure shown (HTML)",
                               about=[(rec, names.get(rec["method"], rec["method"]))])
