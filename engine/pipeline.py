"""One run from a config to its record: the pair checked from the configs, the models loaded, B aligned
onto A, the path walked, the record made (run_pair); the same for a width-heterogeneous pair (widen_pair),
the loss plane (plane_pair) and N models in one basis (multi_models). engine.api re-exports these names;
the stores built from them are engine.builders'."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine import distributed
from engine.cancel import CancelToken
from engine.cancel import check as check_cancel
from engine.data import default_splits, digits_sha256
from engine.errors import ArchitectureMismatch, LMCError, ModelError
from engine.evaluate import eval_set_for, evaluate, is_masked_lm, lm_tokenizer, train_eval_set_for
from engine.interpolate import LinearPath, check_same_architecture, interpolate, make_path
from engine.models import Model, load_model, save_model
from engine.models.base import Arch
from engine.models.io import check_output_dir
from engine.progress import PhaseProgress, Phases, relabel
from engine.results import RunConfig, make_record, resolve_device
from engine.timing import naive_paths, reference_gflops
from engine.zoo import ENTRIES, display_name, resolve

if TYPE_CHECKING:
    from engine.resources import Estimate

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


# Families as a reader names them; the task is added for the families that hold both kinds.
FAMILY_LABELS = {"reference": "reference", "hf_gpt2": "GPT-2", "hf_llama": "Llama", "hf_qwen2": "Qwen2",
                 "hf_qwen3": "Qwen3", "hf_mistral": "Mistral", "hf_olmo": "OLMo", "hf_gemma": "Gemma", "hf_phi": "Phi",
                 "hf_neox": "GPT-NeoX", "timm_vit": "ViT", "hf_bert": "BERT", "hf_roberta": "RoBERTa",
                 "hf_xlm_roberta": "XLM-RoBERTa"}
TASK_LABELS = {"lm": "LM", "vit": "ViT"}
PE_NAMES = {"none": "no positional encoding", "learned": "learned PE", "sinusoidal": "sinusoidal PE", "rope": "RoPE"}


def family_label(family: str, task: str) -> str:
    """'GPT-2 LM', 'Llama LM', 'Qwen2 LM', 'GPT-NeoX LM', 'ViT', 'reference LM', 'reference ViT'."""
    name = FAMILY_LABELS.get(family, family)
    return name if name == TASK_LABELS.get(task) else f"{name} {TASK_LABELS.get(task, task)}"


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, read from its config and its weight files' headers (no tensor)."""

    name: str  # zoo name, or the directory as given
    path: Path  # the directory, absolute
    family: str
    arch: Arch
    label: str  # family_label

    def describe(self) -> str:
        """'GPT-2 LM, 12 layers, D = 768, 12 heads, learned PE'."""
        a = self.arch
        return (f"{self.label}, {a.n_layers} layers, D = {a.d_model:,}, {a.n_heads} heads"
                + (f" ({a.n_kv_heads} KV groups)" if a.n_kv_heads < a.n_heads else "")
                + f", {PE_NAMES.get(a.pe, a.pe)}"
                + (f" ({json.loads(a.rope_scaling)['rope_type']} frequency scaling)" if a.rope_scaling else "")
                + (" with QK-norm" if a.qk_norm else ""))


def model_info(name_or_path: str | Path, role: str = "Model") -> ModelInfo:
    """The family and architecture of a zoo model or a model directory, from its config and its weight files'
    headers (safetensors, parameters stored as floating point in the config's shapes); no tensor is read.

    Every problem is one sentence that starts with `role` ("Model A", "Model B", "Model") and names the
    directory by its full path, so the same input gets the same message wherever it is checked.
    """
    from engine.models.io import check_closed_world, check_weight_files, read_config
    from engine.resources import model_shape

    s = str(name_or_path).strip()
    if not s:
        raise ModelError(f"{role}: no model given; enter a zoo name or a model directory.")
    if s in ENTRIES:
        try:
            path = resolve(s)
        except ModelError as e:
            raise ModelError(f"{role}: {e}") from None
    else:
        path = Path(s).expanduser().absolute()
        if not path.exists():
            raise ModelError(f"{role} {path} is neither a zoo model nor an existing directory.")
        if not path.is_dir():
            raise ModelError(f"{role} {path} is neither a zoo model nor a model directory: it is a file.")
        if not any(path.iterdir()):
            raise ModelError(f"{role} directory {path} is empty: a model directory holds config.json and "
                             "the weights.")
        if not os.path.lexists(path / "config.json"):  # a dangling link is there: read_config names it
            raise ModelError(f"{role} directory {path} has no config.json, so its family cannot be told.")
    try:
        check_closed_world(path)  # a link that leads outside, before anything it points at is read
        read_config(path)
        shape = model_shape(path)
        check_weight_files(path, dict(shape.parameters))  # from the files' headers: no tensor is read
    except LMCError as e:
        raise ModelError(f"{role} directory {path} cannot be used: {_lower_first(str(e))}") from None
    return ModelInfo(s, path.absolute(), shape.family, shape.arch, family_label(shape.family, shape.arch.task))


