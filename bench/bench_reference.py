"""This engine beside the released code of Theus et al. (2025) on two pairs of small HF GPT-2 LMs.

    .venv/bin/python bench/bench_reference.py [--pairs undertrained trained] [--methods naive weight learned dual]
        [--paths weights circuits] [--eval-items 65536] [--points 21] [--learned-steps 100] [--threads 1]
        [--dir /tmp/lmc-reference] [--steps-scale 1.0] [--device cpu] [--out FILE]

Two stages. (a) Models: real `transformers.GPT2LMHeadModel`s (4 layers, D 128, 4 heads, byte vocabulary
256, context 128, tied embeddings), two seeds per pair, trained by a plain torch loop on the bundled
corpus with the zoo's recipe (engine/train.py: AdamW betas (0.9, 0.95), weight decay 0.1 on matrices,
peak lr 3e-3, linear warm-up then cosine to a tenth, gradient clip 1, batches of 32 windows of 128
bytes, `seed` fixing both the initialisation and the batch order). The *trained* pair runs the zoo's
1,000 steps (about 1.36 nats/byte); the *undertrained* pair runs the same recipe on a 300-step
schedule and stops at the first validation check (every 5 steps, 16,384 validation bytes) at or below
2.46 nats/byte. Each model is saved with `save_pretrained` into `--dir/<pair>-s<seed>`; a model already
there is kept, and its test loss (the engine's evaluation) goes into `--dir/<pair>-s<seed>.json`.
(b) Runs: every method on every path through `engine.api.run_pair`, the methods with their defaults
(learned and dual at `--learned-steps`), on the first `--eval-items` test bytes and `--points` points.
One markdown table on stdout (and in `--out`): barrier and midpoint barrier per pair, method and path,
the alignment's seconds, and the figures measured with the reference code on pairs of this recipe, which this script
does not run (see REFERENCE).

GPT2Config's dropout default (0.1) is left out by default (`--dropout 0`): the zoo's recipe has none,
and dropout does not change a saved model's function, only how fast it trains.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built from a config

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Barriers (nats/byte) measured with the reference code (Theus et al. 2025,
# "Generalized linear mode connectivity for transformers"), on pairs of this shape trained on the
# bundled corpus, scored with this engine's evaluation (65,536 test tokens, 21 points). The reference
# interpolates per-head circuits, so its figures compare with the circuit path as well as the weight
# path. Not measured by this script.
REFERENCE = {
    "undertrained": {"loss": 2.46, "naive": 0.2405, "weight": 0.0030, "learned": 0.0005},
    "trained": {"loss": 1.35, "naive": 2.281, "weight": 0.899, "learned": 0.619},
}
REFERENCE_NOTE = ("reference = measured with the reference code on another pair of this recipe (weight matching; learned "
                  "matching 100 steps), not by this script")


# ---------------------------------------------------------------------------------------------
# The models


@dataclass(frozen=True)
class PairRecipe:
    steps: int  # schedule length (warm-up + cosine)
    stop_at: float | None  # stop at the first validation check at or below this loss (nats/byte)
    eval_every: int  # steps between validation checks (only with stop_at)


PAIRS = {
    "undertrained": PairRecipe(steps=300, stop_at=2.46, eval_every=5),
    "trained": PairRecipe(steps=1000, stop_at=None, eval_every=0),
}
SEEDS = (0, 1)
BATCH, N_CTX, LR, WARMUP, MIN_LR_FRAC, WEIGHT_DECAY, GRAD_CLIP = 32, 128, 3e-3, 50, 0.1, 0.1, 1.0
VAL_TOKENS = 16_384


def gpt2_config(dropout: float):
    from transformers import GPT2Config

    return GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=N_CTX,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


def lr_at(step: int, steps: int) -> float:
    """The zoo's schedule (engine.train.lr_at), with the warm-up shortened on a short schedule."""
    warmup = min(WARMUP, max(1, steps // 10))
    if step < warmup:
        return LR * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * t)))


