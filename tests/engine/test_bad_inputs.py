"""Bad input of every kind: one line `error: ...`, exit status 2, no traceback, nothing lost on disk.

Each CLI case builds its scenario in a fresh directory, snapshots every path under it and under the
shared input models (bytes, mode, mtime, symlink target), runs `engine.cli.main` in-process and checks
the refusal and that the snapshot is unchanged. Two cases run the real `python -m engine` entry point.
Then: store degradation (a broken record is skipped with a warning), resumable `cache build`, output
writes that keep what the tool did not write, and a Hypothesis search over mutated config.json files
(a model that loads and runs, or a ModelError / LMCError whose one line names the mutated field).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ref_models import tiny
from safetensors.torch import load_file, save_file

from engine import zoo
from engine.cli import main
from engine.errors import LMCError, ModelError
from engine.models import hf_gpt2, load_model, model_logits, reference, save_model, timm_vit
from engine.models.io import MARKER
from engine.results import StoreWarning, cached_record, list_cached, load_record, store, write_manifest

ROOT = Path(__file__).resolve().parents[2]
LM = tiny(vocab_size=256)  # byte-level evaluation needs a vocabulary of 256
GPT2 = {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 32, "vocab_size": 256, "bos_token_id": 0,
        "eos_token_id": 0}
VIT_ARGS = {"img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10, "embed_dim": 32, "depth": 2,
            "num_heads": 4}
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


# ---------------------------------------------------------------------------------------------
# Fixtures: tiny models saved once, a fresh working directory per case


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("inputs")
    for s in (0, 1):
        save_model(reference.build(LM, seed=s), root / f"m{s}")
    save_model(reference.build(replace(LM, pe="none"), seed=0), root / "nope")
    save_model(hf_gpt2.build(GPT2, seed=0), root / "gpt2")
    save_model(timm_vit.build(VIT_ARGS, seed=0), root / "vit")
    return SimpleNamespace(root=root, a=root / "m0", b=root / "m1", nope=root / "nope", gpt2=root / "gpt2",
                           vit=root / "vit")


def snapshot(*roots: Path) -> dict:
    """Every path under `roots`: (kind, bytes or link target, mode, mtime) - files and links exactly."""
    out = {}
    for r in roots:
        out[str(r)] = ("root", os.path.lexists(r))
        if not os.path.lexists(r):
            continue
        for dirpath, dirnames, filenames in os.walk(r):
            for n in dirnames + filenames:
                p = Path(dirpath) / n
                st_ = p.lstat()
                if p.is_symlink():
                    out[str(p)] = ("link", os.readlink(p))
                elif p.is_dir():
                    out[str(p)] = ("dir", st_.st_mode)
                elif p.is_file():
                    out[str(p)] = ("file", p.read_bytes(), st_.st_mode, st_.st_mtime_ns)
                else:
                    out[str(p)] = ("other", st_.st_mode, st_.st_mtime_ns)
    return out


@dataclass(frozen=True)
class Ctx:
    base: SimpleNamespace
    work: Path

    @property
    def a(self) -> str:
        return str(self.base.a)

    @property
    def b(self) -> str:
        return str(self.base.b)

    def model(self, name: str = "m0", config: dict | None = None, edit: Callable[[dict], None] | None = None) -> str:
        """A copy of an input model in the work directory, its config.json replaced or edited."""
        d = self.work / f"copy-{name}"
        shutil.copytree(getattr(self.base, {"m0": "a", "m1": "b"}.get(name, name)), d)
        if config is not None or edit is not None:
            cfg = json.loads((d / "config.json").read_text()) if config is None else config
            if edit is not None:
                edit(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    def file(self, rel: str, text: str = "hello\n") -> str:
        p = self.work / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return str(p)


@pytest.fixture
def ctx(base, tmp_path, monkeypatch) -> Ctx:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("LMC_ZOO_DIR", str(tmp_path / "zoo"))
    return Ctx(base, work)


# ---------------------------------------------------------------------------------------------
# Scenario builders that need more than one line


def _setitem(k, v):
    return lambda c: c.__setitem__(k, v)


def _symlinked_config(c: Ctx, target: str) -> str:
    d = c.model()
    (Path(d) / "config.json").unlink()
    (Path(d) / "config.json").symlink_to(target)
    return d


def _linked_inside(c: Ctx, text: str) -> str:
    """config.json a link to a junk file inside the same model directory (allowed, then read)."""
    d = c.model()
    Path(d, "junk.bin").write_text(text)
    return _relink(Path(d), "config.json", "junk.bin")


def _relink(d: Path, name: str, target: str) -> str:
    (d / name).unlink()
    (d / name).symlink_to(target)
    return str(d)


def _weights_link_outside(c: Ctx) -> str:
    d = Path(c.model())
    outside = c.work / "elsewhere.safetensors"
    shutil.copy(d / "model.safetensors", outside)
    return _relink(d, "model.safetensors", str(outside))


def _index_naming(c: Ctx, shard: str) -> str:
    d = Path(c.model("gpt2"))
    keys = list(load_file(str(d / "model.safetensors")))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(keys, shard)}))
    return str(d)


def _huge_weights(c: Ctx, key: str = "embed.tok", value: float = 1e37) -> str:
    """B with one tensor at `value`: finite weights (1e37: 100 times it is not a float32; a head at 3e38:
    its logits overflow)."""
    d = Path(c.model("m1"))
    state = load_file(str(d / "model.safetensors"))
    state[key] = torch.full_like(state[key], value)
    save_file(state, str(d / "model.safetensors"))
    return str(d)


def _int_weights(c: Ctx) -> str:
    d = Path(c.model())
    state = load_file(str(d / "model.safetensors"))
    k = "embed.tok"
    state[k] = (state[k] * 100).to(torch.int64)
    save_file(state, str(d / "model.safetensors"))
    return str(d)


def _pickled_only(c: Ctx) -> str:
    d = Path(c.model())
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    return str(d)


def _tokenizer_auto_map(c: Ctx) -> str:
    d = Path(c.model("gpt2"))
    (d / "tokenization_evil.py").write_text(f"open({str(c.work / 'EXECUTED')!r}, 'w').write('ran')\n")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}))
    return str(d)


def _broken_tokenizer(c: Ctx) -> str:
    d = Path(c.model("gpt2"))
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    return str(d)


def _config_dir(c: Ctx) -> str:
    d = Path(c.model())
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    return str(d)


def _weights_to_device(c: Ctx) -> str:
    d = Path(c.model("gpt2"))
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("/dev/zero")
    return str(d)


def _linked_parent(c: Ctx) -> str:
    (c.work / "via").symlink_to(c.base.a)
    return str(c.work / "via")


def _link_loop(c: Ctx) -> str:
    (c.work / "loop.json").symlink_to(c.work / "loop.json")
    return str(c.work / "loop.json")


def _marked_dir_with_config_dir(c: Ctx) -> str:
    c.file(f"marked/{MARKER}", "")
    (c.work / "marked" / "config.json").mkdir()
    return str(c.work / "marked")


def _fifo(c: Ctx) -> str:
    p = c.work / "pipe"
    os.mkfifo(p)
    return str(p)


def _link_to_dir(c: Ctx) -> str:
    (c.work / "adir").mkdir()
    (c.work / "link.json").symlink_to(c.work / "adir")
    return str(c.work / "link.json")


def _user_dir(c: Ctx) -> str:
    c.file("mine/notes.txt", "my notes\n")
    c.file("mine/config.json", '{"mine": true}\n')
    return str(c.work / "mine")


def _link_to_b(c: Ctx) -> str:
    (c.work / "alias").symlink_to(c.base.b)
    return str(c.work / "alias")


def _readonly_dir(c: Ctx) -> str:
    d = c.work / "ro"
    d.mkdir()
    d.chmod(0o555)
    return str(d / "r.json")


def _element(c: Ctx, model: str = "m0", classes: tuple[str, ...] = ("heads", "mlp", "qk", "residual_orth", "vo"),
             name: str = "e.safetensors") -> str:
    """An element file of the identity for `model`'s architecture, as `align --save-element` writes one."""
    from engine.align.start import save_element
    from engine.symmetry import identity

    arch = load_model(getattr(c.base, {"m0": "a"}.get(model, model))).arch
    f = c.work / name
    save_element(f, arch, identity(arch), None, {"method": "weight", "classes": list(classes), "rewrite": ""})
    return str(f)


