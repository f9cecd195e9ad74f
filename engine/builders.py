"""The precomputed stores under cached_results/ and how the pages read them: result records of every zoo
pair x method (build_cache), the class ablation, the loss planes, the width-heterogeneous and multi-model
records, the Symmetry page's views; each with its directory, its reader and a stamp that changes when it
is rewritten (the app's cache keys). Every record comes from engine.pipeline; engine.api re-exports these
names."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from engine.errors import LMCError
from engine.history import runs_dir
from engine.models.base import Arch
from engine.models.io import check_output_dir
from engine.pipeline import (
    check_widen,
    final_config,
    model_info,
    multi_models,
    plane_pair,
    run_pair,
    widen_pair,
)
from engine.results import (
    MAX_RECORD_BYTES,
    RunConfig,
    StoreWarning,
    cache_dir,
    cache_file,
    cached_record,
    list_cached,
    store,
    write_manifest,
)
from engine.zoo import ENTRIES, display_name, pairs, resolve

# The default evaluation size of the CLI and of cached records: the first 65,536 tokens (512 windows
# of 128) of the 196,608-token LM test split, or all 360 digits test images. The barrier's standard
# error at this size is far below the differences between methods, and the whole LM split would
# triple the cost of every path (bench/RESULTS.md); `--eval-items all` scores the whole split.
DEFAULT_EVAL_ITEMS = 65_536

# The budget of the stored learned and dual records where it differs from the methods' interactive
# default (400 steps of 16 sequences for LMs): on the small LM tier, 6,400 steps of 16 sequences. With the
# LMs' MLP permutation kept (learned.DEFAULT_CANDIDATES) the validation barrier keeps falling to there (dual on
# lm-learned: 0.149 / 0.123 / 0.095 / 0.089 at 1,600 / 3,200 / 4,800 / 6,400 steps) and flattens over the last
# quarter, for 29-40 minutes of one core a record (bench/RESULTS.md, "To convergence on the small LM pair" and
# "The small LM pairs at 6,400 steps"). On the ViT pairs, 3,200 steps (four times the interactive 800): the best
# validation barrier fell at every pair from 800 to 1,600 steps (vit-rope 0.046 -> 0.034, vit-learned 0.020 ->
# 0.003, vit-sinusoidal 0.053 -> 0.032), and from 1,600 to 3,200 vit-sinusoidal's fell fourfold (0.032 -> 0.008)
# while vit-rope's held (0.034 -> 0.035), for two to ten minutes of
# one core (bench/RESULTS.md, "Converged ViT records"). On the medium LM tier, 3,200 steps of 16: at 1,600 every
# medium record was still lowering its validation barrier over its last fifth; at 3,200 five of six barriers fell
# (dual: 0.079 -> 0.051, 0.049 -> 0.032, 0.124 -> 0.103) and the learned-PE pair's validation barriers flattened
# over the last tenth, while the dropout pair's learned run reshuffled heads and kept an earlier step (0.053 ->
# 0.068). A step costs about 2 s of one core there: two hours a run (bench/RESULTS.md, "The medium records at
# 3,200 steps"). A record's config holds its steps and batch (None: the default batch).
CONVERGED = {("lm", "small"): (6400, None), ("vit", "small"): (3200, None), ("lm", "medium"): (3200, None)}


def cache_config(model_a: str, model_b: str, method: str, eval_items: int | None = DEFAULT_EVAL_ITEMS) -> RunConfig:
    """The config of a zoo pair x method's stored record: the method's defaults, or for learned and dual
    matching the tier's converged budget (CONVERGED)."""
    from engine.align import method_entry, method_options

    entry, e = method_entry(method), ENTRIES[model_a]
    budget = CONVERGED.get((e.task, e.tier)) if entry.default_steps else None
    if budget is None:
        return RunConfig(model_a, model_b, method, eval_items=eval_items)
    steps, batch = budget
    return RunConfig(model_a, model_b, method, steps=steps, eval_items=eval_items,
                     options=method_options(method, {"batch": batch}))  # a batch of None is the default


def is_current(record: dict, cfg: RunConfig | None = None) -> bool:
    """Whether a stored record is the one `cache build` would compute now: its config hash is that of `cfg`
    (by default the store's config of its pair and method, cache_config) completed as a run completes it."""
    cfg = cfg or cache_config(record["model_a"], record["model_b"], record["method"])
    return record["config_hash"] == final_config(cfg, ENTRIES[cfg.model_a].config().arch()).hash()