def _lower_first(msg: str) -> str:
    return msg[:1].lower() + msg[1:] if msg[:2] != msg[:2].upper() else msg


def check_pair(model_a: str | Path, model_b: str | Path) -> tuple[ModelInfo, ModelInfo]:
    """Refuse, from the configs and before any weight is loaded, a pair that cannot be interpolated.

    One message per cause: a model that cannot be read (model_info), two families ("model A is a
    GPT-2 LM, model B a ViT"), or one family in two shapes (the first field that differs).
    """
    a, b = model_info(model_a, "Model A"), model_info(model_b, "Model B")
    if a.label != b.label:
        raise ArchitectureMismatch(
            f"Model A is a {a.label} and model B a {b.label}: only two models of the same kind (family and "
            f"task) can be interpolated (A: {a.path}, B: {b.path}).")
    diff = a.arch.mismatch(b.arch)
    if diff is not None:
        raise ArchitectureMismatch(
            f"Models A and B are both {a.label}s but of different shapes ({diff}), so their weights cannot "
            f"be interpolated (A: {a.path}, B: {b.path}).")
    return a, b


def describe_pair(model_a: str, model_b: str) -> str:
    """What a pair is, in a sentence: zoo pairs are one recipe trained from two seeds; any other pair
    is described by what its configs say (check_pair must accept it)."""
    a, b = check_pair(model_a, model_b)
    if model_a in ENTRIES and model_b in ENTRIES:
        ea, eb = ENTRIES[model_a], ENTRIES[model_b]
        # the step budget too: longer-trained pairs keep larger barriers (bench/RESULTS.md, "Training length, not
        # the positional scheme")
        return (f"{a.describe()}; the same recipe trained for {ea.train_config().steps:,} steps from seeds {ea.seed} "
                f"and {eb.seed} (initialisation and data order).")
    if a.path == b.path:
        return f"{a.describe()}; A and B are the same directory, so the path is flat by construction."
    return f"Two {a.label}s of the same shape: {a.describe()}."


def load_named(name_or_path: str, dtype: str = "float32", device: str = "cpu") -> Model:
    m = load_model(resolve(name_or_path), dtype=DTYPES[dtype])
    m.name = display_name(name_or_path)
    m.module.to(device)
    return m


def final_config(cfg: RunConfig, arch: Arch) -> RunConfig:
    """The config a run on models of `arch` records and hashes: the budget and data actually used, the device
    resolved, the options those of the method's own type (engine.align.method_options: one it does not take is
    refused).

    `cache build` computes it without loading the models to tell whether a stored record is current.
    """
    from engine.align import method_entry, method_options
    from engine.align.learned import DEFAULT_CANDIDATES, DEFAULT_LAMBDAS, default_lambdas, step_budget
    from engine.classes import choose_classes

    task = arch.task
    entry = method_entry(cfg.method)
    options = method_options(cfg.method, cfg.options)
    if "candidates" in options.specs() and options.candidates is None:
        # the MLP candidates default by task and that default has changed (learned.DEFAULT_CANDIDATES): the
        # record names the one it ran, so a record of the earlier default is never taken for a current one
        options = replace(options, candidates=DEFAULT_CANDIDATES[task])
    if "lambdas" in options.specs() and options.lambdas is None:
        # an LM path without a residual map samples lam adaptively, not as its task does (learned.default_lambdas):
        # the record names it, so a record of the task's sampling is never taken for a current one
        lam = default_lambdas(task, choose_classes(arch, cfg.method, cfg.classes).classes)
        if lam != DEFAULT_LAMBDAS[task]:
            options = replace(options, lambdas=lam)
    data = digits_sha256() if task == "vit" else default_splits().sha256
    steps = step_budget(cfg.steps, options.align_kwargs().get("time_budget_s"), entry.steps(task))
    return replace(cfg, steps=steps, data_sha256=data, device=resolve_device(cfg.device), options=options)


