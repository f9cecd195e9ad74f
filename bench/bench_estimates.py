"""Calibrate the arithmetic time estimate (engine.timing.arithmetic_seconds).

    .venv/bin/python bench/bench_estimates.py [--store cached_results] [--repeats 3]

Efficiency: FLOPs per second a kind of work reaches over the machine's speed (reference_gflops)
at that moment. The shipped records keep no speed of their own (they predate
provenance.reference_gflops), and this machine's speed swings with its other work, so the fit has an
anchor measured now and the rest from the records:

1. Fresh runs, each measuring the speed as it starts (its provenance.reference_gflops): naive, weight
   and activation matching on a zoo ViT and LM pair, small paths (`--repeats` each). Their path gives
   the efficiency of evaluation, their alignment that of matching.
2. Every shipped record: its own path, at the evaluation efficiency of (1), says how fast the machine
   was when it ran; its alignment's FLOPs over its seconds at that speed give the efficiency of
   learned and dual optimisation and of matching, its loading the bytes per second. Matching is
   measured both ways: the ratio of its fresh to its store efficiency corrects the store's
   optimisation efficiency for how far the speeds the paths imply are off.

Prints the constants engine/timing.py takes (medians), their spread, and how far the arithmetic
with them lands from each kind of timing (predicted over measured seconds, min - max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from engine.attribution import items as attribution_items
from engine.timing import (
    align_flops,
    attribution_evaluations,
    forward_flops,
    param_count,
    record_items,
    record_train_items,
    weight_sweep_flops,
)

ROOT = Path(__file__).resolve().parent.parent


def fresh(repeats: int) -> dict[str, list[float]]:
    """Efficiencies of evaluation and matching from runs made now (each with its own speed)."""
    from engine import api

    out: dict[str, list[float]] = {"evaluate": [], "match": []}
    for a, b, items in (("vit-learned-s0", "vit-learned-s1", 180), ("lm-rope-s0", "lm-rope-s1", 2048)):
        for method in ("naive", "weight", "activation") * repeats:
            rec = api.run_pair(api.RunConfig(a, b, method, eval_items=items, points=5), attribution=False)
            rate, t = rec["provenance"]["reference_gflops"] * 1e9, rec["timings"]
            flops = len(rec["lambdas"]) * (record_items(rec) + record_train_items(rec)) * forward_flops(rec["arch"])
            out["evaluate"].append(flops / (t["interpolate"] * rate))
            if method != "naive":
                n = len(rec["alignment"]["diagnostics"]["sweeps"]) if method == "weight" else 1
                work = n * weight_sweep_flops(rec["arch"]) if method == "weight" else align_flops(method, rec["arch"], 0)
                out["match"].append(work / (t["align"] * rate))
            print(f"  {a} {method}: speed {rate / 1e9:.1f} GFLOP/s, path {t['interpolate']:.2f} s, "
                  f"align {t['align']:.2f} s", flush=True)
    return out


def work(rec: dict) -> dict[str, list[tuple[float, float]]]:
    """(FLOPs, seconds) of each kind of work the record timed."""
    arch, t = rec["arch"], rec["timings"]
    f, n, k = forward_flops(arch), record_items(rec), len(rec["lambdas"])
    out: dict[str, list] = {"evaluate": [], "match": [], "optimise": [], "load": []}
    out["evaluate"].append((k * (n + record_train_items(rec)) * f, t["interpolate"]))
    if t.get("interpolate_aligned_coordinates", 0) > 0.1:  # naive's second path (test split only)
        out["evaluate"].append((k * n * f, t["interpolate_aligned_coordinates"]))
    if "attribution" in t:
        items = attribution_items(arch["task"], n)
        out["evaluate"].append((attribution_evaluations(rec["method"], arch) * items * f, t["attribution"]))
    out["load"].append((2 * 4 * param_count(arch), t["load"]))  # bytes, not FLOPs
    d = (rec.get("alignment") or {}).get("diagnostics") or {}
    m = rec["method"]
    if m == "weight":
        out["match"].append((len(d["sweeps"]) * weight_sweep_flops(arch), t["align"]))
    elif m == "activation":
        out["match"].append((align_flops(m, arch, 0), t["align"]))
    elif m in ("learned", "dual"):
        out["optimise"].append((align_flops(m, arch, d["steps_done"]), t["align"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(ROOT / "cached_results"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    now = fresh(args.repeats)
    eff = {k: statistics.median(v) for k, v in now.items()}
    for k, v in now.items():
        print(f"fresh {k}: median {eff[k]:.3g} (min {min(v):.3g}, max {max(v):.3g}, {len(v)} runs)")
    rows: dict[str, list] = {"match": [], "optimise": [], "load": []}
    sweeps, speeds = [], []
    for f in sorted(Path(args.store).glob("*__*__*.json")):
        name, rec = f.name.removesuffix(".json"), json.loads(f.read_text())
        kinds = work(rec)
        flops, s = kinds["evaluate"][0]  # its path
        rate = flops / s / eff["evaluate"]  # the machine's speed then, as its path says
        speeds.append(rate / 1e9)
        for kind, found in rows.items():
            for w, sec in kinds[kind]:
                if sec > 0.05:  # shorter timings are mostly the clock's and Python's
                    found.append((name, sec, w / sec if kind == "load" else w / (sec * rate)))
        if rec["method"] == "weight":
            sweeps.append(len(rec["alignment"]["diagnostics"]["sweeps"]))
    print(f"store: the machine's speed its records' paths imply, median {statistics.median(speeds):.1f} GFLOP/s "
          f"(min {min(speeds):.1f}, max {max(speeds):.1f})")
    print(f"store: weight matching sweeps, median {statistics.median(sweeps)} of {sorted(sweeps)}")
    print("\n| kind | from | timings | efficiency (load: MB/s), median | min | max | predicted / measured, min - max |")
    print("|---|---|---|---|---|---|---|")
    for k, v in now.items():
        print(f"| {k} | fresh runs | {len(v)} | {eff[k]:.3g} | {min(v):.3g} | {max(v):.3g} | "
              f"{min(v) / eff[k]:.2f} - {max(v) / eff[k]:.2f} |")
    for kind, r in rows.items():
        vals = [x[2] for x in r]
        m, scale = statistics.median(vals), (1e6 if kind == "load" else 1)
        print(f"| {kind} | store | {len(r)} | {m / scale:.3g} | {min(vals) / scale:.3g} | {max(vals) / scale:.3g} | "
              f"{min(vals) / m:.2f} - {max(vals) / m:.2f} |")
    store = {kind: statistics.median(x[2] for x in r) for kind, r in rows.items()}
    bias = eff["match"] / store["match"]  # matching measured both ways: how far the store's implied speeds are off
    print(f"\nconstants: evaluate {eff['evaluate']:.3g}, match {eff['match']:.3g}, optimise {store['optimise'] * bias:.3g} "
          f"(the store's {store['optimise']:.3g} times matching's fresh / store ratio {bias:.2f}); "
          f"load {store['load'] / 1e6:.3g} MB/s")
    print("\nPer record (efficiency; load in MB/s):")
    for kind, r in rows.items():
        for name, sec, v in r:
            print(f"  {kind:9s} {name:62s} {sec:9.2f} s  {v / 1e6 if kind == 'load' else v:.3g}")


if __name__ == "__main__":
    main()