def build_cache(methods: list[str] | None = None, eval_items: int | None = DEFAULT_EVAL_ITEMS,
                only: list[tuple[str, str]] | None = None, force: bool = False,
                log: Callable[[str], None] | None = None) -> list[dict]:
    """Precompute a record for every same-architecture zoo pair x method into the store; resumable.

    Everything is validated before any work: the methods, the pairs (zoo pairs only) and the store
    directory. A stored record whose config hash matches the run's is kept as it is (a killed build resumes
    where it stopped; `force` recomputes everything); a broken one, or one of an older record schema,
    is recomputed. The manifest
    is rebuilt from the records present. Returns the records of every pair x method, kept or new.
    """
    from tqdm import tqdm

    from engine.align import METHODS, method_entry, resume

    methods = list(methods or METHODS)
    for m in methods:
        method_entry(m)
    zoo_pairs = pairs()
    todo_pairs = list(zoo_pairs if only is None else only)
    for p in todo_pairs:
        if tuple(p) not in zoo_pairs:
            raise LMCError(f"{p[0]} / {p[1]} is not a pair of the zoo (same task and positional encoding).")
    if not todo_pairs or not methods:
        raise LMCError("Nothing to build: no pair or no method selected.")
    root = cache_dir()
    check_output_dir(root, overwrite=True, name="Result store")  # a writable directory, or creatable
    out, todo = [], []
    for a, b in todo_pairs:
        for m in methods:
            cfg = cache_config(a, b, m, eval_items)
            old = cached_record(a, b, m, root)
            if old is not None and is_current(old, cfg) and not force:
                out.append(old)
            else:
                todo.append(cfg)
    for cfg in todo:  # every model the work needs is built, before any of it starts
        resolve(cfg.model_a)
        resolve(cfg.model_b)
    write_manifest(root)  # reconcile with the records present (a build killed earlier)
    if log:
        log(f"cache: {len(out)} record(s) up to date, {len(todo)} to compute")
    for cfg in tqdm(todo, desc="cache", disable=not todo):
        # learned and dual optimisations keep a resumable state there: a killed build resumes mid-run
        ck = state_dir(cfg, root)
        rec = run_pair(cfg, one_sided=one_sided_run(cfg, root), checkpoint=ck)
        store(rec, root)
        resume.clear(ck)
        with contextlib.suppress(OSError):  # the states' folder too, once no other run's state is in it
            ck.parent.rmdir()
        out.append(rec)
    return out


def state_dir(cfg: RunConfig, root: Path) -> Path:
    """Where `cache build`'s run of `cfg` keeps its resumable optimisation state until its record is stored."""
    return root / ".states" / f"{cfg.model_a}__{cfg.model_b}__{cfg.method}"


def one_sided_run(cfg: RunConfig, root: Path | None = None) -> dict | None:
    """For a dual record: the stored one-sided learned record's diagnostics where that record ran the very
    optimisation dual's comparison runs (the same config but the method: start, data, seed, settings and
    step budget; no time budget, whose clock would make it another run), so the comparison is taken from it
    instead of being run again. None otherwise, or for any other method."""
    if cfg.method != "dual" or "time_budget_s" in cfg.options.given():
        return None
    rec = cached_record(cfg.model_a, cfg.model_b, "learned", root or cache_dir())
    return rec["alignment"]["diagnostics"] if rec is not None and is_current(rec, replace(cfg, method="learned")) else None


PLANE_METHOD = "weight"  # the store's planes: data-free, seconds per pair, the classic picture


def plane_dir(root: Path | None = None) -> Path:
    return Path(root or cache_dir()) / "plane"


def plane_file(model_a: str, model_b: str, method: str = PLANE_METHOD, root: Path | None = None) -> Path:
    return plane_dir(root) / f"{model_a}__{model_b}__{method}.json"


def plane_record(model_a: str, model_b: str, method: str = PLANE_METHOD, root: Path | None = None) -> dict | None:
    """The stored loss plane of a zoo pair and method, or None when it has not been built."""
    from engine.models.io import read_json_object

    f = plane_file(model_a, model_b, method, root)
    return read_json_object(f, max_bytes=MAX_RECORD_BYTES, kind="a loss plane") if f.is_file() else None


