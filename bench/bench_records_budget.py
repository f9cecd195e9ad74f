"""Barrier against CPU seconds, read from the cached learned and dual records (no new run).

Every learned / dual record keeps its optimisation history: at each validation check the step, the
seconds of optimisation so far and the validation barrier (the largest excess over the chord at
lambda = 0.1, 0.3, ..., 0.9 on the fixed validation batch; records from before path validation keep
the midpoint loss only and are listed as such). This prints, per record, the validation barrier at a
few fractions of the run against the seconds they took, and the test-split barrier of the kept
element, as a Markdown table for bench/RESULTS.md.

    python bench/bench_records_budget.py [--store cached_results] [--fractions 0.25 0.5 0.75 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def at_fraction(hist: dict, key: str, frac: float) -> tuple[float, float, int]:
    """(seconds, value, step) of the last check at or before `frac` of the run's checks."""
    i = max(0, round(frac * (len(hist["step"]) - 1)))
    return hist["seconds"][i], hist[key][i], hist["step"][i]


def rows(store: Path, fractions: list[float]) -> list[str]:
    out = []
    for f in sorted(store.glob("*__learned.json")) + sorted(store.glob("*__dual.json")):
        rec = json.loads(f.read_text())
        d = rec["alignment"]["diagnostics"]
        hist = d.get("history")
        if not hist:
            continue
        key = "val_barrier" if "val_barrier" in hist else None
        cells = []
        for frac in fractions:
            if key is None:
                cells.append("")
                continue
            s, v, step = at_fraction(hist, key, frac)
            cells.append(f"{v:.3f} ({step}, {s:.0f} s)")
        pair = rec["model_a"].rsplit("-s", 1)[0]
        settings = d.get("settings") or {}
        out.append(f"| {pair} | {rec['method']} | {settings.get('lambdas', 'narrow')} | "
                   + " | ".join(cells) + f" | {d.get('best_step')} | **{rec['barrier']:.3f}** |"
                   + (f" {100 * rec['accuracy_drop']:.1f} pt |" if rec.get("accuracy_drop") is not None else " |"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=ROOT / "cached_results")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    args = ap.parse_args()
    head = " | ".join(f"validation barrier at {frac:.0%} (step, seconds)" for frac in args.fractions)
    print(f"| pair | method | lambda sampling | {head} | kept step | test barrier | accuracy drop |")
    print("|---|---|---|" + "---|" * len(args.fractions) + "---|---|---|")
    print("\n".join(rows(args.store, args.fractions)))


if __name__ == "__main__":
    main()
