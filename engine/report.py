"""The symmetry report of a model or a config: JSON for `python -m engine symmetry` and the app, and
its text table.

`symmetry_report` bundles the checks (engine/checks.py) and the group facts (engine/groups.py);
`format_report` prints it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.checks import break_tests, invariance_checks, reference_model, rope_breaking
from engine.groups import group_dimension, sinusoidal_spectrum
from engine.models import arch_from_config, canonical, load_model
from engine.models.base import Arch, Model
from engine.models.io import PICKLE_SUFFIXES, read_json_object
from engine.spec import Spec, arch_kinds, build_spec, check_arch

__all__ = ["format_report", "plain_statement", "symmetry_report"]


def _target(model_or_config_path, dims_only: bool) -> tuple[Model | None, Arch, str]:
    """(model or None, arch, display name): weights are loaded only when they exist and are wanted."""
    if isinstance(model_or_config_path, Model):
        m = model_or_config_path
        return m, m.arch, m.name or m.family
    if isinstance(model_or_config_path, dict):
        return None, arch_from_config(model_or_config_path), "config"
    path = name = Path(model_or_config_path)
    if not path.exists():  # a zoo name: reported by that name, not by where this machine keeps it
        from engine.zoo import resolve

        path = resolve(str(model_or_config_path))
    if path.is_dir() and not dims_only and any(p.suffix in (".safetensors", *PICKLE_SUFFIXES) for p in path.iterdir()):
        from engine.pipeline import model_info

        model_info(path)  # weights to load (pickles alone too): refused as align refuses them, naming the directory
        m = load_model(path, dtype=torch.float64)
        return m, m.arch, str(name)
    cfg_file = path if path.is_file() else path / "config.json"
    return None, arch_from_config(read_json_object(cfg_file), str(cfg_file)), str(name)


def symmetry_report(model_or_config_path, dims_only: bool = False, k: int = 3, seed: int = 0) -> dict:
    """JSON-ready symmetry diagnostics of a Model, a model directory, a config.json path or a config dict.

    {"model", "family", "arch", "kinds", "approximate", "requires", "checks": [{group, kind,
    max_rel_change, exact, note}], "breaks": [same], "group_dim": {per_layer, total, by_kind, notes},
    "rope": [per pair], "sinusoidal": {spectrum}, "dims_only"}. Without weights (a bare config, or
    dims_only) checks and breaks are empty.
    """
    model, arch, name = _target(model_or_config_path, dims_only)
    weights = model is not None and not dims_only
    rep: dict = {"model": name, "family": arch.family, "arch": arch.to_dict(), "dims_only": not weights,
                 "checks": [], "breaks": []}
    if weights:
        spec: Spec = build_spec(arch, canonical(model))
        rep |= {"kinds": list(spec.kinds), "approximate": sorted(spec.approximate), "requires": dict(spec.requires)}
        try:
            rep["checks"] = invariance_checks(model, k=k, seed=seed)
            rep["breaks"] = break_tests(model, seed=seed)
        finally:
            reference_model.cache_clear()  # a float64 copy of a big model is not worth keeping around
    else:
        check_arch(arch)
        kinds = list(arch_kinds(arch))  # a post-norm stream has no rotations (docs/MATH.md section 9)
        rep |= {"kinds": kinds, "approximate": ["residual_orth", "residual_perm"] if arch.pe == "sinusoidal" else [],
                "requires": {}}
    rep["group_dim"] = group_dimension(arch)
    if arch.pe == "rope":
        rep["rope"] = rope_breaking(arch)
    if arch.pe == "sinusoidal":
        sp = sinusoidal_spectrum(arch.n_ctx, arch.d_model)
        rep["sinusoidal"] = {k2: v for k2, v in sp.items() if k2 != "singular_values"} | {
            "singular_values": sp["singular_values"][:8] + sp["singular_values"][-8:]}
    return rep


def format_report(report: dict) -> str:
    """A human-readable table of a symmetry_report."""
    a = report["arch"]
    lines = [f"{report['model']} ({report['family']}): {a['task']}, {a['n_layers']} layers, D={a['d_model']}, "
             f"h={a['n_heads']} (kv {a['n_kv_heads']}), d={a['d_head']}, m={a['d_mlp']}, pe={a['pe']}"
             + (f" ({a['rope_layout']}, rotary {a['rotary_dim']})" if a["pe"] == "rope" else "")
             + (f", {json.loads(a['rope_scaling'])['rope_type']} frequency scaling" if a.get("rope_scaling") else "")
             + (", QK-norm" if a.get("qk_norm") else "")
             + f", {a['norm']}, {a['mlp']}"]

    def table(title: str, rows: list[dict]) -> None:
        if not rows:
            return
        lines.append("")
        lines.append(f"{title:<26} {'group':<60} {'max rel change':>15}  exact")
        for r in rows:
            c = "-" if r["max_rel_change"] is None else f"{r['max_rel_change']:.2e}"
            lines.append(f"{r['group']:<26} {r['kind'][:60]:<60} {c:>15}  {'yes' if r['exact'] else 'no'}"
                         + (f"  ({r['note']})" if r.get("note") else ""))

    table("invariance check", report["checks"])
    table("break test", report["breaks"])
    gd = report["group_dim"]
    lines.append("")
    lines.append("group dimension (continuous)")
    for k, v in gd["by_kind"].items():
        lines.append(f"  {k:<16} {v:>14,}")
    if gd["per_layer"]:
        lines.append(f"  per layer: attention {gd['per_layer'][0]['attention']:,}, mlp {gd['per_layer'][0]['mlp']:,}")
    lines.append(f"  total            {gd['total']:>14,}")
    lines += [f"  note: {n}" for n in gd["notes"]]
    if report.get("rope"):
        lines.append("")
        lines.append("RoPE breaking per pair (max |sin(omega n)|, n < context)")
        rows = report["rope"]
        for r in rows if len(rows) <= 8 else rows[:4] + rows[-4:]:
            lines.append(f"  pair {r['pair']:>3}  omega {r['omega']:.3e}  omega*T {r['omega_ctx']:10.3g}  "
                         f"strength {r['strength']:.3f}")
    if report.get("sinusoidal"):
        s = report["sinusoidal"]
        lines.append("")
        lines.append(f"sinusoidal table {s['n_pos']}x{s['d_model']}: sigma_max {s['sigma_max']:.3g}, "
                     f"sigma_min {s['sigma_min']:.3g}, {s['n_below_rtol']} below {s['rtol']:g} sigma_max")
    if report["dims_only"]:
        lines.append("")
        lines.append("dimensions from the config only: no invariance checks or break tests were run")
    return "\n".join(lines)


def plain_statement(report: dict, tol: float | None = None) -> str:
    """What the checks found, in plain words: which symmetries are exact (measured below `tol`), which are
    not and by how much, which could not be tested, and whether every break test broke."""
    from engine.checks import EXACT_TOL

    tol = EXACT_TOL if tol is None else tol
    if report["dims_only"]:
        return "Dimensions from the config only: no weights, so nothing was measured."
    exact = [r["group"] for r in report["checks"] if r["max_rel_change"] is not None and r["max_rel_change"] < tol]
    inexact = [r for r in report["checks"] if r["max_rel_change"] is not None and r["max_rel_change"] >= tol]
    untested = [r["group"] for r in report["checks"] if r["max_rel_change"] is None]
    parts = [f"Exact (the output changes by less than {tol:.0e}): {', '.join(exact)}." if exact else
             "No symmetry was exact."]
    if inexact:
        parts.append("Not exact: " + "; ".join(f"{r['group']} changes it by {r['max_rel_change']:.1e}"
                                               for r in inexact) + ".")
    if untested:
        parts.append(f"No group element to test: {', '.join(untested)}.")
    broke = [r for r in report["breaks"] if r["max_rel_change"] is not None]
    if broke:
        low = min(r["max_rel_change"] for r in broke)
        held = [r["group"] for r in broke if r["max_rel_change"] < tol]
        parts.append(f"Every one of the {len(broke)} break tests changes the output (by {low:.1e} or more), as a "
                     "map outside the group must." if not held else
                     f"Break tests that did NOT change the output: {', '.join(held)}.")
    return " ".join(parts)