def build_planes(only: list[tuple[str, str]] | None = None, force: bool = False,
                 log: Callable[[str], None] | None = None) -> list[dict]:
    """The loss plane (weight matching, PLANE_EVAL_ITEMS, an 11 x 11 grid) of every zoo pair into the
    store's plane/ directory; a pair whose plane is there is kept unless `force`."""
    from engine.models.io import check_output_dir, write_json_atomic

    todo = list(only if only is not None else pairs())
    check_output_dir(plane_dir(), overwrite=True, name="Plane store")
    out = []
    for a, b in todo:
        old = None if force else plane_record(a, b)
        if old is not None:
            out.append(old)
            continue
        if log:
            log(f"plane: {a} / {b}")
        rec = plane_pair(a, b, PLANE_METHOD)
        f = plane_file(a, b)
        f.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(f, rec, allow_nan=False)
        out.append(rec)
    return out


# The width-heterogeneous records of the zoo (engine.pipeline.widen_pair) live under cached_results/widen/,
# apart from the same-width pairs.

WIDEN_METHODS = ("naive", "weight")  # the store's: the lifted A as it is, and weight matching (data-free, seconds)


def widen_dir(root: Path | None = None) -> Path:
    return Path(root or cache_dir()) / "widen"


def widen_file(model_a: str, model_b: str, method: str, root: Path | None = None) -> Path:
    """The stored record of a pair and method, named by the models' zoo (or directory) names."""
    return widen_dir(root) / f"{display_name(model_a)}__{display_name(model_b)}__{method}.json"


def widen_pairs() -> list[tuple[str, str]]:
    """The zoo's width-heterogeneous pairs: each wider model's seed-0 recipe with the zoo's own width's seed 0."""
    return [(n.replace(f"-w{e.width}", ""), n) for n, e in ENTRIES.items()
            if e.width is not None and e.seed == 0 and n.replace(f"-w{e.width}", "") in ENTRIES]


def widen_records(root: Path | None = None) -> tuple[list[dict], list[str]]:
    """Every usable stored width-heterogeneous record (sorted by pair, then naive before the aligners) and a
    sentence per file skipped as unusable."""
    from engine.align import METHODS
    from engine.results import load_record

    d = widen_dir(root)
    recs, skipped = [], []
    for f in sorted(d.glob("*__*__*.json")) if d.is_dir() else []:
        try:
            rec = load_record(f)
        except LMCError as e:
            skipped.append(str(e))
            continue
        if "lift" not in rec:
            skipped.append(f"Result file {f} is not a width-heterogeneous record (it has no lift).")
            continue
        recs.append(rec)
    order = {m: i for i, m in enumerate(METHODS)}
    recs.sort(key=lambda r: (r["model_a"], r["model_b"], order.get(r["method"], len(order)), r["method"]))
    return recs, skipped


def widen_stamp() -> int:
    """Changes when a stored width-heterogeneous record is written: a cache key for widen_records."""
    d = widen_dir()
    return hash(tuple((f.name, _mtime(f)) for f in sorted(d.glob("*.json")))) if d.is_dir() else 0


def build_widen(methods: tuple[str, ...] = WIDEN_METHODS, eval_items: int | None = DEFAULT_EVAL_ITEMS,
                force: bool = False, log: Callable[[str], None] | None = None) -> list[dict]:
    """The width-heterogeneous records of the zoo (widen_pairs x `methods`) into the store's widen/ directory;
    a record whose config hash is that of the run it would do is kept unless `force`."""
    from engine.models.io import check_output_dir
    from engine.results import load_record, write_record

    check_output_dir(widen_dir(), overwrite=True, name="Widen store")
    todo = widen_pairs()
    for a, b in todo:  # every model is built before any work starts
        resolve(a)
        resolve(b)
    out = []
    for a, b in todo:
        for m in methods:
            cfg = RunConfig(a, b, m, eval_items=eval_items)
            f = widen_file(a, b, m)
            old = None
            if f.is_file() and not force:
                try:
                    old = load_record(f)
                except LMCError:
                    old = None
            if old is not None and old["config_hash"] == final_config(cfg, check_widen(a, b)[0].arch).hash():
                out.append(old)
                continue
            if log:
                log(f"widen: {a} into {b}, {m}")
            rec = widen_pair(cfg)
            f.parent.mkdir(parents=True, exist_ok=True)
            write_record(rec, f)
            out.append(rec)
    return out


# The multi-model records (engine.pipeline.multi_models) live under cached_results/multi/.


def multi_records(root: Path | None = None) -> tuple[list[dict], list[str]]:
    """Every usable stored multi-model record and a sentence per file skipped (engine.multi.stored)."""
    from engine.multi import stored

    return stored(root)