def run_config(config: dict) -> RunConfig:
    """The RunConfig a record's `config` describes (RunConfig.to_dict's inverse): its `extra` pairs read as
    the method's options, every field validated."""
    from dataclasses import fields

    from engine.align import method_entry

    if not isinstance(config, dict) or not isinstance(config.get("extra", ()), (list, tuple)):
        raise LMCError(f"A run config is an object with a list of option pairs as extra, not {config!r}.")
    names = {f.name for f in fields(RunConfig)} - {"options"}
    unknown = sorted(set(config) - names - {"extra"})
    if unknown:
        raise LMCError(f"Run config field {unknown[0]!r} is not known; the fields are {', '.join(sorted(names))}, extra.")
    options = method_entry(config.get("method")).options.from_pairs(config.get("extra", ()))
    body = {k: v for k, v in config.items() if k != "extra"}
    if isinstance(body.get("classes"), list):
        body["classes"] = tuple(body["classes"])
    return RunConfig(**body, options=options)


MAX_EXTRAPOLATION = 100.0  # |alpha| of an extrapolated save: beyond, the weights are alpha (theta_B - theta_A)


def load_both(cfg: RunConfig, device: str, phases: Phases, cancel: CancelToken | None,
              units: int = 2) -> tuple[Model, Model, Callable]:
    """Models A and B of `cfg` on `device`, each a unit of the "load" phase (of `units`; the caller
    ticks the rest), `cancel` checked before each. Returns both and the phase's tick."""
    tick = phases.phase("load", units)
    models = []
    for i, (role, name) in enumerate((("A", cfg.model_a), ("B", cfg.model_b)), 1):
        check_cancel(cancel, f"loading, model {role}")
        models.append(load_named(name, cfg.dtype, device))
        tick(i, units, f"model {role}: {models[-1].name}")
    return models[0], models[1], tick


def add_attribution(attribution: bool | None, al, es, path: dict, points: int, extra: dict, timings: dict,
                    phases: Phases, cancel: CancelToken | None) -> None:
    """The record's `attribution` (engine.attribution) into `extra`: always for True, never for False, and for
    None unless it would cost far more than the path (engine.attribution.skipped: `attribution_skipped` says so)."""
    from engine.attribution import attribute, skipped, subset

    if attribution is False:
        return
    why = skipped(al.method, al.model_a.arch.to_dict(), es.size, points) if attribution is None else None
    if why:
        extra["attribution_skipped"] = why
        return
    extra["attribution"] = attribute(al, subset(es), path, cancel=cancel, progress=phases.phase("attribution"))
    timings["attribution"] = extra["attribution"]["seconds"]


def check_alpha(alpha: float, extrapolate: bool = False) -> float:
    """The position of a saved model on the path: finite, and in [0, 1] unless extrapolating on purpose
    (then within MAX_EXTRAPOLATION of the segment)."""
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LMCError(f"alpha must be a finite number (0 = model A, 1 = model B), not {alpha!r}.")
    if not extrapolate and not 0 <= alpha <= 1:
        raise LMCError(f"alpha {alpha:g} lies outside [0, 1], beyond the two models on the line; "
                       "pass --extrapolate (extrapolate=True) to save such a model anyway.")
    if abs(alpha) > MAX_EXTRAPOLATION:
        raise LMCError(f"alpha {alpha:g} is too far beyond the two models: an extrapolated save takes "
                       f"|alpha| up to {MAX_EXTRAPOLATION:g}.")
    return float(alpha)


