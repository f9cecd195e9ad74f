"""Runs across processes (engine.distributed): two gloo processes launched by torchrun reach the same
element and barrier as one process, and the shares of a batch cover it exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import distributed
from engine.cli import main
from engine.errors import LMCError

ROOT = Path(__file__).resolve().parents[2]
# float64: Adam's first steps are lr * sign(gradient), so float32 rounding in the order of the shares'
# sums (1e-7) can flip a tiny gradient's sign and the runs part by a step size; in float64 they agree
# to 1e-12
RUN = ["align", "vit-learned-s0", "vit-learned-s1", "--method", "dual", "--steps", "4", "--points", "3",
       "--eval-items", "64", "--no-attribution", "--dtype", "float64", "--skip-comparison"]


def _engine(tmp_path: Path, out: str, processes: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
              if processes > 1 else [sys.executable])
    return subprocess.Popen([*launch, "-m", "engine", *RUN, "--out", str(tmp_path / out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_gloo_processes_reach_the_one_process_element_and_barrier(tmp_path):
    runs = _engine(tmp_path, "one.json", 1), _engine(tmp_path, "two.json", 2)  # side by side
    (_, err_one), (out_two, err_two) = (r.communicate(timeout=600) for r in runs)
    assert runs[0].returncode == 0, err_one[-2000:]
    assert runs[1].returncode == 0, err_two[-2000:]
    assert out_two.count("wrote ") == 1  # process 0 alone reports and writes
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert b["barrier"] == pytest.approx(a["barrier"], rel=1e-9)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-9)
    for side in ("element", "element_a"):
        for la, lb in zip(a["alignment"][side]["layers"], b["alignment"][side]["layers"]):
            assert la["head_perm"] == lb["head_perm"] and la["mlp_perm"] == lb["mlp_perm"]
            assert lb["qk_singular_values"] == la["qk_singular_values"]  # 5 digits in the record
    da, db = a["alignment"]["diagnostics"], b["alignment"]["diagnostics"]
    assert db["curve"]["train_loss"] == pytest.approx(da["curve"]["train_loss"], rel=1e-9)
    assert db["history"]["val_barrier"] == pytest.approx(da["history"]["val_barrier"], rel=1e-9)


def test_the_shares_of_a_batch_cover_it_once(monkeypatch):
    for world in (1, 2, 3, 5):
        monkeypatch.setattr(distributed, "size", lambda w=world: w)
        rows = []
        for r in range(world):
            monkeypatch.setattr(distributed, "rank", lambda r=r: r)
            rows += list(range(16))[distributed.shard(16)]
            assert len(distributed.my_batches(7)) in (7 // world, 7 // world + 1)
        assert rows == list(range(16))
    monkeypatch.setattr(distributed, "size", lambda: 17)
    with pytest.raises(LMCError, match="cannot be split over 17 processes"):
        distributed.shard(16)


def test_only_runs_go_across_processes(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["zoo", "list"]) == 2
    assert "Only `align` and `interpolate` run across processes" in capsys.readouterr().err