def mean_loss(net, windows) -> float:
    """Mean next-byte cross-entropy of an HF causal LM on windows [n, N_CTX + 1], in float64."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    net.eval()
    with torch.no_grad():
        for chunk in windows.split(64):
            logits = net(input_ids=chunk[:, :-1]).logits  # [b, N_CTX, 256]
            total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum").item()
            count += chunk[:, 1:].numel()
    net.train()
    return total / count


def train_gpt2(seed: int, recipe: PairRecipe, dropout: float, log) -> tuple[object, dict]:
    """One HF GPT-2 trained by the zoo's recipe; returns the module and what the training did."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2LMHeadModel

    from engine.data import default_splits, lm_batches, lm_eval_windows

    torch.manual_seed(seed)
    net = GPT2LMHeadModel(gpt2_config(dropout))
    net.train()
    params = {id(p): p for p in net.parameters()}.values()  # the tied embedding once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    splits = default_splits()
    stream = lm_batches(splits.train, BATCH, N_CTX, seed)
    val = lm_eval_windows(splits.val, N_CTX, VAL_TOKENS)  # [n, N_CTX + 1]
    t0 = time.perf_counter()
    steps_done, val_loss, stopped = 0, None, "schedule"
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe.steps)
        batch = next(stream)  # [BATCH, N_CTX + 1]
        logits = net(input_ids=batch[:, :-1]).logits  # [BATCH, N_CTX, 256]
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), GRAD_CLIP)
        opt.step()
        steps_done = step + 1
        if recipe.stop_at is not None and steps_done % recipe.eval_every == 0:
            val_loss = mean_loss(net, val)
            if val_loss <= recipe.stop_at:
                stopped = f"validation loss {val_loss:.4f} <= {recipe.stop_at}"
                break
        if steps_done % 100 == 0:
            log(f"  seed {seed}: step {steps_done}, train loss {loss.item():.4f}")
    if val_loss is None or stopped == "schedule":
        val_loss = mean_loss(net, val)
    net.eval()
    return net, {"seed": seed, "steps": steps_done, "schedule_steps": recipe.steps, "stopped": stopped,
                 "val_loss": val_loss, "dropout": dropout, "train_seconds": time.perf_counter() - t0}


def save_atomic(net, path: Path) -> None:
    """save_pretrained into a fresh sibling directory, then rename it into place."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    net.save_pretrained(tmp)
    tmp.rename(path)


def test_loss(path: Path, eval_items: int) -> float:
    """The saved model's test loss as the engine measures it (engine.evaluate, the run's evaluation set)."""
    from engine.evaluate import eval_set_for, evaluate
    from engine.models import load_model

    m = load_model(path)
    return evaluate(m, eval_set_for(m, "test", eval_items))["loss"]


def ensure_pair(name: str, root: Path, steps_scale: float, dropout: float, eval_items: int, log) -> list[Path]:
    """The pair's two model directories, trained and saved where missing."""
    base = PAIRS[name]
    recipe = PairRecipe(max(1, round(base.steps * steps_scale)), base.stop_at, base.eval_every)
    out = []
    for seed in SEEDS:
        path = root / f"{name}-s{seed}"
        meta_file = root / f"{name}-s{seed}.json"
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        if (path / "config.json").exists():
            log(f"{path}: exists, kept" + (f" (trained {meta['steps']} steps)" if "steps" in meta else ""))
            if "steps" in meta and meta.get("schedule_steps") != recipe.steps:
                log(f"  note: it was trained on a {meta['schedule_steps']}-step schedule, not {recipe.steps}")
        else:
            log(f"{path}: training ({recipe.steps}-step schedule"
                + (f", stop at validation <= {recipe.stop_at}" if recipe.stop_at is not None else "") + ")")
            net, meta = train_gpt2(seed, recipe, dropout, log)
            root.mkdir(parents=True, exist_ok=True)
            save_atomic(net, path)
        if meta.get("test_eval_items") != eval_items:
            meta |= {"test_loss": test_loss(path, eval_items), "test_eval_items": eval_items}
            meta_file.write_text(json.dumps(meta, indent=1))
        log(f"  {path.name}: test loss {meta['test_loss']:.4f} nats/byte ({eval_items:,} tokens), "
            f"{meta.get('steps', '?')} steps, {meta.get('stopped', '?')}")
        out.append(path)
    return out