def check_inputs(cfg: RunConfig, save_merged: str | Path | None = None, alpha: float = 0.5, overwrite: bool = False,
                 extrapolate: bool = False, offload: bool = False,
                 save_element: str | Path | None = None) -> tuple[tuple[Path, Path], Estimate]:
    """Every check run_pair makes before anything loads, from the configs and the named files alone: the method
    and its options, the device, the pair (configs, weight headers), A's tokenizer, the path kind, the merged
    model's directory and alpha, the element files, and the run's memory (refused if it cannot fit). Returns the
    two models' paths and the memory estimate (engine.resources.describe says it), so that a caller can announce
    a run only once it is known to start."""
    from engine.align import method_options
    from engine.resources import check_run

    method_options(cfg.method, cfg.options)  # the method and its options, before anything else is read
    resolve_device(cfg.device)
    info_a, info_b = check_pair(cfg.model_a, cfg.model_b)  # from the configs: refused before loading
    paths = (info_a.path, info_b.path)
    if info_a.arch.task == "lm" and not is_masked_lm(info_a.arch):  # A's tokenizer encodes the evaluation text
        lm_tokenizer(info_a.arch, info_a.path, str(cfg.model_a))
    if cfg.path == "circuits":
        from engine.circuits import circuit_refusal

        why = circuit_refusal(info_a.arch)
        if why:
            raise LMCError(f"The circuit path is not defined for {cfg.model_a}: {why}.")
    if save_merged is not None:
        check_alpha(alpha, extrapolate)
        check_output_dir(save_merged, overwrite, inputs=paths, name="--save-merged directory")
    check_element_files(cfg, info_a.arch, save_element, paths)
    return paths, check_run(cfg, offload=offload)


