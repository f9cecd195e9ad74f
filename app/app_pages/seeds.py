"""Seeds: more than two models in one basis (engine.multi, docs/MATH.md section 10).

The stored multi-model records (cached_results/multi/, `python -m engine cache build --multi`): three or more
seeds of one recipe aligned into one basis, to the first model or to their barycentre; the barrier between
every pair of them before and after, as two heatmaps, and the loss over the triangle of three aligned
models. Nothing here computes: the engine reads the store, app.figures draws.
"""

from __future__ import annotations

import streamlit as st

from app import downloads, exports, url_state
from app.figures import seeds as seed_figs
from app.figures.style import loss_unit
from engine import api

BASIS_LABELS = {"reference": "To the first model", "barycentre": "To their barycentre"}


@st.cache_data(show_spinner=False, max_entries=2)
def records(stamp: int) -> tuple[list[dict], list[str]]:
    """api.multi_records, read again only when `stamp` (api.multi_stamp) changes."""
    return api.multi_records()


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


charts = downloads.Charts("Seeds")  # every chart of this rerun, for the page's figure download
st.title("Seeds: more than two models")
st.caption("Several seeds of one recipe, aligned into one shared basis by weight matching: to the first model "
           "(each other model matched onto it), or to their barycentre (every model matched onto the mean of "
           "the aligned models, until no permutation changes). Every aligned model computes its own function "
           "exactly; what changes is where it sits in weight space.")
recs, skipped = records(api.multi_stamp())
for s in skipped:
    st.warning(s)
if not recs:
    st.info("No multi-model record is stored. `python -m engine cache build --multi` builds the zoo's (three "
            "seeds of the learned-PE ViT); `python -m engine multi A B C --out FILE.json` runs any set.")
else:
    sets = list(dict.fromkeys(" · ".join(r["models"]) for r in recs))
    if len(sets) > 1:
        url_state.bind("seeds_set", "set", sets)
        chosen = st.selectbox("Models", sets, key="seeds_set")
    else:
        chosen = sets[0]
    if len(sets) == 1:
        st.markdown(f"**Models:** {', '.join(f'`{m}`' for m in recs[0]['models'])}")
    here = {r["to"]: r for r in recs if " · ".join(r["models"]) == chosen}
    url_state.bind("seeds_basis", "basis", list(here))
    to = st.radio("Shared basis", list(here), format_func=BASIS_LABELS.get, key="seeds_basis", horizontal=True)
    rec = here[to]
    before, after = (seed_figs.off_diagonal(rec[s]["barrier"]) for s in ("before", "after"))
    unit = loss_unit(rec)
    c1, c2, c3 = st.columns(3)
    c1.metric(f"Mean pairwise barrier, before ({unit})", f"{mean(before):.3f}")
    c2.metric(f"Mean pairwise barrier, after ({unit})", f"{mean(after):.3f}",
              delta=f"{mean(after) - mean(before):+.3f}", delta_color="inverse")
    c3.metric(f"Triangle centroid, excess ({unit})", f"{rec['triangle']['centroid']['excess']:+.3f}")
    charts.show(seed_figs.barrier_heatmaps(rec), key="seeds_barriers")
    charts.show(seed_figs.triangle(rec), key="seeds_triangle")
    al, ex = rec["alignment"], rec["exactness"]
    how = (f"{len(al['rounds']) - 1} barycentre round(s), permutation changes per round "
           f"{[r['permutation_changes'] for r in al['rounds'][1:]]}: {al['stop']}. " if to == "barycentre" else "")
    st.caption(f"{rec['eval_set']}; classes {', '.join(rec['classes'])}. {how}Every aligned model's loss is within "
               f"{max(m['rel_diff'] for m in ex['models']):.1e} (relative) of its own. The triangle's corners are "
               f"{', '.join(rec['models'][i] for i in rec['triangle']['models'])}; the excess is the loss above the "
               "plane through the corners' losses, largest on the grid "
               f"{rec['triangle']['barrier']:.3f}.")
    stem = exports.safe(f"{'__'.join(rec['models'])}__{to}")
    cols = st.columns(2)
    with cols[0]:
        st.download_button("Multi-model record (JSON)", lambda: exports.record_json(rec), f"{stem}.json",
                           "application/json", key="seeds_record", on_click="ignore", icon=":material/download:")
    with cols[1]:
        charts.download_button(key="seeds_figures", subject=f"{chosen}, {BASIS_LABELS[to].lower()}")