def _weights_named_as_element(c: Ctx) -> str:
    f = c.work / "weights.safetensors"
    shutil.copy(c.base.a / "model.safetensors", f)
    return str(f)


# ---------------------------------------------------------------------------------------------
# The cases: id -> (argv from the context, a phrase the error must contain)

Case = tuple[Callable[[Ctx], list[str]], str]
I, A = "interpolate", "align"
CASES: dict[str, Case] = {
    # arguments
    "points-1": (lambda c: [I, c.a, c.b, "--points", "1"], "--points"),
    "points-0": (lambda c: [I, c.a, c.b, "--points", "0"], "from 2 to 1,001"),
    "points-negative": (lambda c: [I, c.a, c.b, "--points", "-3"], "--points"),
    "points-huge": (lambda c: [I, c.a, c.b, "--points", "100000"], "from 2 to 1,001"),
    "points-other-script": (lambda c: [I, c.a, c.b, "--points", "\u0663"], "from 2 to 1,001"),  # Arabic-Indic 3
    "eval-items-other-script": (lambda c: [I, c.a, c.b, "--eval-items", "\u0663\u0662"], "'all'"),
    "points-word": (lambda c: [I, c.a, c.b, "--points", "many"], "'many'"),
    "points-fraction": (lambda c: [I, c.a, c.b, "--points", "2.5"], "'2.5'"),
    "device-unknown": (lambda c: [I, c.a, c.b, "--device", "gpu"], "invalid choice: 'gpu'"),
    "eval-items-0": (lambda c: [I, c.a, c.b, "--eval-items", "0"], "positive number or 'all'"),
    "eval-items-negative": (lambda c: [I, c.a, c.b, "--eval-items", "-5"], "positive number or 'all'"),
    "eval-items-word": (lambda c: [I, c.a, c.b, "--eval-items", "lots"], "'lots'"),
    "split-train": (lambda c: [I, c.a, c.b, "--split", "train"], "invalid choice: 'train'"),
    "steps-negative-learned": (lambda c: [A, c.a, c.b, "--method", "learned", "--steps", "-1"], "--steps"),
    "steps-negative-dual": (lambda c: [A, c.a, c.b, "--method", "dual", "--steps", "-1"], "--steps"),
    "steps-huge": (lambda c: [A, c.a, c.b, "--method", "dual", "--steps", "10000000"], "to 100,000"),
    "steps-for-weight": (lambda c: [A, c.a, c.b, "--method", "weight", "--steps", "5"], "has no steps"),
    "alpha-nan": (lambda c: [A, c.a, c.b, "--save-merged", "out", "--alpha", "nan"], "finite number"),
    "alpha-inf": (lambda c: [A, c.a, c.b, "--save-merged", "out", "--alpha", "inf"], "finite number"),
    "alpha-7": (lambda c: [A, c.a, c.b, "--save-merged", "out", "--alpha", "7"], "--extrapolate"),
    "alpha-negative": (lambda c: [A, c.a, c.b, "--save-merged", "out", "--alpha", "-0.5"], "outside [0, 1]"),
    "save-merged-as-a-zoo-name": (lambda c: [A, c.a, c.b, "--save-merged", "lm-rope-s0"], "name of a zoo model"),
    "alpha-1e38-extrapolated": (lambda c: [A, c.a, c.b, "--save-merged", "out", "--alpha", "1e38", "--extrapolate"],
                                "too far"),
    "path-not-finite": (lambda c: [I, c.a, _huge_weights(c, "head.W", 3e38), "--points", "3", "--eval-items", "128",
                                   "--out", "r.json"], "is not finite"),
    "alpha-overflows-the-weights": (lambda c: [A, c.a, _huge_weights(c), "--points", "2", "--eval-items", "128",
                                               "--save-merged", "out", "--alpha", "100", "--extrapolate"], "overflow"),
    "alpha-without-save": (lambda c: [A, c.a, c.b, "--alpha", "0.3"], "add --save-merged"),
    "extrapolate-without-save": (lambda c: [A, c.a, c.b, "--extrapolate"], "add --save-merged"),
    "skip-comparison-learned": (lambda c: [A, c.a, c.b, "--method", "learned", "--skip-comparison"], "--skip-comparison"),
    "method-unknown": (lambda c: [A, c.a, c.b, "--method", "magic"], "invalid choice: 'magic'"),
    "classes-unknown": (lambda c: [A, c.a, c.b, "--classes", "bogus"], "invalid choice: 'bogus'"),
    "seed-negative": (lambda c: [A, c.a, c.b, "--seed", "-1"], "--seed"),
    "seed-too-big": (lambda c: [A, c.a, c.b, "--seed", str(2**32)], "--seed"),
    "train-steps-negative": (lambda c: ["train", "--task", "lm", "--pe", "rope", "--steps", "-1", "--out", "t"],
                             "--steps"),
    "train-steps-0": (lambda c: ["train", "--task", "lm", "--pe", "rope", "--steps", "0", "--out", "t"], "--steps"),
    "train-task-unknown": (lambda c: ["train", "--task", "speech", "--pe", "rope", "--out", "t"], "'speech'"),
    "train-no-out": (lambda c: ["train", "--task", "lm", "--pe", "rope"], "--out"),
    "train-seed-negative": (lambda c: ["train", "--task", "lm", "--pe", "rope", "--seed", "-3", "--out", "t"],
                            "--seed"),
    "train-tier-vit": (lambda c: ["train", "--task", "vit", "--pe", "rope", "--tier", "medium", "--out", "t"],
                       "--tier medium is an LM shape"),
    "train-tier-unknown": (lambda c: ["train", "--task", "lm", "--pe", "rope", "--tier", "large", "--out", "t"],
                           "invalid choice: 'large'"),
    "zoo-build-unknown": (lambda c: ["zoo", "build", "--only", "lm-nope-s9"], "lm-nope-s9"),
    "zoo-list-only": (lambda c: ["zoo", "list", "--only", "lm-none-s0"], "zoo build"),
    "cache-build-unknown-name": (lambda c: ["cache", "build", "--only", "nothing"], "--only nothing"),
    "cache-build-unknown-method": (lambda c: ["cache", "build", "--methods", "foo"], "invalid choice: 'foo'"),
    "cache-build-only-empty": (lambda c: ["cache", "build", "--only"], "--only"),
    "cache-build-unbuilt-model": (lambda c: ["cache", "build", "--only", "lm-rope-s0", "--methods", "naive"],
                                  "not built yet"),
    "cache-table-force": (lambda c: ["cache", "table", "--force"], "cache build"),
    "no-command": (lambda c: [], "required: command"),
    "unknown-command": (lambda c: ["merge", c.a, c.b], "invalid choice: 'merge'"),
    "missing-model-b": (lambda c: [I, c.a], "required: model_b"),
    "model-not-found": (lambda c: [I, c.a, "lm-nothing-s7"], "neither a zoo model"),
    "model-is-a-file": (lambda c: [I, c.a, c.file("weights.txt")], "neither a zoo model"),
    "model-empty-string": (lambda c: [I, c.a, ""], "empty string"),
    # output locations: checked before any model is loaded, nothing written
    "out-is-directory": (lambda c: [I, c.a, c.b, "--out", str(c.work)], "is a directory"),
    "out-under-a-file": (lambda c: [I, c.a, c.b, "--out", c.file("f.txt") + "/r.json"], "is not a directory"),
    "out-device-node": (lambda c: [I, c.a, c.b, "--out", "/dev/null"], "not a regular file"),
    "out-fifo": (lambda c: [I, c.a, c.b, "--out", _fifo(c)], "not a regular file"),
    "out-symlink-to-dir": (lambda c: [I, c.a, c.b, "--out", _link_to_dir(c)], "is a directory"),
    "out-empty": (lambda c: [I, c.a, c.b, "--out", ""], "empty string"),
    "out-into-input-model": (lambda c: [I, c.a, c.b, "--out", str(c.base.a / "config.json")], "input model"),
    "out-over-a-user-file": (lambda c: [I, c.a, c.b, "--out", c.file("notes.txt", "my notes\n")], "not a result record"),
    "out-over-other-json": (lambda c: [A, c.a, c.b, "--out", c.file("r.json", '{"mine": 1}\n')], "not a result record"),
    "out-over-merged-config": (lambda c: [A, c.a, c.b, "--save-merged", "mg", "--out", "mg/config.json"],
                               "--save-merged"),
    "save-merged-dot": (lambda c: [A, c.a, c.b, "--save-merged", (c.file("keep.txt"), ".")[1]],
                        "did not write"),
    "save-merged-user-dir": (lambda c: [A, c.a, c.b, "--save-merged", _user_dir(c)], "did not write"),
    "save-merged-input-a": (lambda c: [A, c.a, c.b, "--save-merged", c.a], "input model directory"),
    "save-merged-input-a-overwrite": (lambda c: [A, c.a, c.b, "--save-merged", c.a, "--overwrite"],
                                      "input model directory"),
    "save-merged-symlink-to-b": (lambda c: [A, c.a, c.b, "--save-merged", _link_to_b(c)], "input model directory"),
    "save-merged-is-file": (lambda c: [A, c.a, c.b, "--save-merged", c.file("merged")], "not a directory"),
    "save-merged-under-file": (lambda c: [A, c.a, c.b, "--save-merged", c.file("g.txt") + "/m"], "not a directory"),
    "train-out-user-dir": (lambda c: ["train", "--task", "lm", "--pe", "rope", "--out", _user_dir(c)],
                           "did not write"),
    "train-out-is-file": (lambda c: ["train", "--task", "lm", "--pe", "rope", "--out", c.file("t")],
                          "not a directory"),
    "train-out-dot": (lambda c: ["train", "--task", "lm", "--pe", "rope", "--out", (c.file("k.txt"), ".")[1]],
                      "did not write"),
    # model directories: malformed configs, code, foreign weights
    "config-not-json": (lambda c: [I, c.a, _write(c, "{not json")], "not valid JSON"),
    "config-json-list": (lambda c: [I, c.a, _write(c, "[1, 2]")], "not an object"),
    "config-string-number": (lambda c: [I, c.a, c.model(edit=_setitem("d_model", "32"))], "d_model"),
    "config-zero-heads": (lambda c: [I, c.a, c.model(edit=_setitem("n_heads", 0))], "n_heads"),
    "config-negative-layers": (lambda c: [I, c.a, c.model(edit=_setitem("n_layers", -1))], "n_layers"),
    "config-bool-size": (lambda c: [I, c.a, c.model(edit=_setitem("d_mlp", True))], "d_mlp"),
    "config-embed-scale-zero": (lambda c: [I, c.a, c.model(edit=_setitem("embed_scale", 0.0))], "embed_scale"),
    "config-nested-junk": (lambda c: [I, c.a, c.model(edit=_setitem("norm_eps", {"a": [1, {"b": None}]}))],
                           "norm_eps"),
    "config-nan": (lambda c: [I, c.a, _write(c, '{"family": "reference", "norm_eps": NaN}')], "NaN"),
    "config-deep-nesting": (lambda c: [I, c.a, _write(c, "[" * 100_000 + "]" * 100_000)], "nests too deeply"),
    "config-symlink-to-junk": (lambda c: [I, c.a, _linked_inside(c, "\x00\x01garbage")], "not valid JSON"),
    "config-symlink-outside": (lambda c: [I, c.a, _symlinked_config(c, c.file("junk.bin", "{}"))],
                               "outside the model directory"),
    "config-symlink-to-device": (lambda c: [I, c.a, _symlinked_config(c, "/dev/zero")], "outside the model directory"),
    "config-symlink-dangling": (lambda c: [I, c.a, _symlinked_config(c, "/nonexistent/config.json")],
                                "outside the model directory"),
    "config-symlink-dangling-inside": (lambda c: [I, c.a, _relink(Path(c.model()), "config.json", "gone.json")],
                                       "does not exist"),
    "weights-link-outside": (lambda c: [I, c.a, _weights_link_outside(c)], "outside the model directory"),
    "index-names-parent": (lambda c: [I, str(c.base.gpt2), _index_naming(c, "../../copy-m0/model.safetensors")],
                           "not a file name inside"),
    "index-names-absolute": (lambda c: [I, str(c.base.gpt2), _index_naming(c, str(c.base.gpt2 / "model.safetensors"))],
                             "not a file name inside"),
    "gpt2-quantized": (lambda c: [I, str(c.base.gpt2), c.model("gpt2", edit=_setitem(
        "quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}))], "'bitsandbytes'"),
    "gpt2-attention-kernel": (lambda c: [I, str(c.base.gpt2), c.model("gpt2", edit=_setitem(
        "attn_implementation", "flash_attention_2"))], "attention kernel"),
    "config-auto-map": (lambda c: [I, c.a, c.model(edit=_setitem("auto_map", {"AutoModel": "evil.Model"}))],
                        "auto_map"),
    "tokenizer-auto-map": (lambda c: [I, _tokenizer_auto_map(c), str(c.base.gpt2)], "auto_map"),
    "tokenizer-broken": (lambda c: [I, _broken_tokenizer(c), str(c.base.gpt2)], "tokenizer"),
    "gpt2-weights-of-another-shape": (lambda c: [I, str(c.base.gpt2), c.model("gpt2", edit=_setitem("n_inner", 40))],
                                      "config says"),  # from the weights' headers, before any tensor is read
    "gpt2-string-heads": (lambda c: [I, str(c.base.gpt2), c.model("gpt2", edit=_setitem("n_head", "4"))], "n_head"),
    "gpt2-zero-heads": (lambda c: [I, str(c.base.gpt2), c.model("gpt2", edit=_setitem("n_head", 0))], "n_head"),
    "gpt2-auto-map": (lambda c: [I, str(c.base.gpt2), c.model("gpt2", edit=_setitem("auto_map", {"a": "b.C"}))],
                      "auto_map"),
    "timm-checkpoint-path": (lambda c: [I, str(c.base.vit), c.model("vit", edit=lambda d: d["model_args"].update(
        checkpoint_path=c.file("secret.txt")))], "checkpoint_path"),
    "timm-pretrained-cfg-file": (lambda c: [I, str(c.base.vit), c.model("vit", edit=_setitem(
        "pretrained_cfg", {"file": c.file("w.bin")}))], "weight source"),
    "timm-pretrained-flag": (lambda c: [I, str(c.base.vit), c.model("vit", edit=lambda d: d["model_args"].update(
        pretrained=True))], "not a VisionTransformer option"),
    "timm-zero-heads": (lambda c: [I, str(c.base.vit), c.model("vit", edit=lambda d: d["model_args"].update(
        num_heads=0))], "num_heads"),
    "config-empty": (lambda c: [I, c.a, _write(c, "")], "not valid JSON"),
    "config-is-directory": (lambda c: [I, c.a, _config_dir(c)], "is a directory"),
    "gpt2-weights-link-to-device": (lambda c: [I, str(c.base.gpt2), _weights_to_device(c)],
                                    "outside the model directory"),
    "out-is-the-merged-dir": (lambda c: [A, c.a, c.b, "--save-merged", "mg", "--out", "mg"], "--save-merged"),
    "out-into-input-via-linked-dir": (lambda c: [I, c.a, c.b, "--out", _linked_parent(c) + "/model.safetensors"],
                                      "input model"),
    "out-symlink-loop": (lambda c: [I, c.a, c.b, "--out", _link_loop(c)], "cannot be checked"),
    "save-merged-own-name-is-dir": (lambda c: [A, c.a, c.b, "--save-merged", _marked_dir_with_config_dir(c)],
                                    "not a regular file"),
    "int-weights": (lambda c: [I, c.a, _int_weights(c)], "floating point"),
    "pickled-only": (lambda c: [I, c.a, _pickled_only(c)], "pickled"),
    "unknown-family": (lambda c: [I, c.a, c.model(config={"hello": 1})], "not a supported family"),
    "mismatched-architectures": (lambda c: [I, c.a, str(c.base.nope), "--points", "2"], "pe is 'rope' vs 'none'"),
    "symmetry-config-junk": (lambda c: ["symmetry", c.model(edit=_setitem("n_heads", "x")), "--dims-only"],
                             "n_heads"),
    # symmetry refuses a directory of weights in align's words (pickles alone were read as a bare config)
    "symmetry-weights-of-another-shape": (lambda c: ["symmetry", c.model("gpt2", edit=_setitem("n_inner", 40))],
                                          "copy-gpt2 cannot be used: "),
    "symmetry-pickled-only": (lambda c: ["symmetry", _pickled_only(c)], "only pickled weights (pytorch_model.bin)"),
    # element files (engine.align.start)
    "start-missing": (lambda c: [A, c.a, c.b, "--method", "dual", "--start", "none.safetensors"], "does not exist"),
    "start-not-safetensors": (lambda c: [A, c.a, c.b, "--method", "learned", "--start", c.file("x.safetensors")],
                              "not a safetensors file"),
    "start-model-weights": (lambda c: [A, c.a, c.b, "--method", "learned", "--start", _weights_named_as_element(c)],
                            "not an element file"),
    "start-other-arch": (lambda c: [A, c.a, c.b, "--method", "dual", "--start", _element(c, "nope")],
                         "pe 'none', not 'rope'"),
    "start-classes-left-out": (lambda c: [A, c.a, c.b, "--method", "learned", "--classes", "heads", "mlp", "--start",
                                          _element(c)], "moves qk, residual_orth, vo"),
    "start-other-coordinates": (lambda c: [A, c.a, c.b, "--method", "learned", "--steps", "1", "--start",
                                           _element(c, classes=("heads", "mlp"))], "align them with their norm gains folded"),
    "start-for-weight": (lambda c: [A, c.a, c.b, "--method", "weight", "--start", _element(c)],
                         "does not use it"),
    "start-a-word": (lambda c: [A, c.a, c.b, "--method", "learned", "--start", "best"], "safetensors file"),
    "save-element-naive": (lambda c: [A, c.a, c.b, "--method", "naive", "--save-element", "e.safetensors"],
                           "no element"),
    "save-element-suffix": (lambda c: [A, c.a, c.b, "--save-element", "e.bin"], "*.safetensors"),
    "save-element-over-a-model": (lambda c: [A, c.a, c.b, "--save-element", _weights_named_as_element(c)],
                                  "not an element file of this tool"),
    "save-element-is-out": (lambda c: [A, c.a, c.b, "--save-element", "x.safetensors", "--out", "x.safetensors"],
                            "also the --out file"),
    "save-element-into-input": (lambda c: [A, c.a, c.b, "--save-element", f"{c.b}/e.safetensors"],
                                "input model directory"),
}


def _write(c: Ctx, text: str) -> str:
    """A copy of model A whose config.json holds `text`."""
    d = Path(c.model())
    (d / "config.json").write_text(text)
    return str(d)


def _check_refusal(rc: int, err: str, phrase: str) -> None:
    lines = err.strip("\n").splitlines()
    assert rc == 2, err
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in err
    assert phrase in lines[0], f"{phrase!r} not in {lines[0]!r}"


# Inputs whose problem only the run itself finds (weights that overflow on the path): the run was announced.
FOUND_BY_RUNNING = {"path-not-finite", "alpha-overflows-the-weights"}


@pytest.mark.parametrize("name", list(CASES))
def test_cli_refuses_bad_input_in_one_line_and_touches_nothing(name, ctx, capsys):
    build, phrase = CASES[name]
    argv = build(ctx)
    roots = ctx.work, ctx.base.root, ctx.work.parent / "store", ctx.work.parent / "zoo"
    before = snapshot(*roots)
    rc = main(argv)
    out, err = capsys.readouterr()
    _check_refusal(rc, err, phrase)
    if name not in FOUND_BY_RUNNING:  # checked before any work starts: nothing was announced
        assert out == "", f"refused after announcing the run:\n{out}"
    assert snapshot(*roots) == before
    assert not (ctx.work / "EXECUTED").exists()  # nothing from a model directory ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_sentence(ctx, capsys):
    rc = main([I, ctx.a, ctx.b, "--device", "cuda", "--out", "r.json"])
    _check_refusal(rc, capsys.readouterr().err, "no CUDA GPU")
    assert not (ctx.work / "r.json").exists()


@pytest.mark.skipif(IS_ROOT, reason="root writes into read-only directories")
def test_read_only_output_location_is_refused_before_the_run(ctx, capsys):
    rc = main([I, ctx.a, ctx.b, "--out", _readonly_dir(ctx)])
    _check_refusal(rc, capsys.readouterr().err, "not writable")


@pytest.mark.parametrize("action", ["table", "build"])
def test_a_store_that_is_a_file_is_a_sentence(action, ctx, capsys, monkeypatch):
    monkeypatch.setenv("LMC_CACHE_DIR", ctx.file("store.json", "{}"))
    before = snapshot(ctx.work)
    argv = ["cache", action] + (["--only", "lm-none-s0", "--methods", "naive"] if action == "build" else [])
    _check_refusal(main(argv), capsys.readouterr().err, "not a directory")
    assert snapshot(ctx.work) == before


@pytest.mark.parametrize("argv", [["interpolate", "a", "b", "--points", "1"], ["interpolate", "{a}", "{b}", "--out", "/dev/null"]])
def test_the_real_entry_point_prints_one_line(argv, base, tmp_path):
    argv = [s.format(a=base.a, b=base.b) for s in argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMC_CACHE_DIR": str(tmp_path / "store")}
    r = subprocess.run([sys.executable, "-m", "engine", *argv], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=120, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr


def test_a_corrupt_zoo_manifest_lists_nothing_with_a_warning(ctx, capsys):
    (ctx.work.parent / "zoo").mkdir()
    (ctx.work.parent / "zoo" / "manifest.json").write_text('{"models": [')
    assert main(["zoo", "list"]) == 0
    out, err = capsys.readouterr()
    assert "the zoo is empty" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "manifest.json is not valid JSON" in lines[0]


# ---------------------------------------------------------------------------------------------
# Outputs: written through links, into directories without losing anything


def test_out_writes_through_a_symlink_and_keeps_it(ctx, capsys):
    (ctx.work / "link.json").symlink_to(ctx.work / "real.json")
    rc = main([I, ctx.a, ctx.b, "--points", "2", "--eval-items", "64", "--out", "link.json"])
    assert rc == 0, capsys.readouterr().err
    assert (ctx.work / "link.json").is_symlink()
    rec = load_record(ctx.work / "real.json")
    prov = rec["provenance"]
    assert prov["device"] == rec["config"]["device"] == "cpu" and prov["dtype"] == "float32"
    assert prov["torch"] == torch.__version__ and prov["threads"] == torch.get_num_threads()
    assert set(prov) >= {"engine_version", "git_commit", "engine_modified", "transformers"}
    assert prov["engine_modified"] in (True, False, None)  # None: not a git checkout


def test_out_replaces_an_earlier_record_and_an_empty_file(ctx, capsys):
    argv = [I, ctx.a, ctx.b, "--points", "2", "--eval-items", "64", "--out", ctx.file("r.json", "")]
    assert main(argv) == 0, capsys.readouterr().err  # an empty file holds nothing to lose
    first = load_record(ctx.work / "r.json")
    assert main([*argv[:-2], "--points", "3", "--out", str(ctx.work / "r.json")]) == 0, capsys.readouterr().err
    assert len(first["lambdas"]) == 2 and len(load_record(ctx.work / "r.json")["lambdas"]) == 3


def test_a_hugging_face_cache_snapshot_loads_through_its_blob_links(base, tmp_path):
    """models--org--name/snapshots/<rev>/* are links into ../../blobs: the one layout whose links leave the
    directory, allowed because they stay inside the cached repository."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in base.gpt2.iterdir():
        shutil.copy(f, blobs / f"blob-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob-{f.name}")
    m = load_model(snap)
    ref = load_model(base.gpt2)
    x = torch.randint(0, 256, (1, 8))
    assert torch.equal(model_logits(m, x), model_logits(ref, x))
    (snap / "extra.json").symlink_to(base.gpt2 / "config.json")  # but nothing outside the repository
    with pytest.raises(ModelError, match="outside the model directory"):
        load_model(snap)


def test_save_merged_keeps_user_files_and_rewrites_only_its_own(ctx, capsys):
    user = Path(_user_dir(ctx))
    rc = main([A, ctx.a, ctx.b, "--method", "naive", "--points", "2", "--eval-items", "64",
               "--save-merged", str(user), "--overwrite"])
    assert rc == 0, capsys.readouterr().err
    assert (user / "notes.txt").read_text() == "my notes\n"  # untouched
    assert not (user / MARKER).exists()  # a directory the tool did not create is not claimed
    merged = load_model(user)
    a, b = load_model(ctx.a), load_model(ctx.b)
    k = "embed.tok"
    want = 0.5 * (a.module.state_dict()[k] + b.module.state_dict()[k])
    assert torch.allclose(merged.module.state_dict()[k], want, rtol=0, atol=1e-6)
    # A directory the tool created carries the marker, lists its files, and is replaced whole by the next
    # save (no --overwrite needed); once it holds anything else, a save there is refused, naming it.
    out = ctx.work / "merged"
    run = [A, ctx.a, ctx.b, "--method", "naive", "--points", "2", "--eval-items", "64", "--save-merged", str(out)]
    assert main(run) == 0
    assert (out / MARKER).read_text().splitlines()[1] == "files: config.json\tmodel.safetensors"
    (out / "metrics.json").write_text("{}")
    (out / "mine.txt").write_text("keep")
    before = snapshot(out)
    capsys.readouterr()
    assert main(run + ["--alpha", "0.25"]) == 2
    assert "also holds metrics.json, mine.txt, which it did not write" in capsys.readouterr().err
    assert snapshot(out) == before
    (out / "metrics.json").unlink()
    (out / "mine.txt").unlink()
    assert main(run + ["--alpha", "0.25"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "config.json", "model.safetensors"])
    assert not list(ctx.work.glob(".merged.lmc-*"))  # no sibling left behind
    capsys.readouterr()


_KILLED_SAVE = """
import os, sys, torch
from engine.models import io, load_model, save_model
m = load_model(sys.argv[1])
with torch.no_grad():
    next(m.module.parameters()).add_(1.0)
where = sys.argv[3]
if where == "fill":  # dies after writing the config, before the weights
    real = io.save_file
    io.save_file = lambda *a, **k: os._exit(9)
elif where == "swap":  # dies with the new directory complete, before it is put in place
    io._exchange = lambda a, b: os._exit(9)
    io.os.rename = lambda a, b: os._exit(9)
save_model(m, sys.argv[2], overwrite=len(sys.argv) > 4)  # a 4th argument: --overwrite
"""


@pytest.mark.parametrize("where", ["fill", "swap"])
def test_a_save_killed_at_any_step_leaves_the_old_model_whole(where, ctx, capsys):
    out = ctx.work / "merged"
    save_model(load_model(ctx.a), out)
    before = snapshot(out)
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, ctx.a, str(out), where], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert snapshot(out) == before  # the old model, whole
    assert list(ctx.work.glob(".merged.lmc-new-*"))  # the killed save's sibling is left ...
    b = load_model(ctx.b)
    save_model(b, out)  # ... and the next save to that place removes it
    assert not list(ctx.work.glob(".merged.lmc-*"))
    x = torch.randint(0, 256, (1, 8))
    assert torch.equal(model_logits(load_model(out), x), model_logits(b, x))


def _foreign_dir(ctx) -> Path:
    """A checkpoint directory the tool did not write: the user's model, notes, a subdirectory and links."""
    d = ctx.work / "users_model"
    save_model(load_model(ctx.a), d)
    (d / MARKER).unlink()
    (d / "notes.txt").write_text("my notes\n")
    (d / "runs" / "logs").mkdir(parents=True)
    (d / "runs" / "logs" / "train.log").write_text("step 1\n")
    (d / "readme").symlink_to("notes.txt")
    return d


@pytest.mark.parametrize("where", ["fill", "swap"])
def test_an_overwrite_into_a_users_directory_killed_at_any_step_leaves_it_whole(where, ctx):
    d = _foreign_dir(ctx)
    before = snapshot(d)
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, ctx.b, str(d), where, "overwrite"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert snapshot(d) == before  # the user's model and files, whole: never a new config beside old weights


def test_an_overwrite_into_a_users_directory_replaces_its_checkpoint_in_one_step(ctx):
    d = _foreign_dir(ctx)
    def others() -> dict:
        return {k: v for k, v in snapshot(d).items() if Path(k).name not in ("config.json", "model.safetensors")}

    before, inode = others(), (d / "notes.txt").stat().st_ino
    b = load_model(ctx.b)
    save_model(b, d, overwrite=True)
    assert others() == before  # the user's files, subdirectory and link as they were, bytes and times
    assert (d / "notes.txt").stat().st_ino == inode  # the same file, linked, never copied or rewritten
    assert (d / "readme").is_symlink() and os.readlink(d / "readme") == "notes.txt"
    assert not (d / MARKER).exists()  # not claimed
    x = torch.randint(0, 256, (1, 8))
    assert torch.equal(model_logits(load_model(d), x), model_logits(b, x))
    assert not list(ctx.work.glob(".users_model.lmc-*"))


# ---------------------------------------------------------------------------------------------
# The store degrades gracefully
# ---------------------------------------------------------------------------------------------
# The store degrades gracefully


@pytest.fixture
def tiny_zoo(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "zoo"
    for name in ("lm-none-s0", "lm-none-s1"):
        save_model(reference.build(replace(LM, pe="none"), seed=zoo.ENTRIES[name].seed), root / name)
    monkeypatch.setenv("LMC_ZOO_DIR", str(root))
    store_dir = tmp_path / "store"
    monkeypatch.setenv("LMC_CACHE_DIR", str(store_dir))
    return store_dir


BUILD = ["cache", "build", "--only", "lm-none-s0", "--methods", "naive", "weight", "--eval-items", "64"]


def _stamp(f: Path) -> tuple:
    return f.read_bytes(), f.stat().st_mtime_ns


def test_cache_build_resumes_and_rebuilds_the_manifest(tiny_zoo, capsys):
    store_dir = tiny_zoo
    assert main(BUILD) == 0, capsys.readouterr().err
    naive = store_dir / "lm-none-s0__lm-none-s1__naive.json"
    weight = store_dir / "lm-none-s0__lm-none-s1__weight.json"
    kept = _stamp(naive)
    # A killed build: one record half-written, the manifest gone.
    weight.write_text('{"method": "weight", "model_a": ')
    (store_dir / "manifest.json").unlink()
    capsys.readouterr()
    assert main(BUILD) == 0
    err = capsys.readouterr().err
    assert "1 record(s) up to date, 1 to compute" in err
    assert _stamp(naive) == kept  # the finished record was neither recomputed nor rewritten
    assert load_record(weight)["method"] == "weight"
    rows = json.loads((store_dir / "manifest.json").read_text())["records"]
    assert sorted(r["file"] for r in rows) == sorted([naive.name, weight.name])
    # Up to date: nothing is recomputed; --force recomputes.
    assert main(BUILD) == 0 and "2 record(s) up to date, 0 to compute" in capsys.readouterr().err
    assert _stamp(naive) == kept
    assert main([*BUILD, "--force"]) == 0 and "0 record(s) up to date, 2 to compute" in capsys.readouterr().err


def test_cache_table_marks_the_records_cache_build_would_recompute(tiny_zoo, capsys, monkeypatch):
    from engine import builders

    store_config = builders.cache_config
    monkeypatch.setattr(builders, "cache_config", lambda a, b, m, eval_items=64: store_config(a, b, m, eval_items))
    assert main([*BUILD[:-4], "naive", "--eval-items", "64"]) == 0  # the store's own config (here)
    assert main([*BUILD[:-4], "weight", "--eval-items", "32"]) == 0  # another evaluation size
    capsys.readouterr()
    assert main(["cache", "table"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| lm-none-s0 / lm-none-s1"))
    naive, _, weight = row.split(" | ")[1:4]
    assert not naive.endswith("*") and weight.endswith(" *")
    assert out.rstrip().endswith("\\* 1 record(s) of another config than `cache build` now computes (an earlier "
                                 "budget, evaluation size or default setting); `cache build` recomputes them.")


def test_a_bad_record_is_skipped_with_a_warning_everywhere(tiny_zoo, capsys):
    store_dir = tiny_zoo
    assert main(BUILD) == 0
    naive = store_dir / "lm-none-s0__lm-none-s1__naive.json"
    weight = store_dir / "lm-none-s0__lm-none-s1__weight.json"
    good = load_record(weight)
    naive.write_text("[1, 2, 3]")  # a JSON list, not a record
    capsys.readouterr()
    assert main(["cache", "table"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and naive.name in lines[0]
    row = next(line for line in out.splitlines() if line.startswith("| lm-none-s0 / lm-none-s1"))
    assert f"{good['barrier']:.3f} / {good['midpoint_barrier']:.3f}" in row and "| - |" in row
    # Library: the same record is None with a StoreWarning; the pair's other methods are still there
    # (what the app's connectivity page reads); the manifest lists only the usable record.
    with pytest.warns(StoreWarning, match=naive.name):
        assert cached_record("lm-none-s0", "lm-none-s1", "naive") is None
    assert cached_record("lm-none-s0", "lm-none-s1", "weight")["barrier"] == good["barrier"]
    with pytest.warns(StoreWarning, match=naive.name):
        problems = write_manifest()
    assert len(problems) == 1 and [r["method"] for r in list_cached()] == ["weight"]
    # A record lacking a field, and one whose content contradicts its file name, are skipped too.
    weight.write_text(json.dumps({k: v for k, v in good.items() if k != "barrier"}))
    with pytest.warns(StoreWarning, match="missing barrier"):
        assert cached_record("lm-none-s0", "lm-none-s1", "weight") is None
    weight.write_text(json.dumps({**good, "method": "dual"}))
    with pytest.warns(StoreWarning, match="not what its name says"):
        assert cached_record("lm-none-s0", "lm-none-s1", "weight") is None
    with pytest.raises(LMCError, match="missing barrier"):
        store({k: v for k, v in good.items() if k != "barrier"})


def test_an_unreadable_manifest_lists_the_records_present(tiny_zoo, capsys):
    assert main(BUILD) == 0
    (tiny_zoo / "manifest.json").write_text("not json")
    with pytest.warns(StoreWarning, match="manifest"):
        rows = list_cached()
    assert sorted(r["method"] for r in rows) == ["naive", "weight"]
    capsys.readouterr()


def _sparse(f: Path, size: int) -> Path:
    """A file of `size` bytes that takes no room on the disk (a hole)."""
    f.parent.mkdir(parents=True, exist_ok=True)
    with open(f, "wb") as h:
        h.truncate(size)
    return f


def test_an_oversized_json_file_is_refused_as_what_it_is(tmp_path, ctx, capsys):
    """The size refusal names the kind of file: a result record, a config, a shard index."""
    from engine.models.io import MAX_JSON_BYTES, check_closed_world
    from engine.results import MAX_RECORD_BYTES

    rec = _sparse(tmp_path / "r.json", MAX_RECORD_BYTES + 1)
    with pytest.raises(LMCError) as e:
        load_record(rec)
    assert str(e.value) == (f"Result file {rec} is {MAX_RECORD_BYTES + 1:,} bytes, too large for a result record "
                            f"(at most {MAX_RECORD_BYTES:,}).")
    d = Path(ctx.model())
    _sparse(d / "config.json", MAX_JSON_BYTES + 1)
    assert main([I, str(d), ctx.b, "--points", "2"]) == 2
    assert capsys.readouterr().err == (f"error: Model A directory {d} cannot be used: {d / 'config.json'} is "
                                       f"{MAX_JSON_BYTES + 1:,} bytes, too large for a JSON config (at most "
                                       f"{MAX_JSON_BYTES:,}).\n")
    index = _sparse(tmp_path / "m" / "model.safetensors.index.json", MAX_JSON_BYTES + 1)
    with pytest.raises(ModelError, match=rf"^{re.escape(str(index))} is [\d,]+ bytes, too large for a shard index "):
        check_closed_world(index.parent)


# ---------------------------------------------------------------------------------------------
# Hypothesis: any mutation of a config.json is a model that loads and runs, or a one-line refusal naming it

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 70), st.sampled_from([0.0, -1.0, 1e-5, 2.5, 1e300]),
    st.text(max_size=6), st.lists(st.integers(-2, 4), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.recursive(st.integers(), lambda s: st.lists(s, max_size=2) | st.dictionaries(st.text(max_size=2), s, max_size=2),
                 max_leaves=6),
)


def _mutations(keys: list[str]):
    one = st.one_of(
        st.tuples(st.just("drop"), st.sampled_from(keys), st.none()),
        st.tuples(st.just("set"), st.sampled_from(keys), JUNK),
        st.tuples(st.just("add"), st.text(min_size=1, max_size=8), JUNK),
    )
    return st.lists(one, min_size=1, max_size=3)


def _mutate(cfg: dict, muts) -> dict:
    cfg = dict(cfg)
    for op, k, v in muts:
        if op == "drop":
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


# A refusal the weights explain: the saved tensors no longer fit a changed or dropped shape field.
WEIGHTS_DO_NOT_FIT = re.compile(r"does not match its config|has shape .*, config says|could not be loaded as")


def _names_the_mutation(msg: str, fields: dict, muts) -> None:
    """A refusal is one line naming what the mutation touched: a changed or dropped field by name, an added
    one by its repr, the weights that no longer fit a changed field, or no family when model_type changed."""
    changed = [k for op, k, _ in muts if op != "add" or k in fields]
    added = [k for op, k, _ in muts if op == "add" and k not in fields]
    assert "\n" not in msg, msg
    named = any(re.search(rf"\b{re.escape(k)}\b", msg) for k in changed) or any(repr(k) in msg for k in added)
    unfit = bool(changed) and WEIGHTS_DO_NOT_FIT.search(msg) is not None
    no_family = "model_type" in changed and "is not a supported family" in msg
    assert named or unfit or no_family, (muts, msg)


def _load_or_refuse(d: Path, cfg: dict, fields: dict, muts, task: str) -> None:
    """config.json becomes `cfg` (`fields` mutated by `muts`): the model loads and gives finite logits, or the
    refusal names the mutation."""
    (d / "config.json").write_text(json.dumps(cfg))
    try:
        m = load_model(d)
        x = torch.randint(0, m.arch.n_out, (1, 4)) if task == "lm" else torch.rand(1, 1, 8, 8)
        y = model_logits(m, x)
    except (ModelError, LMCError) as e:
        _names_the_mutation(str(e), fields, muts)
        return
    assert torch.isfinite(y).all()


@pytest.fixture(scope="module")
def mutable(base, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Copies of the saved models to rewrite config.json in, with their original configs."""
    root = tmp_path_factory.mktemp("mutable")
    out = {}
    for k in ("a", "gpt2", "vit"):
        d = Path(shutil.copytree(getattr(base, k), root / k))
        out[k] = (d, json.loads((d / "config.json").read_text()))
    return out


REF_KEYS = list(reference.RefConfig().to_dict())
GPT2_KEYS = ["n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "n_inner", "model_type",
             "activation_function", "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights"]
HYP = settings(max_examples=40, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@HYP
@given(muts=_mutations(REF_KEYS))
def test_mutated_reference_configs_load_or_are_refused(mutable, muts):
    d, cfg = mutable["a"]
    _load_or_refuse(d, _mutate(cfg, muts), cfg, muts, "lm")


@settings(HYP, max_examples=15)
@given(muts=_mutations(GPT2_KEYS))
def test_mutated_gpt2_configs_load_or_are_refused(mutable, muts):
    d, cfg = mutable["gpt2"]
    _load_or_refuse(d, _mutate(cfg, muts), cfg, muts, "lm")


@settings(HYP, max_examples=15)
@given(muts=_mutations(list(VIT_ARGS)))
def test_mutated_timm_configs_load_or_are_refused(mutable, muts):
    d, cfg = mutable["vit"]
    _load_or_refuse(d, {**cfg, "model_args": _mutate(cfg["model_args"], muts)}, cfg["model_args"], muts, "vit")