def run_pair(cfg: RunConfig, progress: PhaseProgress | None = None, save_merged: str | Path | None = None,
             alpha: float = 0.5, overwrite: bool = False, extrapolate: bool = False, offload: bool = False,
             cancel: CancelToken | None = None, train_curve: bool = True, attribution: bool | None = None,
             one_sided: dict | None = None, checkpoint: str | Path | None = None,
             save_element: str | Path | None = None, announce: Callable[[Estimate], None] | None = None) -> dict:
    """Load both models, align B onto A with cfg.method, interpolate, return the result record.

    The path is evaluated on cfg.eval_split and, at the same points, on a bounded sample of the train
    split (engine.evaluate.train_eval_set_for: the record's train_loss, train_barrier, train_eval_set);
    `train_curve` False leaves the train curve out (the class ablation keeps test curves only).
    `attribution` attributes the midpoint barrier to layers and, for aligned runs, to the symmetry
    classes (engine.attribution: the record's `attribution`); None (the default) does so unless it would
    cost far more than the path (engine.attribution.skipped), and then says why not (`attribution_skipped`).
    Every method goes through the aligner registry (engine/align); the record then carries the
    classes used and why the others were left out (`classes`, `classes_left_out`), the alignment
    diagnostics and the endpoint exactness check; a naive record also carries its curve in the aligned
    runs' coordinates (naive_in_aligned_coordinates). `save_merged` writes the model at
    (1 - alpha) theta_A + alpha g.theta_B into that directory, in the format of the path's models: the
    family's own, or the reference family when the rewrite for residual rotations left it (the
    record's merged.format says which; checked
    before anything is loaded: engine.models.io.check_output_dir; `overwrite` allows a non-empty
    directory the tool did not write; alpha outside [0, 1] needs `extrapolate`). `offload` keeps both
    endpoints (and the alignment) on the CPU and only the path model on the device (docs/SCALE.md).

    `progress` hears of each phase (load, measure B, align, interpolate: engine.progress) with the
    time its current pass has left; `cancel` (engine.cancel) stops the run with Cancelled within one
    unit of work (a model loaded, an evaluation batch, a layer or step, a grid point), before
    anything is written. `one_sided` (dual only) is a learned record's diagnostics that its comparison
    may take instead of running it (engine.builders.one_sided_run says when that is the same run).
    `checkpoint`: a directory where learned and dual matching keep a resumable state, so that the same run
    started again after an interruption resumes at its last validation check (engine.align.resume); the
    caller deletes it once the record is stored. `save_element` writes the element the run found, in full
    precision, to that file (engine.align.start: a later learned or dual run's `start`); the record's
    `element_file` names it. `announce` hears the run's memory estimate once every input is checked
    (check_inputs), before anything loads: the CLI prints it.
    """
    from engine.align.run import align, alignment_record, endpoint_check
    from engine.memory import trim_freed_memory

    (path_a, path_b), need = check_inputs(cfg, save_merged, alpha, overwrite, extrapolate, offload, save_element)
    if announce is not None:
        announce(need)
    device = resolve_device(cfg.device)
    gflops = reference_gflops(device, refresh=True)  # the machine's speed as the run starts: its provenance
    phases = Phases(progress)
    t0 = time.perf_counter()
    home = "cpu" if offload else device  # where the endpoints live
    a, b = load_both(cfg, home, phases, cancel)[:2]
    check_same_architecture(a, b)
    if save_merged is not None and cfg.path == "circuits" and a.arch.pe == "rope":
        raise LMCError("--save-merged cannot write a model of the circuit path under RoPE: its doubled heads "
                       "rotate with the endpoints' frequencies, which the reference checkpoint format does not record.")
    es = eval_set_for(a, cfg.eval_split, cfg.eval_items)  # before the work: a bad tokenizer fails fast
    train_es = train_eval_set_for(a, es) if train_curve else None  # a bounded sample of the train split
    t_load = time.perf_counter() - t0
    # The record and its hash carry the budget and data actually used, not the "default" markers.
    cfg = final_config(replace(cfg, device=device), a.arch)
    t1 = time.perf_counter()
    if cfg.method == "naive":
        loss_b = None
    else:  # B itself is moved in place below; with offload it is evaluated in a work model on the device
        model_b = LinearPath(b, b, offload=True, device=device).at(1.0) if offload else b
        loss_b = evaluate(model_b, es, progress=phases.phase("measure B"), cancel=cancel)["loss"]
    t_check = time.perf_counter() - t1
    from engine.align.resume import Checkpoint

    ck = Checkpoint(Path(checkpoint), cfg.hash()) if checkpoint is not None else None
    al = align(a, b, cfg.method, cfg.classes, cfg.steps, cfg.seed, in_place=True, progress=phases.phase("align"),
               cancel=cancel, one_sided=one_sided, checkpoint=ck, **cfg.options.align_kwargs())
    trim_freed_memory()  # the alignment's freed scratch goes back before the path model is built
    n_paths = naive_paths(a.arch) if cfg.method == "naive" else 1  # naive: also in the aligned coordinates
    tick = phases.phase("interpolate", n_paths * cfg.points)
    path = interpolate(al.model_a, al.model_b, es, cfg.points, progress=relabel(tick, total=n_paths * cfg.points),
                       offload=offload, device=device if offload else None, cancel=cancel, path=cfg.path,
                       train_es=train_es)
    t1 = time.perf_counter()
    check = endpoint_check(b, al, es, path["endpoint_loss_b"], loss_b)
    timings = {"load": t_load, "align": al.seconds, "endpoint_check": t_check + time.perf_counter() - t1}
    alignment = alignment_record(al)  # before anything below folds the models in place
    extra: dict = {"classes": sorted(al.classes), "classes_left_out": al.left_out}
    if cfg.path == "weights":
        add_attribution(attribution, al, es, path, cfg.points, extra, timings, phases, cancel)
    if offload:
        extra["offload"] = True
    if save_merged is not None:
        merged = make_path(al.model_a, al.model_b, cfg.path).at(alpha)
        if not all(bool(torch.isfinite(t).all()) for t in merged.module.state_dict().values() if t.is_floating_point()):
            raise LMCError(f"The merged model at alpha {alpha:g} has weights that overflow {cfg.dtype}; "
                           "nothing was saved (choose an alpha nearer the segment).")
        if distributed.is_main():  # under torchrun every process holds the model; process 0 writes it
            save_model(merged, save_merged, overwrite=overwrite, inputs=(path_a, path_b))
        extra["merged"] = {"path": str(save_merged), "alpha": alpha, "family": merged.family,
                           "format": merged_format(a, merged, al.pair.rewrite)}
    if cfg.method == "naive":  # the same identity element, walked in the aligned runs' coordinates
        t1 = time.perf_counter()
        extra |= naive_in_aligned_coordinates(a, b, es, cfg.points, path, offload=offload,
                                              device=device if offload else None, cancel=cancel, kind=cfg.path,
                                              progress=relabel(tick, "aligned coordinates, ", cfg.points,
                                                               n_paths * cfg.points))
        timings["interpolate_aligned_coordinates"] = time.perf_counter() - t1
    rec = make_record(cfg, path, timings, arch=a.arch.to_dict(), alignment=alignment, endpoint_check=check, **extra)
    rec["provenance"]["reference_gflops"] = round(gflops, 2)
    if save_element is not None:
        rec["element_file"] = write_element(save_element, al, rec)
    return rec


