"""Where the barrier lives: the midpoint barrier of an aligned pair attributed to layers and to classes
(docs/MATH.md section 5, its paragraph on barrier attribution).

Blocks. For a set S of parameters (the embeddings, one layer, its attention or its MLP, the final norm
and head), interpolate S alone and hold everything else at an endpoint:

    e_A(S) = L(theta_A with S at the midpoint) - L(theta_A),   e_B(S) = L(theta_B' with S at the midpoint) - L(theta_B'),
    e(S) = (e_A(S) + e_B(S)) / 2,

where the midpoint is (theta_A + theta_B') / 2 and theta_B' = g.theta_B, the path's own endpoints. When
only S differs between the endpoints, the model "A with S at the midpoint" IS the path's midpoint,
so e(S) equals the midpoint barrier exactly: a pair misaligned in one layer puts its whole barrier on
that layer (tests/engine/test_attribution.py). In general the blocks interact; the record keeps the
sum of the layer terms beside the barrier so that the interaction can be read off.

Classes. For each symmetry class c the run used, the class is dropped from the element, g_c =
restrict(g, classes - {c}) (B then keeps its own coordinates for c), and the midpoint barrier of
theta_A and g_c.theta_B is measured; its rise over the full element's midpoint barrier is what that
class buys. g_c is still in the group, so B's endpoint loss is unchanged and the chord is the run's.

The evaluation set is the first ITEMS scored items of the run's own (`subset`: 16,384 tokens, or
512 images, at most), named in the attribution's eval_set, whose own midpoint barrier it records
beside the terms. Cost: the midpoint, 2 evaluations per block (3 blocks per layer, plus embeddings
and head) and one per class, each on at most ITEMS items.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

from engine.cancel import CancelToken, check
from engine.evaluate import EvalSet, evaluate
from engine.models import Model

ITEMS = {"lm": 16_384, "vit": 512}  # scored items the attribution evaluates at most
LAYER = re.compile(r"(?:^|\.)(\d+)\.")  # the first integer component of a state-dict key: its layer
MLP = re.compile(r"mlp|ffn|feed_forward|norm2|ln_2|post_attention_layernorm")  # the MLP half (else attention)
HEAD = re.compile(r"head|embed_out|norm_f|ln_f|final|fc_norm|^norm\.")  # after the layers
EMBEDDING = re.compile(r"embed|wte|wpe|pos|cls|patch|tok")  # before the layers: the stream's first writers


def items(task: str, eval_size: int) -> int:
    """Scored items each attribution evaluation holds, for a run evaluated on `eval_size` items."""
    return min(eval_size, ITEMS[task])


def subset(es: EvalSet) -> EvalSet:
    """The first ITEMS[task] scored items of `es` (whole LM windows, at least one), or `es` itself."""
    cap = ITEMS[es.task]
    if es.size <= cap:
        return es
    per = es.targets[0].numel()  # scored items per row: a window's tokens, or 1 image
    n = max(1, cap // per)
    unit = "tokens" if es.task == "lm" else "images"
    return EvalSet(es.task, es.inputs[:n], es.targets[:n], f"{es.description}; its first {n * per:,} {unit}")


FREE_FLOP = 1e13  # an attribution this cheap always runs: about a minute of evaluation on two CPU cores
PATH_SHARE = 2  # ... and so does one scoring at most this many times the items of the path's own evaluations


def skipped(method: str, arch: dict, eval_size: int, points: int) -> str | None:
    """Why a run left at its default skips the attribution, or None to run it. It runs when it costs at most
    FREE_FLOP or its evaluations (engine.timing.attribution_evaluations, at most `items` each) score at most
    PATH_SHARE times the items of the path's own (`points` of `eval_size`): a zoo pair's always do (a zoo
    LM's cost 0.4 of its default path, GPT-2-small's 1.0); a 1.1B Llama's on a 3-point path of 1,024 tokens
    would cost 48 times the path."""
    from engine.timing import attribution_evaluations, forward_flops

    task = arch.get("task", "lm")
    n, each = attribution_evaluations(method, arch), items(task, eval_size)
    flop = (forward_flops(arch) or float("inf")) * n * each
    share = n * each / (points * eval_size)
    if flop <= FREE_FLOP or share <= PATH_SHARE:
        return None
    unit = "tokens" if task == "lm" else "images"
    return (f"Barrier attribution skipped: its {n} evaluations of {each:,} {unit} would score {share:.{share < 10:d}f} "
            f"times the {points}-point path's {points * eval_size:,} (by default it runs when it costs at most "
            f"{PATH_SHARE} times the path's own evaluations, or about a minute).")


def block_of(key: str) -> tuple[str, int | None, str]:
    """(block, layer, part) of a native state-dict key: ("layer 3", 3, "attention"), ("embedding", None,
    "all"), ("head", None, "all"). Works on every family's names (blocks.3., transformer.h.3., model.layers.3.)."""
    m = LAYER.search(key)
    if m is not None:
        layer = int(m.group(1))
        return f"layer {layer}", layer, "mlp" if MLP.search(key[m.end():]) else "attention"
    if HEAD.search(key) or not EMBEDDING.search(key):
        return "head", None, "all"
    return "embedding", None, "all"


def blocks(keys: list[str]) -> list[tuple[str, int | None, str, list[str]]]:
    """The parameter sets attributed: embedding, each layer (whole, attention, MLP), head; in path order."""
    by: dict[tuple[str, int | None, str], list[str]] = {}
    for k in keys:
        name, layer, part = block_of(k)
        by.setdefault((name, layer, part), []).append(k)
        if layer is not None:
            by.setdefault((name, layer, "all"), []).append(k)
    order = {"embedding": -1, "head": 10**9}

    def rank(b: tuple[str, int | None, str]) -> tuple:
        return (order.get(b[0], b[1]), ("all", "attention", "mlp").index(b[2]))

    return [(n, layer, part, by[(n, layer, part)]) for n, layer, part in sorted(by, key=rank)]