def multi_stamp() -> int:
    """Changes when a stored multi-model record is written: a cache key for multi_records."""
    from engine.multi import store_stamp

    return store_stamp()


def build_multi(force: bool = False, log: Callable[[str], None] | None = None) -> list[dict]:
    """The store's multi-model records (engine.multi.SETS, to the reference and to the barycentre, on
    MULTI_EVAL_ITEMS) into cached_results/multi/; a usable record already there is kept unless `force`."""
    from engine import multi

    check_output_dir(multi.store_dir(), overwrite=True, name="Multi-model store")
    for names in multi.SETS:  # every model is built before any work starts
        for n in names:
            resolve(n)
    out = []
    for names in multi.SETS:
        for to in multi.TOS:
            f = multi.store_file(names, to)
            old = None
            if f.is_file() and not force:
                try:
                    old = multi.read_record(f)
                except LMCError:
                    old = None
            if old is not None:
                out.append(old)
                continue
            if log:
                log(f"multi: {', '.join(names)} to the {to}")
            rec = multi_models(list(names), to)
            multi.write_record(rec, f)
            out.append(rec)
    return out


# The class ablation: weight matching on every zoo pair with each symmetry class alone and all of
# them together, on a reduced evaluation (the first 8,192 tokens, or every test image, at 11 points)
# so the whole build fits in minutes; one small JSON per pair under cached_results/ablation/.
ABLATION_EVAL_ITEMS = 8_192
ABLATION_POINTS = 11
ABLATION_METHOD = "weight"
ABLATION_KEEP = ("lambdas", "loss", "accuracy", "barrier", "midpoint_barrier", "accuracy_drop", "eval_set",
                 "config_hash")


def ablation_dir(root: Path | None = None) -> Path:
    return Path(root or cache_dir()) / "ablation"


def ablation_file(model_a: str, model_b: str, root: Path | None = None) -> Path:
    return ablation_dir(root) / f"{model_a}__{model_b}.json"


def ablation_record(model_a: str, model_b: str, root: Path | None = None) -> dict | None:
    """The stored ablation of a zoo pair, or None when it has not been built."""
    from engine.models.io import read_json_object

    f = ablation_file(model_a, model_b, root)
    return read_json_object(f, max_bytes=MAX_RECORD_BYTES, allow_nan=True, kind="a class ablation") if f.is_file() else None


def _ablation_row(label: str, classes: list[str], rec: dict) -> dict:
    return {"label": label, "classes": classes, "method": rec["method"], **{k: rec.get(k) for k in ABLATION_KEEP},
            "align_seconds": rec["timings"]["align"]}


def build_ablation(only: list[tuple[str, str]] | None = None, force: bool = False,
                   log: Callable[[str], None] | None = None) -> list[dict]:
    """Weight matching restricted to each symmetry class alone, then all classes, beside naive, for every
    zoo pair (or `only` those); resumable run by run (a run whose config hash is stored is kept).

    The classes are those the full run used (the model's default set); each ablation is written after
    every run, so a killed build resumes where it stopped. Returns the ablations.
    """
    todo_pairs = list(pairs() if only is None else only)
    for p in todo_pairs:
        if tuple(p) not in pairs():
            raise LMCError(f"{p[0]} / {p[1]} is not a pair of the zoo (same task and positional encoding).")
    check_output_dir(ablation_dir(), overwrite=True, name="Ablation store")
    for a, b in todo_pairs:  # every model is built before any work starts
        resolve(a)
        resolve(b)
    return [_ablate_pair(a, b, force, log) for a, b in todo_pairs]


def _ablate_pair(a: str, b: str, force: bool, log: Callable[[str], None] | None) -> dict:
    from engine.models.io import write_json_atomic

    old = None if force else ablation_record(a, b)
    kept = {r["label"]: r for r in (old or {}).get("runs", [])}
    abl = {"schema": 1, "model_a": a, "model_b": b, "method": ABLATION_METHOD, "points": ABLATION_POINTS,
           "eval_items": ABLATION_EVAL_ITEMS, "runs": []}

    def run(label: str, method: str, classes: tuple[str, ...]) -> dict:
        cfg = RunConfig(a, b, method, classes=classes, points=ABLATION_POINTS, eval_items=ABLATION_EVAL_ITEMS)
        row = kept.get(label)
        if row is None or row["config_hash"] != final_config(cfg, ENTRIES[a].config().arch()).hash():
            if log:
                log(f"ablation {a} / {b}: {label}")
            rec = run_pair(cfg, train_curve=False)  # the ablation keeps test curves only
            row = _ablation_row(label, list(rec["alignment"]["classes"]) if method != "naive" else [], rec)
        abl["runs"].append(row)
        write_json_atomic(ablation_file(a, b), abl)  # after every run: a killed build resumes here
        return row

    run("none", "naive", ())
    for c in run("all", ABLATION_METHOD, ())["classes"]:
        run(c, ABLATION_METHOD, (c,))
    return abl