def check_element_files(cfg: RunConfig, arch: Arch, save: str | Path | None, inputs: tuple[Path, Path]) -> None:
    """Before anything loads: the element file a run starts from fits its models and classes, and the one it
    will save is a file it may write (engine.align.start)."""
    from engine.align.pair import rewrite_for
    from engine.align.start import check_save_target, check_start, is_file_start
    from engine.classes import choose_classes

    start = cfg.options.given().get("start")
    if is_file_start(start):
        classes = choose_classes(arch, cfg.method, cfg.classes).classes
        check_start(start, arch, classes, rewrite=rewrite_for(arch, classes))
    if save is not None:
        if cfg.method == "naive":
            raise LMCError("--save-element keeps what an alignment found; the naive run has no element (the "
                           "identity).")
        check_save_target(save, inputs)


def write_element(file: str | Path, al, rec: dict) -> dict:
    """Save the run's element (B's own, and A's for dual: engine.align.start) and say where, by process 0."""
    from engine.align.start import file_sha256, save_element
    from engine.symmetry import compose

    out, arch = al.out, al.pair.arch
    g_b = out.g if out.g_a is None else compose(arch, out.g_a, out.g)  # dual: out.g is g_A^{-1} g_B
    diag = rec["alignment"].get("diagnostics") or {}
    meta = {"method": rec["method"], "model_a": rec["model_a"], "model_b": rec["model_b"],
            "classes": sorted(al.classes), "rewrite": al.pair.rewrite, "steps": diag.get("steps_done"),
            "barrier": rec["barrier"], "config_hash": rec["config_hash"]}
    if not distributed.is_main():  # under torchrun every process holds the element; process 0 writes it
        return {"path": str(file)}
    save_element(file, arch, g_b, out.g_a, meta)
    return {"path": str(file), "sha256": file_sha256(file)}


PLANE_EVAL_ITEMS = 8_192  # the loss plane evaluates GRID^2 points: 8,192 tokens (or every test image) each


