"""The engine's one door for the CLI, the app, the tests and the benchmarks: names, not code.

One run from a config to its record is engine.pipeline's (run_pair, widen_pair, plane_pair, multi_models,
the pair checked from the configs); the precomputed stores under cached_results/, their readers and cache
stamps are engine.builders'. This module re-exports both and, in one block, the few other engine names
the app uses as they are, and adds thin functions for what a page asks of the registries. Every module
under app/ imports engine.api and nothing else of the engine (tests/app/test_facade.py checks it), so an
engine module can change inside without the app noticing.
"""

from __future__ import annotations

# The engine's names the app and the CLI use as they are: configs and errors, the zoo, the exactness
# tolerance, the train curve's size (train_items) and the attribution's (attribution_items), the run
# history, the phases and time estimates of a run, the memory release, the zoo manifest.
from engine.attribution import items as attribution_items  # noqa: F401
from engine.attribution import skipped as attribution_skipped  # noqa: F401

# Runs and the stores (engine.pipeline, engine.builders).
from engine.builders import (  # noqa: F401
    ABLATION_POINTS,
    DEFAULT_EVAL_ITEMS,
    WIDEN_METHODS,
    ablation_dir,
    ablation_file,
    ablation_record,
    build_ablation,
    build_cache,
    build_multi,
    build_planes,
    build_symmetry,
    build_widen,
    built_zoo,
    has_precomputed_symmetry,
    multi_records,
    multi_stamp,
    pair_record,
    pair_records,
    plane_dir,
    plane_file,
    plane_record,
    record_stamp,
    runs_stamp,
    store_stamp,
    symmetry_dir,
    symmetry_json,
    symmetry_markdown,
    symmetry_stamp,
    symmetry_view,
    widen_dir,
    widen_file,
    widen_pairs,
    widen_records,
    widen_stamp,
    zoo_stamp,
)
from engine.cancel import CancelToken  # noqa: F401
from engine.checks import EXACT_TOL  # noqa: F401
from engine.errors import Cancelled, LMCError  # noqa: F401
from engine.evaluate import train_items  # noqa: F401
from engine.history import (  # noqa: F401
    MAX_NOTE,
    delete_run,
    element_path,
    new_run_id,
    run_element,
    run_file,
    runs_dir,
    save_run,
    save_unfinished,
    scan_runs,
    set_note,
)
from engine.history import compare as compare_runs  # noqa: F401
from engine.history import finished as run_finished  # noqa: F401
from engine.history import summary as run_summary  # noqa: F401
from engine.memory import return_freed_memory  # noqa: F401
from engine.models.base import SCALED_MLPS, Arch  # noqa: F401
from engine.pipeline import (  # noqa: F401
    ModelInfo,
    check_alpha,
    check_pair,
    check_widen,
    describe_pair,
    family_label,
    final_config,
    load_named,
    merged_format,
    model_info,
    multi_models,
    plane_pair,
    run_config,
    run_pair,
    widen_pair,
)
from engine.progress import PHASES, Update, fmt_seconds, pace, relabel, remaining_seconds  # noqa: F401
from engine.results import RunConfig, cache_dir, resolve_device  # noqa: F401
from engine.timing import estimate_run, estimate_seconds, naive_paths, reference_gflops  # noqa: F401
from engine.zoo import ENTRIES, display_name, pairs, resolve  # noqa: F401
from engine.zoo import manifest as zoo_manifest  # noqa: F401

# ---------------------------------------------------------------------------------------------
# What a page asks of the registries


def rope_frequencies(arch: dict) -> list[float] | None:
    """omega_j of each RoPE frequency pair of a record's or report's architecture, its frequency scaling
    applied; None without RoPE."""
    from engine.models.reference import rope_frequencies as freqs

    if arch.get("pe") != "rope" or not arch.get("rotary_dim"):
        return None
    return freqs(arch["rotary_dim"], float(arch["rope_base"]), arch.get("rope_scaling") or "").tolist()


def class_names() -> tuple[str, ...]:
    """Every symmetry class an aligner can be restricted to."""
    from engine.classes import CLASSES

    return tuple(CLASSES)


def method_names() -> dict[str, str]:
    """Every alignment method in registry order (naive first), with the name a reader sees."""
    from engine.align import METHODS

    return {name: m.display_name for name, m in METHODS.items()}


def method_options(method: str, given: dict | None = None):
    """`method`'s run options with the values of `given` set (None: unset), validated (engine.options); an
    option the method does not take is an LMCError naming the methods that do."""
    from engine.align import method_options as options

    return options(method, given)


def option_specs(method: str) -> dict:
    """Every run option `method` takes, name -> engine.options.Option (kind, flag, label, help, choices,
    bounds), in declaration order: what a page draws a widget for."""
    from engine.align import method_entry

    return method_entry(method).options.specs()


def eval_size(task: str, n_ctx: int, eval_items: int | None, split: str = "test") -> int:
    """Scored tokens (LM: byte-level windows of the split, as a zoo run evaluates) or images (ViT) of a
    run asking for `eval_items` (None: the whole split), without loading a model."""
    from engine.evaluate import DEFAULT_LM_CTX, lm_eval_set, vit_eval_set

    if task == "vit":
        return vit_eval_set(split, eval_items).size
    return lm_eval_set(split, eval_items, n_ctx=min(n_ctx, DEFAULT_LM_CTX)).size
