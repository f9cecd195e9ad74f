"""The zoo's symmetry views, precomputed by `cache build` into cached_results/symmetry/ and read back
at once; a changed model is computed again, a custom directory always is."""


from engine import api
from engine.report import plain_statement


def test_a_stored_view_is_read_back_until_the_weights_change(tiny_dirs, monkeypatch):
    name = "lm-rope-s0"
    assert not api.has_precomputed_symmetry(name)
    assert api.build_symmetry([name]) == [name]
    stored = api.symmetry_view(name)
    assert stored["precomputed"] and api.has_precomputed_symmetry(name)
    fresh = api.symmetry_view(name, precomputed=False)
    assert {k: v for k, v in stored.items() if k != "precomputed"} == \
        {k: v for k, v in fresh.items() if k != "precomputed"}
    assert stored["statement"] == plain_statement(stored["report"])

    def no_work(*a, **k):
        raise AssertionError("an up-to-date view was recomputed")

    monkeypatch.setattr("engine.report.symmetry_report", no_work)
    assert api.build_symmetry([name]) == [name]  # kept
    weights = api.ENTRIES[name].path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))  # other weights: the stored view is stale
    assert not api.has_precomputed_symmetry(name)


def test_a_stored_view_names_the_zoo_model_not_where_it_lies(tiny_dirs):
    api.build_symmetry(["lm-rope-s0"])
    stored = api.symmetry_view("lm-rope-s0")
    assert stored["precomputed"] and stored["report"]["model"] == "lm-rope-s0"
    assert str(tiny_dirs) not in repr(stored)


def test_the_statement_says_what_is_exact_and_what_breaks(tiny_dirs):
    view = api.symmetry_view("lm-rope-s0", precomputed=False)
    text = view["statement"]
    exact = [r["group"] for r in view["report"]["checks"] if r["max_rel_change"] < api.EXACT_TOL]
    assert text.startswith(f"Exact (the output changes by less than 1e-10): {', '.join(exact)}.")
    assert f"Every one of the {len(view['report']['breaks'])} break tests changes the output" in text
    assert api.symmetry_view("lm-rope-s0", dims_only=True)["statement"].startswith("Dimensions from the config")
    md = api.symmetry_markdown(view["report"]).decode()
    assert md.startswith("# Symmetry report: lm-rope-s0\n\n" + text)
