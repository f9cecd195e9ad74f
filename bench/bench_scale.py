"""Scale benchmarks: GPT-2-small-, GQA-Llama- and GPT-NeoX-shaped pairs with a known answer, and independent pairs.

    .venv/bin/python bench/bench_scale.py [--dir /tmp/lmc-bench] [--pairs gpt2-planted ...] [--tasks weight ...]

Pairs (built once into --dir, float32 safetensors, HF's own initialisation):
    gpt2-planted   GPT-2-small (124M); B = g*.A + noise, g* a random element of the default classes
                   (heads, MLP neurons, residual permutation), noise 1e-3 of each tensor's std
    gpt2-indep     two GPT-2-small initialisations (seeds 0 and 1)
    llama-planted  GQA Llama, 4 layers, D 1024, 16 heads in 4 KV groups, m 2816, vocabulary 32,000
                   (110M); g* of every default class, residual rotation included
    tinyllama-planted  TinyLlama-1.1B's shape (22 layers, D 2048, 32 heads in 4 KV groups, m 5632,
                   vocabulary 32,000, untied): the same planting, both models stored as released ones
                   are, bfloat16 safetensors in 1 GB shards with model.safetensors.index.json
    pythia-planted Pythia-1B's shape, GPT-NeoX (16 layers, D 2048, 8 heads of 256, RoPE on a quarter of each
                   head, parallel residual, LayerNorm with biases, GELU MLP 8192, vocabulary 50,304, untied;
                   1.01B): planted with the residual stream permuted (LayerNorm), stored the same way
    tinyllama-indep, pythia-indep  two initialisations of that shape (seeds 0 and 1), stored the same way
Tasks, each in a fresh process so that its peak memory is its own:
    weight         align(..., "weight", in_place=True): the aligner alone
    activation     align(..., "activation", in_place=True)
    learned, dual  align(..., steps=--steps, default 3), validated once, at the last step
    run            engine.api.run_pair: load, align (weight), 3-point path on --eval-items tokens (2,048), endpoint
                   check (and the train curve; the attribution when the default rule runs it)
    eval           engine.evaluate on 4,096 tokens of the bundled corpus (byte ids)
Figures: time in units of one 2048 x 2048 float32 matmul measured in the same process (best of 5,
before and after, averaged), resident memory as a multiple of one model's bytes (the kernel's peak, VmHWM, reset
before the task, minus the resident memory before it; `run` counts from before loading), evaluation
FLOP rate (2 x parameters x tokens) as a fraction of the matmul rate, and the load average. `run`
imports everything a run needs (and loads one model once, then frees it) before its baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIRS = ("gpt2-planted", "gpt2-indep", "llama-planted", "tinyllama-planted", "tinyllama-indep", "pythia-planted",
         "pythia-indep")
TASKS = ("weight", "activation", "learned", "dual", "run", "eval")
LLAMA = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
         "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": 256, "tie_word_embeddings": False}
TINYLLAMA = {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
PYTHIA = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 8, "intermediate_size": 8192,
          "vocab_size": 50304, "rotary_pct": 0.25, "max_position_embeddings": 2048, "tie_word_embeddings": False}
CONFIGS = {"llama": LLAMA, "tinyllama": TINYLLAMA, "pythia": PYTHIA}
STORED = {"tinyllama": "bfloat16", "pythia": "bfloat16"}  # kinds stored as released checkpoints are: this dtype, sharded
SHARD = "1GB"


# ---------------------------------------------------------------------------------------------
# Building the pairs


def build_pairs(root: Path, names: list[str]) -> None:
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from engine.align.pair import prepare_pair
    from engine.classes import default_classes
    from engine.models import canonical, load_model, save_model, set_canonical
    from engine.spec import build_spec
    from engine.symmetry import apply, sample

    def store(module, kind: str, out: Path) -> None:
        if kind in STORED:
            module.to(getattr(torch, STORED[kind])).save_pretrained(out, safe_serialization=True, max_shard_size=SHARD)
        else:
            module.save_pretrained(out, safe_serialization=True)

    def init(kind: str, seed: int, out: Path) -> None:
        if (out / "config.json").exists():
            return
        torch.manual_seed(seed)
        if kind == "gpt2":
            m = GPT2LMHeadModel(GPT2Config())
        elif kind == "pythia":
            m = GPTNeoXForCausalLM(GPTNeoXConfig(**CONFIGS[kind]))
        else:
            m = LlamaForCausalLM(LlamaConfig(**CONFIGS[kind]))
        store(m, kind, out)

    def plant(kind: str, src: Path, out: Path, seed: int) -> None:
        if (out / "config.json").exists():
            return
        a = load_model(src)
        # the residual stream permuted, not rotated: B stays in GPT-2's (or GPT-NeoX's) LayerNorm format (a rotation
        # needs the RMSNorm rewrite, which the family's checkpoint cannot hold); aligning it still uses
        # the default classes, rotation included
        kinds = default_classes(build_spec(a.arch, canonical(a, copy=False)))
        if "residual_orth" in kinds and a.arch.norm == "layernorm":
            kinds = (kinds - {"residual_orth"}) | {"residual_perm"}
        pair = prepare_pair(a, a, kinds, in_place=True)  # RMSNorm gains folded into A itself
        g = sample(pair.arch, kinds, seed=seed)
        moved = apply(pair.arch, g, pair.params_a)
        gen = torch.Generator().manual_seed(seed)
        for v in moved.values():  # small noise: recovery must be robust, not bit-exact
            v.add_(torch.randn(v.shape, generator=gen, dtype=v.dtype) * 1e-3 * float(v.std().nan_to_num(0.0)))
        set_canonical(a, moved)
        del moved
        if kind in STORED:
            store(a.module, kind, out)
        else:
            save_model(a, out)
        (out / "planted.json").write_text(json.dumps({"kinds": sorted(kinds), "seed": seed}))

    for name in names:
        kind = name.split("-")[0]
        init(kind, 0, root / f"{kind}-s0")
        if name.endswith("planted"):
            plant(kind, root / f"{kind}-s0", root / f"{kind}-planted", seed=3)
        else:
            init(kind, 1, root / f"{kind}-s1")


def pair_dirs(root: Path, name: str) -> tuple[Path, Path]:
    kind = name.split("-")[0]
    return root / f"{kind}-s0", root / (f"{kind}-planted" if name.endswith("planted") else f"{kind}-s1")


# ---------------------------------------------------------------------------------------------
# One task in this process


def matmul_seconds() -> float:
    import torch

    x = torch.randn(2048, 2048)
    x @ x
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x @ x
        best = min(best, time.perf_counter() - t)
    return best


def measure(task: str, a_dir: Path, b_dir: Path, classes: list[str] | None = None, steps: int = 3,
            log: Path | None = None, dtype: str = "float32", eval_items: int = 2048) -> dict:

    import torch

    from engine.resources import return_freed_memory

    return_freed_memory()
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * page

    def hwm() -> int:  # peak resident memory since the last reset, tracked by the kernel (no sampling thread)
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    unit0 = matmul_seconds()
    out: dict = {"task": task, "threads": torch.get_num_threads(), "load_avg": os.getloadavg()[0]}
    if task == "run":  # the run's peak counts from before loading, beyond the imports
        import transformers  # noqa: F401

        import engine.align.weight
        import engine.api
        import engine.interpolate  # noqa: F401
        from engine.models import load_model

        load_model(a_dir, getattr(torch, dtype)).module.cpu()  # every adapter and transformers' lazy modules imported, then freed
        return_freed_memory()
    base = rss()
    if task != "run":
        from engine.models import load_model

        a, b = load_model(a_dir, getattr(torch, dtype)), load_model(b_dir, getattr(torch, dtype))
        base = rss()
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak (VmHWM) restarts from the current RSS
    t0 = time.perf_counter()
    if task in ("weight", "activation", "learned", "dual"):
        from engine.align.learned import Settings
        from engine.align.run import align

        def progress(done: int, total: int, text: str) -> None:  # to a file: a 1B run takes many minutes
            if log is not None:
                with log.open("a") as f:
                    f.write(f"{time.perf_counter() - t0:8.1f} s  peak {hwm() / 2**30:.2f} GiB  {text}\n")

        steps_ = steps if task in ("learned", "dual") else 0
        al = align(a, b, task, classes, steps=steps_, in_place=True, compare_one_sided=False, progress=progress,
                   learned=Settings(eval_every=steps_) if steps_ else None)  # one validation check, at the end
        seconds, peak = time.perf_counter() - t0, hwm()  # the recovery measurement below is not the aligner's
        info = al.out.info
        out |= {"sweeps": len(info.get("sweeps", [])), "stop": info.get("stop"), "classes": sorted(al.classes)}
        if "memory" in info:  # learned, dual: the optimiser's own figures
            out |= {"memory": info["memory"], "steps_done": info["steps_done"],
                    "seconds_per_step": info["seconds_per_step"], "init_seconds": info.get("init_seconds")}
        if (b_dir / "planted.json").exists():
            out["relative_distance"] = recovery(al)
    elif task == "run":
        from engine.api import run_pair
        from engine.results import RunConfig

        rec = run_pair(RunConfig(str(a_dir), str(b_dir), "weight", classes=tuple(classes or ()), points=3,
                                 eval_items=eval_items, dtype=dtype))
        out |= {"barrier": rec["barrier"], "endpoints": [rec["endpoint_loss_a"], rec["endpoint_loss_b"]],
                "classes": rec["alignment"]["classes"], "timings": rec["timings"],
                "endpoint_rel_diff": rec["endpoint_check"]["rel_diff"],
                "weight_matching": {k: rec["alignment"]["diagnostics"].get(k) for k in ("sweeps", "stop", "initial_residual")}}
    elif task == "eval":
        from engine.evaluate import evaluate, lm_eval_set

        es = lm_eval_set("test", 4096, n_ctx=128)
        evaluate(a, lm_eval_set("test", 256, n_ctx=128))  # warm-up
        t0 = time.perf_counter()
        evaluate(a, es)
        n = sum(p.numel() for p in a.module.parameters())  # tied embeddings counted once
        out |= {"tokens": es.size, "tokens_per_s": es.size / (time.perf_counter() - t0), "params": n}
    if task not in ("weight", "activation", "learned", "dual"):
        seconds, peak = time.perf_counter() - t0, hwm()
    unit = (unit0 + matmul_seconds()) / 2
    one = sum(f.stat().st_size for f in a_dir.glob("*.safetensors"))  # one model's stored bytes (tied weights once)
    out |= {"seconds": seconds, "matmul_units": seconds / unit, "matmul_ms": unit * 1e3,
            "peak_over_model": (peak - base) / one, "model_mb": one / 1e6, "peak_gib": peak / 2**30,
            "baseline_gib": base / 2**30}
    if task == "eval":
        out["fraction_of_matmul_rate"] = 2 * out["params"] * out["tokens_per_s"] / (2 * 2048**3 / unit)
    return out


def recovery(al) -> float:
    """||theta_A - g.theta_B|| / ||theta_A|| after alignment: the planted noise (1e-3) is its floor."""
    from engine.models import canonical

    pa, pb = canonical(al.model_a, copy=False), canonical(al.model_b, copy=False)
    num = sum(float((pa[k] - pb[k]).square().sum()) for k in pa)
    return (num / sum(float(pa[k].square().sum()) for k in pa)) ** 0.5


# ---------------------------------------------------------------------------------------------
# Driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/lmc-bench")
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=PAIRS)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--classes", nargs="+", help="symmetry classes for the aligning tasks (default: the method's)")
    ap.add_argument("--steps", type=int, default=3, help="learned and dual: optimisation steps")
    ap.add_argument("--log", help="learned and dual: append each step's progress and peak memory to this file")
    ap.add_argument("--val-tokens", type=int, help="learned and dual: validation and dual-identity tokens "
                    "(default: the engine's, 4,096 and 1,024; fewer keep a 1B run's checks to minutes)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dtype the endpoints are loaded and kept in (bfloat16: as 1B checkpoints are stored)")
    ap.add_argument("--eval-items", type=int, default=2048, help="run: scored tokens per path point")
    ap.add_argument("--one", nargs=3, metavar=("TASK", "A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.val_tokens:
        from engine.align import dual, learned

        learned.VAL_ITEMS["lm"] = args.val_tokens
        dual.IDENTITY_ITEMS["lm"] = min(dual.IDENTITY_ITEMS["lm"], args.val_tokens)
    if args.one:
        print("RESULT " + json.dumps(measure(args.one[0], Path(args.one[1]), Path(args.one[2]), args.classes,
                                             args.steps, Path(args.log) if args.log else None, args.dtype,
                                             args.eval_items)))
        return
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    build_pairs(root, args.pairs)
    rows = []
    for name in args.pairs:
        a, b = pair_dirs(root, name)
        for task in args.tasks:
            cmd = [sys.executable, __file__, "--one", task, str(a), str(b), "--steps", str(args.steps)]
            cmd += (["--classes", *args.classes] if args.classes else []) + (["--log", args.log] if args.log else [])
            cmd += ["--val-tokens", str(args.val_tokens)] if args.val_tokens else []
            cmd += ["--dtype", args.dtype, "--eval-items", str(args.eval_items)]
            p = subprocess.run(cmd, capture_output=True, check=False, text=True, cwd=ROOT)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            r = json.loads(line[-1][7:]) if line else {"task": task, "error": p.stderr.strip().splitlines()[-1:]}
            r["pair"] = name
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("\n| pair | task | seconds | matmul units | peak / model | notes |\n|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['pair']} | {r['task']} | - | - | - | failed: {r['error']} |")
            continue
        notes = {k: r[k] for k in ("classes", "sweeps", "stop", "relative_distance", "barrier", "tokens_per_s",
                                   "fraction_of_matmul_rate", "load_avg") if k in r}
        print(f"| {r['pair']} | {r['task']} | {r['seconds']:.1f} | {r['matmul_units']:.0f} | "
              f"{r['peak_over_model']:.2f} | {json.dumps(notes)} |")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