# The Symmetry page's data for one model, preset config or directory; the zoo's are precomputed by
# `cache build` into cached_results/symmetry/ so the page opens at once (recomputed when the weights change).
PE_CASES = ("none", "learned", "sinusoidal", "rope", "rope_qk_norm")  # dims_by_pe's keys


def dims_by_pe(arch: Arch) -> dict[str, dict]:
    """group_dimension of `arch`'s shape under each positional encoding (RoPE rotating whole heads), and under
    RoPE with QK-norm (`rope_qk_norm`: queries and keys normalised per head before RoPE, as in Qwen3)."""
    from engine.groups import group_dimension

    out = {}
    for case in PE_CASES:
        pe = case.removesuffix("_qk_norm")
        rope, qk_norm = pe == "rope", case == "rope_qk_norm"  # QK-norm is described with whole-head RoPE only
        out[case] = group_dimension(replace(
            arch, pe=pe, rotary_dim=(arch.d_head if qk_norm else arch.rotary_dim or arch.d_head) if rope else 0,
            rope_layout=(arch.rope_layout or "interleaved") if rope else None,
            rope_base=(arch.rope_base or 10000.0) if rope else arch.rope_base, qk_norm=qk_norm))
    return out


def symmetry_dir(root: Path | None = None) -> Path:
    return Path(root or cache_dir()) / "symmetry"


def _weights_sha256(name: str) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in sorted(ENTRIES[name].path.glob("*.safetensors")) + [ENTRIES[name].path / "config.json"]:
        h.update(f.read_bytes())
    return h.hexdigest()


def _precomputed_symmetry(name: str) -> dict | None:
    """The stored view of a zoo model, when it was computed from the weights now on disk."""
    from engine.models.io import read_json_object

    f = symmetry_dir() / f"{name}.json"
    if not f.is_file() or not (ENTRIES[name].path / "model.safetensors").is_file():
        return None
    try:
        view = read_json_object(f, max_bytes=MAX_RECORD_BYTES, allow_nan=True, kind="a symmetry view")
    except LMCError:
        return None  # unreadable: computed again
    return view if view.get("weights_sha256") == _weights_sha256(name) else None


def symmetry_stamp(name_or_path: str) -> int:
    """Changes when a model's weights or config do, or a zoo model's stored view (`cache build`): a cache key
    for symmetry_view and has_precomputed_symmetry, which read and hash the weights."""
    stored = symmetry_dir() / f"{name_or_path}.json" if name_or_path in ENTRIES else None
    return hash((zoo_stamp(name_or_path), _mtime(stored) if stored else 0))


def has_precomputed_symmetry(name: str) -> bool:
    """Whether `cache build` stored the view of zoo model `name` for the weights now on disk."""
    return name in ENTRIES and _precomputed_symmetry(name) is not None


def symmetry_view(target: str | dict, dims_only: bool = False, precomputed: bool = True) -> dict:
    """{"report": symmetry_report, "statement": plain_statement, "spectrum": the whole sinusoidal spectrum or
    None, "by_pe": dims_by_pe, "precomputed": bool} of a zoo name, a model directory or a config dict.

    A directory or zoo name is checked first (model_info: one sentence per problem, as on every page);
    a zoo model's stored view is used when its weights have not changed since (`precomputed`).
    """
    from engine.groups import sinusoidal_spectrum
    from engine.report import plain_statement, symmetry_report

    if isinstance(target, str):
        model_info(target)
        if precomputed and not dims_only and target in ENTRIES:
            view = _precomputed_symmetry(target)
            if view is not None:  # by_pe from the formulas, not the store: every case of PE_CASES
                return {k: v for k, v in view.items() if k != "weights_sha256"} | {
                    "by_pe": dims_by_pe(Arch(**view["report"]["arch"])), "precomputed": True}
    rep = symmetry_report(target, dims_only=dims_only)
    spectrum = None
    if rep.get("sinusoidal"):
        sp = rep["sinusoidal"]
        spectrum = sinusoidal_spectrum(sp["n_pos"], sp["d_model"], sp["rtol"])
    return {"report": rep, "statement": plain_statement(rep), "spectrum": spectrum, "by_pe": dims_by_pe(Arch(**rep["arch"])),
            "precomputed": False}