class _Mixer:
    """One work model set to an endpoint with some tensors at the midpoint, in place (no other copy)."""

    def __init__(self, a: Model, b: Model, work: Model):
        self.sa = {k: v.detach() for k, v in a.module.state_dict().items()}
        self.sb = {k: v.detach() for k, v in b.module.state_dict().items()}
        self.sw, seen = {}, set()
        for k, w in work.module.state_dict().items():  # a tied tensor once, under its first name (the embedding)
            if w.is_floating_point() and w.data_ptr() not in seen:
                seen.add(w.data_ptr())
                self.sw[k] = w
        self.work = work

    @torch.no_grad()
    def set(self, base: str, mid: set[str]) -> Model:
        src = self.sa if base == "a" else self.sb
        for k, w in self.sw.items():
            if k in mid:
                torch.lerp(self.sa[k].to(w.device), self.sb[k].to(w.device), 0.5, out=w)
            else:
                w.copy_(src[k])
        return self.work


@torch.no_grad()
def midpoint_moved(al, work: Model, h) -> None:
    """work <- (theta_A + h.theta_B') / 2 in the pair's coordinates, one parameter at a time (each acted
    on in float64 at least, like engine.align.run.move_in_place): no copy of B is made."""
    from engine.align.pair import write_params
    from engine.models import canonical
    from engine.symmetry import act, element_maps

    spec, pa = al.pair.spec, al.pair.params_a
    pb = al.pair.params_b if al.in_place else al.moved_params  # theta_B' = g.theta_B
    maps = element_maps(h)
    views = canonical(work, copy=False)

    def mixed():
        for key, v in views.items():
            x = pb[key].to(torch.promote_types(pb[key].dtype, torch.float64))
            moved = act(spec.params[key], maps, x) if key in spec.params else x
            yield key, torch.lerp(pa[key].to(moved.dtype), moved, 0.5).to(v.dtype)

    write_params(work, views, mixed())


def attribute(al, es: EvalSet, path: dict, cancel: CancelToken | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> dict:
    """The record's `attribution` for an aligned pair `al` (engine.align.run.Aligned) whose path `path`
    (engine.interpolate.interpolate's result) was walked on `es`. One work model of the pair's
    architecture is allocated; the endpoints are read, never written. Without a group element (naive)
    only the blocks are attributed."""
    from engine.align.run import restrict
    from engine.classes import RESIDUAL
    from engine.interpolate import _empty_copy
    from engine.symmetry import compose, invert

    t0 = time.perf_counter()
    a, b = al.model_a, al.model_b
    same = path.get("eval_set") == es.description  # the path's own set: its endpoint losses are known
    work = _empty_copy(a, next(a.module.parameters()).device)
    mix = _Mixer(a, b, work)
    everything = set(mix.sw)
    every = blocks(list(mix.sw))
    todo = [bl for bl in every if any(not torch.equal(mix.sa[k], mix.sb[k]) for k in bl[3])]
    kinds = sorted(al.classes) if al.method != "naive" else []
    groups = [c for c in kinds if c not in RESIDUAL] + (["residual"] if set(RESIDUAL) & set(kinds) else [])
    total, done = 2 * len(todo) + 1 + len(groups) + (0 if same else 2), 0

    def measure(model: Model, what: str) -> float:
        nonlocal done
        check(cancel, f"attribution, {what}")
        loss = evaluate(model, es, cancel=cancel)["loss"]
        done += 1
        if progress:
            progress(done, total, what)
        return loss

    if same:
        loss_a, loss_b = path["endpoint_loss_a"], path["endpoint_loss_b"]
    else:
        loss_a, loss_b = measure(mix.set("a", set()), "model A"), measure(mix.set("b", set()), "model B")
    midpoint_barrier = measure(mix.set("a", everything), "the midpoint") - 0.5 * (loss_a + loss_b)
    rows = {}
    for name, layer, part, keys in todo:
        label = name if part == "all" else f"{name} {part}"
        ea = measure(mix.set("a", set(keys)), f"{label}, from A") - loss_a
        eb = measure(mix.set("b", set(keys)), f"{label}, from B") - loss_b
        rows[(name, part)] = {"block": name, "layer": layer, "part": part, "excess_a": ea, "excess_b": eb,
                              "excess": 0.5 * (ea + eb)}
    zero = {"excess_a": 0.0, "excess_b": 0.0, "excess": 0.0}  # equal at both ends: nothing to attribute
    rows = [rows.get((n, p)) or {"block": n, "layer": layer, "part": p} | zero for n, layer, p, _ in every]
    classes = []
    if groups:
        g = al.out.g
        g_inv = invert(al.pair.arch, g)
        for c in groups:
            keep = frozenset(al.classes) - (set(RESIDUAL) if c == "residual" else {c})
            midpoint_moved(al, work, compose(al.pair.arch, restrict(g, keep), g_inv))  # theta_B' -> g_c.theta_B
            mb = measure(work, f"without {c}") - 0.5 * (loss_a + loss_b)
            classes.append({"class": c, "midpoint_barrier": mb, "rise": mb - midpoint_barrier})
    return {
        "lambda": 0.5,
        "endpoint_loss_a": loss_a,
        "endpoint_loss_b": loss_b,
        "midpoint_barrier": midpoint_barrier,
        "blocks": rows,
        "sum_of_layers": sum(r["excess"] for r in rows if r["part"] == "all"),
        "classes": classes,
        "eval_set": es.description,
        "seconds": time.perf_counter() - t0,
    }
