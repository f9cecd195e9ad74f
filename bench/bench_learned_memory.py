"""Dual matching's resident peak against engine.resources' estimate, in the scale regime.

Two GQA Llamas of 28M parameters (float32 products: above weight.SMALL_MODEL) are written as
safetensors directories; dual matching (weight-matching start, two steps, the validation checks and the
dual identity) runs in a fresh process, where the kernel's resident peak (VmHWM, restarted after
loading) above the two loaded endpoints is read. The check: the peak lies between half of the estimate
of the dual scratch and the estimate itself (an estimate that is too small lets a run start that does
not fit; one far too large refuses runs that would). Exits 1 when it does not hold.

Run: .venv/bin/python bench/bench_learned_memory.py   (about a minute on two quiet cores;
results go into bench/RESULTS.md by hand)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from engine.align.learned import Settings
    from engine.align.run import align
    from engine.memory import return_freed_memory
    from engine.models import load_model
    return_freed_memory()
    def status(key):  # bytes
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024
    a, b = load_model(sys.argv[1]), load_model(sys.argv[2])
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak (VmHWM) restarts from here
    base = status("VmRSS")
    al = align(a, b, "dual", steps=2, compare_one_sided=False, in_place=True, learned=Settings(eval_every=2))
    print(json.dumps({"beyond_endpoints": status("VmHWM") - base, "steps": al.out.info["steps_done"]}))
""")


def main() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.resources import estimate_run

    cfg = LlamaConfig(hidden_size=384, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      intermediate_size=1024, vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / f"m{s}" for s in (0, 1)]
        for s, d in enumerate(dirs):
            torch.manual_seed(s)
            LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
        est = estimate_run(dirs, "dual", points=3, eval_items=1024)
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, *map(str, dirs)], capture_output=True, text=True,
                             timeout=1800, check=True, cwd=ROOT)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    scratch = est.parts["dual matching scratch"]
    ok = m["steps"] == 2 and 0.5 * scratch <= m["beyond_endpoints"] <= scratch
    print(f"{est.params / 1e6:.1f}M parameters a model; dual scratch estimate {scratch / 1e9:.3f} GB; measured peak "
          f"above the endpoints {m['beyond_endpoints'] / 1e9:.3f} GB = {m['beyond_endpoints'] / scratch:.2f} of the "
          f"estimate ({'within' if ok else 'OUTSIDE'} [0.5, 1])")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