def build_symmetry(names: list[str] | None = None, force: bool = False,
                   log: Callable[[str], None] | None = None) -> list[str]:
    """Precompute the Symmetry page's view of every built zoo model (or `names`) into cached_results/symmetry/;
    a view whose weights are unchanged is kept unless `force`. Returns the names written or kept."""
    from engine.models.io import write_json_atomic

    todo = [n for n in (names or ENTRIES) if (ENTRIES[n].path / "model.safetensors").is_file()]
    check_output_dir(symmetry_dir(), overwrite=True, name="Symmetry store")
    for n in todo:
        if not force and _precomputed_symmetry(n) is not None:
            continue
        if log:
            log(f"symmetry: {n}")
        view = symmetry_view(n, precomputed=False)
        view.pop("precomputed")
        write_json_atomic(symmetry_dir() / f"{n}.json", view | {"weights_sha256": _weights_sha256(n)})
    return todo


def symmetry_json(report: dict) -> bytes:
    """A symmetry report as the JSON file the app and the CLI hand out."""
    import json

    return (json.dumps(report, indent=1) + "\n").encode()


def symmetry_markdown(report: dict, statement: str | None = None) -> bytes:
    """A symmetry report as Markdown: the plain statement, then the CLI's table."""
    from engine.report import format_report, plain_statement

    name = display_name(report["model"]) if report["model"] != "config" else "config"
    return (f"# Symmetry report: {name}\n\n{statement or plain_statement(report)}\n\n```\n"
            f"{format_report(report)}\n```\n").encode()


# ---------------------------------------------------------------------------------------------
# The store and the zoo, as the pages read them


def pair_records(model_a: str, model_b: str, root: str | Path | None = None) -> tuple[list[dict], list[str]]:
    """Every usable stored record of a pair (one per method, in store order) and a sentence per record
    skipped as unreadable or incomplete (the others are still returned)."""
    import warnings

    root = Path(root or cache_dir())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StoreWarning)
        rows = [r for r in list_cached(root) if (r["model_a"], r["model_b"]) == (model_a, model_b)]
        recs = [cached_record(model_a, model_b, r["method"], root) for r in rows]
    skipped = [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]
    return [r for r in recs if r], [s[:1].upper() + s[1:] for s in skipped]


def pair_record(model_a: str, model_b: str, method: str, root: str | Path | None = None) -> dict | None:
    """The stored record of one pair and method; None when there is none; an unusable one is an LMCError."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StoreWarning)
        rec = cached_record(model_a, model_b, method, Path(root or cache_dir()))
    skipped = [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]
    if skipped:
        raise LMCError(skipped[0][:1].upper() + skipped[0][1:])
    return rec


def _mtime(f: Path) -> int:
    return f.stat().st_mtime_ns if f.exists() else 0


def store_stamp() -> int:
    """Changes whenever the store's manifest is rewritten: a cache key for pair_records."""
    return _mtime(cache_dir() / "manifest.json")


def record_stamp(model_a: str, model_b: str, method: str) -> int:
    """Changes whenever one stored record is rewritten: a cache key for pair_record."""
    return _mtime(cache_file(model_a, model_b, method, cache_dir()))


def runs_stamp() -> int:
    """Changes whenever a run of the history is kept, rewritten or deleted: a cache key for scan_runs, which
    reads and checks every run's record."""
    import os

    d = runs_dir()
    if not d.is_dir():
        return 0
    with os.scandir(d) as entries:
        return hash(tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in entries)))


def built_zoo() -> list[str]:
    """The zoo models whose weights are on disk."""
    return [n for n, e in ENTRIES.items() if (e.path / "model.safetensors").is_file()]


def zoo_stamp(name_or_path: str) -> int:
    """Changes when a model's weights or config do: a cache key for anything computed from them."""
    path = ENTRIES[name_or_path].path if name_or_path in ENTRIES else Path(name_or_path)
    for f in (path / "model.safetensors", path / "config.json", path):
        if f.exists():
            return _mtime(f)
    return 0