def plane_pair(model_a: str, model_b: str, method: str = "weight", grid: int | None = None,
               eval_items: int | None = PLANE_EVAL_ITEMS, split: str = "test", steps: int = 0, seed: int = 0,
               dtype: str = "float32", progress: Callable | None = None, cancel: CancelToken | None = None) -> dict:
    """The loss over the plane through A, B and B aligned by `method` (engine.plane), as a record:
    the grid's coordinates and losses, where the three models sit, the evaluation set and provenance."""
    from engine.align import method_entry
    from engine.plane import GRID, check_method, plane_of
    from engine.results import provenance

    method_entry(method)
    check_method(method)  # before anything loads
    check_pair(model_a, model_b)
    a, b = load_named(model_a, dtype), load_named(model_b, dtype)
    check_same_architecture(a, b)
    es = eval_set_for(a, split, eval_items)
    out = plane_of(a, b, method, es, grid or GRID, steps=steps, seed=seed, progress=progress, cancel=cancel)
    return {"kind": "loss_plane", "model_a": display_name(model_a), "model_b": display_name(model_b), **out,
            "eval_set": es.description, "task": a.arch.task, "provenance": provenance("cpu", dtype),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def merged_format(a: Model, merged: Model, rewrite: str) -> str:
    """One phrase naming the format a merged model is saved in, and why when it is not the models' own."""
    if merged.family == a.family:
        folded = ", norm gains folded into the readers" if rewrite else ""
        return f"{a.family} (the models' own format{folded})"
    why = {"layernorm_to_rmsnorm": f"the residual rotation rewrote {a.family}'s LayerNorm as RMSNorm",
           "fold_norms": "folding the final norm gain untied the embeddings"}.get(rewrite, "")
    return (f"{merged.family} family, {merged.arch.norm} (not {a.family}: {why}); load it with this engine "
            "(engine.models.load_model)")


def naive_in_aligned_coordinates(a: Model, b: Model, es, points: int, native: dict, progress=None,
                                 offload: bool = False, device: str | None = None,
                                 cancel: CancelToken | None = None, kind: str = "weights") -> dict:
    """The naive path (the identity element) in the coordinates the default aligned runs interpolate in.

    Aligned runs fold RMSNorm gains into the readers or rewrite LayerNorm as RMSNorm before they
    interpolate (engine.align.pair.prepare_pair), so their path is not the native straight line even
    for the identity element: the gains interpolate inside the readers. This walks the identity in
    those coordinates, so a naive barrier and an aligned one compare like for like. Where the default
    aligned runs rewrite nothing (sinusoidal PE) the coordinates agree and the native curve is reused.
    `a` and `b` may be folded in place (each keeps computing its function). Returns the record fields
    folded_rewrite, loss_folded, barrier_folded, midpoint_barrier_folded (+ accuracy_folded,
    accuracy_drop_folded for ViTs).
    """
    from engine.align.pair import prepare_pair
    from engine.classes import choose_classes

    pair = prepare_pair(a, b, choose_classes(a.arch, "weight").classes, in_place=True)
    path = native if not pair.rewrite else interpolate(pair.model_a, pair.model_b, es, points, progress=progress,
                                                       offload=offload, device=device, cancel=cancel, path=kind)
    out = {"folded_rewrite": pair.rewrite, "loss_folded": path["loss"], "barrier_folded": path["barrier"],
           "midpoint_barrier_folded": path["midpoint_barrier"]}
    if path["accuracy"] is not None:
        out |= {"accuracy_folded": path["accuracy"], "accuracy_drop_folded": path["accuracy_drop"]}
    return out


# Width-heterogeneous pairs (docs/MATH.md section 8): the narrow model A lifted exactly into B's wider
# shape, B aligned onto lifted A by any method, the path walked in B's width. The records are result
# records plus a `lift` field.

def check_widen(model_a: str | Path, model_b: str | Path) -> tuple[ModelInfo, ModelInfo]:
    """Refuse, from the configs and before any weight is loaded, a pair A cannot be lifted into (one sentence)."""
    from engine.widen import lift_refusal

    a, b = model_info(model_a, "Model A"), model_info(model_b, "Model B")
    why = lift_refusal(a.arch, b.arch, display_name(model_a), display_name(model_b))
    if why:
        raise ArchitectureMismatch(why)
    return a, b


def widen_pair(cfg: RunConfig, progress: PhaseProgress | None = None, cancel: CancelToken | None = None,
               train_curve: bool = True, attribution: bool | None = None) -> dict:
    """Lift model A into model B's shape, align B onto lifted A with cfg.method, interpolate in B's width;
    the result record of run_pair plus `lift`: the widths, maps and scales of the lift and its check.

    The lift check (lift.loss_a against lift.loss_a_lifted, the path's endpoint at lam = 0) must hold to
    the endpoint check's tolerance (ExactnessError otherwise), as must B's endpoint check; a naive record
    also walks the identity in the aligned runs' coordinates. `cfg.path` must be weights and offload is
    not offered.
    """
    from engine.align import method_options
    from engine.align.run import TOLERANCE, align, alignment_record, endpoint_check
    from engine.errors import ExactnessError
    from engine.resources import check_run
    from engine.widen import lift_info, widen_models

    method_options(cfg.method, cfg.options)
    if cfg.path != "weights":
        raise LMCError("A width-heterogeneous run interpolates the weights; the circuit path is not offered for it.")
    device = resolve_device(cfg.device)
    check_widen(cfg.model_a, cfg.model_b)  # one sentence, before any weight is loaded
    check_run(replace(cfg, model_a=cfg.model_b, device=device))  # lifted A has B's shape: memory as for B with B
    phases = Phases(progress)
    t0 = time.perf_counter()
    a, b, tick = load_both(cfg, device, phases, cancel, units=3)
    lifted, b = widen_models(a, b)
    tick(3, 3, f"{a.name} lifted to D = {lifted.arch.d_model}")
    es = eval_set_for(b, cfg.eval_split, cfg.eval_items)
    train_es = train_eval_set_for(b, es) if train_curve else None
    t_load = time.perf_counter() - t0
    cfg = final_config(replace(cfg, device=device), lifted.arch)
    t1 = time.perf_counter()
    n_measure = 1 if cfg.method == "naive" else 2
    measure = phases.phase("measure B", n_measure)
    own_a = evaluate(a, es, cancel=cancel)  # A in its own width: the lift must reproduce it
    measure(1, n_measure, f"model A: loss {own_a['loss']:.4f}")
    loss_b = None
    if cfg.method != "naive":  # B is moved in place below
        loss_b = evaluate(b, es, cancel=cancel)["loss"]
        measure(2, 2, f"model B: loss {loss_b:.4f}")
    t_check = time.perf_counter() - t1
    arch_a = a.arch
    del a
    al = align(lifted, b, cfg.method, cfg.classes, cfg.steps, cfg.seed, in_place=True, progress=phases.phase("align"),
               cancel=cancel, **cfg.options.align_kwargs())
    n_paths = naive_paths(b.arch) if cfg.method == "naive" else 1
    tick = phases.phase("interpolate", n_paths * cfg.points)
    path = interpolate(al.model_a, al.model_b, es, cfg.points, progress=relabel(tick, total=n_paths * cfg.points),
                       cancel=cancel, train_es=train_es)
    t1 = time.perf_counter()
    check = endpoint_check(b, al, es, path["endpoint_loss_b"], loss_b)
    tol = TOLERANCE.get(next(b.module.parameters()).dtype, 1e-4)
    lifted_loss = path["endpoint_loss_a"]
    rel = abs(lifted_loss - own_a["loss"]) / max(abs(own_a["loss"]), 1e-30)
    lift = lift_info(arch_a, b.arch) | {
        "loss_a": own_a["loss"], "loss_a_lifted": lifted_loss, "abs_diff": abs(lifted_loss - own_a["loss"]),
        "rel_diff": rel, "tolerance": tol, "exact": rel <= tol}
    if own_a["accuracy"] is not None:
        lift |= {"accuracy_a": own_a["accuracy"], "accuracy_a_lifted": path["accuracy"][0]}
    if rel > tol:
        raise ExactnessError(f"Lifting {cfg.model_a} into {cfg.model_b}'s shape changed its loss from "
                             f"{own_a['loss']:.6g} to {lifted_loss:.6g} (relative {rel:.1e} > {tol:.0e}): the lift "
                             "is not exact.")
    timings = {"load": t_load, "align": al.seconds, "endpoint_check": t_check + time.perf_counter() - t1}
    alignment = alignment_record(al)
    extra: dict = {"classes": sorted(al.classes), "classes_left_out": al.left_out, "lift": lift}
    add_attribution(attribution, al, es, path, cfg.points, extra, timings, phases, cancel)
    if cfg.method == "naive":  # the identity walked in the aligned runs' coordinates (norms folded)
        t1 = time.perf_counter()
        extra |= naive_in_aligned_coordinates(al.model_a, al.model_b, es, cfg.points, path, cancel=cancel,
                                              progress=relabel(tick, "aligned coordinates, ", cfg.points,
                                                               n_paths * cfg.points))
        timings["interpolate_aligned_coordinates"] = time.perf_counter() - t1
    return make_record(cfg, path, timings, arch=b.arch.to_dict(), alignment=alignment, endpoint_check=check, **extra)


# More than two models (engine.multi, docs/MATH.md section 10): N models of one architecture in one basis,
# to model 0 or to their barycentre, the pairwise barrier matrices before and after, and the triangle of
# three.

MULTI_EVAL_ITEMS = 8_192  # tokens (or every test image) per evaluation: each model, 3 per pair, 22 on the triangle


def multi_models(names: list[str], to: str = "reference", eval_items: int | None = MULTI_EVAL_ITEMS, split: str = "test",
                 points: int | None = None, per_edge: int | None = None, dtype: str = "float32", device: str = "cpu",
                 stage: Callable[[str, int, int, str], None] | None = None,
                 cancel: CancelToken | None = None) -> dict:
    """Load N zoo models or model directories and put them in one basis `to` (engine.multi.run): the record.

    Refused from the configs, before any weight is loaded: fewer than three models, a model that cannot be
    read (model_info, as "Model 2 ..."), two kinds or shapes. `stage` hears (stage, done, total, message)
    of every model loaded, matched and evaluated; `cancel` stops the run within one of them."""
    from engine import multi

    if len(names) < multi.MIN_MODELS:
        raise LMCError(f"Aligning models into one basis takes at least {multi.MIN_MODELS} models, not "
                       f"{len(names)}; for two, align the pair.")
    if to not in multi.TOS:
        raise LMCError(f"A shared basis is {' or '.join(multi.TOS)}, not {to!r}.")
    infos = [model_info(n, f"Model {i + 1}") for i, n in enumerate(names)]
    multi.mismatch([i.arch for i in infos], [i.label for i in infos], [display_name(n) for n in names])
    device = resolve_device(device)
    models = []
    for i, n in enumerate(names):
        check_cancel(cancel, f"loading, model {i + 1}/{len(names)}")
        models.append(load_named(n, dtype, device))
        if stage:
            stage("load", i + 1, len(names), models[-1].name)
    es = eval_set_for(models[0], split, eval_items)
    body = multi.run(models, to, es, points or multi.POINTS, per_edge or multi.PER_EDGE, stage=stage, cancel=cancel)
    return multi.make_record(body, device, dtype)