# ---------------------------------------------------------------------------------------------
# The runs


LEARNED = ("learned", "dual")


def run_one(a: Path, b: Path, method: str, path: str, args) -> dict:
    from engine.api import run_pair
    from engine.results import RunConfig

    cfg = RunConfig(str(a), str(b), method=method, steps=args.learned_steps if method in LEARNED else 0,
                    points=args.points, eval_items=args.eval_items, path=path, device=args.device)
    return run_pair(cfg, train_curve=False)


def ratio(ours: float, ref: float | None) -> str:
    return "-" if ref is None or ref <= 0 else f"{ours / ref:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--methods", nargs="+", default=["naive", "weight", "learned", "dual"],
                    choices=["naive", "weight", "activation", "learned", "dual"])
    ap.add_argument("--paths", nargs="+", default=["weights", "circuits"], choices=["weights", "circuits"])
    ap.add_argument("--eval-items", type=int, default=65_536, help="test tokens scored per point")
    ap.add_argument("--points", type=int, default=21)
    ap.add_argument("--learned-steps", type=int, default=100, help="learned and dual matching budget")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto (the engine's choice)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/lmc-reference"), help="where the models are kept")
    ap.add_argument("--steps-scale", type=float, default=1.0,
                    help="multiply the training schedules (smoke tests; a model already in --dir is kept)")
    ap.add_argument("--dropout", type=float, default=0.0, help="GPT-2 dropout while training")
    ap.add_argument("--out", type=Path, default=None, help="also write the table and the rows (JSON) here")
    args = ap.parse_args()

    import torch
    import transformers.utils.logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model loaded otherwise

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows = []
    models = {name: ensure_pair(name, args.dir, args.steps_scale, args.dropout, args.eval_items, log)
              for name in args.pairs}
    for name, (a, b) in models.items():
        for path in args.paths:
            for method in args.methods:
                log(f"{name}: {method} on the {path} path ...")
                t = time.perf_counter()
                rec = run_one(a, b, method, path, args)
                row = {"pair": name, "method": method, "path": path, "barrier": rec["barrier"],
                       "midpoint_barrier": rec["midpoint_barrier"], "align_s": rec["timings"]["align"],
                       "run_s": time.perf_counter() - t, "endpoint_loss_a": rec["endpoint_loss_a"],
                       "endpoint_loss_b": rec["endpoint_loss_b"], "classes": rec.get("classes")}
                if method == "naive":
                    row |= {"barrier_folded": rec.get("barrier_folded"),
                            "midpoint_barrier_folded": rec.get("midpoint_barrier_folded")}
                rows.append(row)
                log(f"  barrier {row['barrier']:.4f}, midpoint {row['midpoint_barrier']:.4f}, "
                    f"align {row['align_s']:.1f} s, run {row['run_s']:.0f} s")

    setting = (f"<!-- {args.eval_items:,} test tokens, {args.points} points, learned/dual {args.learned_steps} "
               f"steps, {args.threads} thread(s), device {args.device}; {REFERENCE_NOTE} -->")
    header = ("| pair (A / B test loss) | method | path | barrier | midpoint barrier | align s | reference | "
              "ours / reference |")
    lines = [setting, header, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = REFERENCE[r["pair"]].get(r["method"])
        pair = f"{r['pair']} ({r['endpoint_loss_a']:.3f} / {r['endpoint_loss_b']:.3f})"
        lines.append(f"| {pair} | {r['method']} | {r['path']} | {r['barrier']:.4f} | {r['midpoint_barrier']:.4f} | "
                     f"{r['align_s']:.1f} | {'-' if ref is None else f'{ref:.4f}'} | {ratio(r['barrier'], ref)} |")
        if r["method"] == "naive" and r.get("barrier_folded") is not None:
            lines.append(f"| {pair} | naive, aligned coordinates | {r['path']} | {r['barrier_folded']:.4f} | "
                         f"{r['midpoint_barrier_folded']:.4f} | - | - | - |")
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out is not None:
        args.out.write_text(table + "\n\n" + json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
