"""Shared palette and labels: one colour per method, group part, check status and positional encoding,
the same in every chart of the app."""

from __future__ import annotations

import zlib

# One colour per alignment method, the same in every chart of the app (Vega's Tableau-10 order),
# so a method is recognisable across pages without reading the legend.
METHOD_COLOURS = {
    "naive": "#4C78A8",
    "weight": "#F58518",
    "activation": "#54A24B",
    "learned": "#E45756",
    "dual": "#B279A2",
}
_SPARE = ("#72B7B2", "#EECA3B", "#9D755D", "#FF9DA6", "#BAB0AC")


# And one dash pattern per method, so curves stay apart without colour (print, colour blindness):
# learned and dual, close in value, are a dotted and a dash-dot-dot line. The thin chord is dashed.
METHOD_DASHES = {
    "naive": "solid",
    "weight": "dashdot",
    "activation": "longdash",
    "learned": "dot",
    "dual": "12px,3px,3px,3px,3px,3px",
}
_SPARE_DASHES = ("longdashdot", "8px,4px", "2px,6px")
CHORD_DASH = "dash"
# A record's train curve (the same points on the train split) is a thin fine-dotted line in its
# method's colour: a pattern no method's test line and no chord uses.
TRAIN_DASH = "1px,3px"


def method_dash(method: str) -> str:
    """Fixed dash pattern for a method; unknown ones get a stable spare."""
    return METHOD_DASHES.get(method) or _SPARE_DASHES[zlib.crc32(method.encode()) % len(_SPARE_DASHES)]


def method_colour(method: str) -> str:
    """Fixed colour for a method; unknown ones get a stable spare (crc32, since hash() is salted per process)."""
    return METHOD_COLOURS.get(method) or _SPARE[zlib.crc32(method.encode()) % len(_SPARE)]


def loss_unit(record: dict) -> str:
    """Loss is a mean cross-entropy per scored item: per image for ViTs, per byte for byte-level LMs."""
    if "eval_images" in record:
        return "nats/image"
    return "nats/byte" if "(bytes)" in record.get("eval_set", "") else "nats/token"



BEFORE_COLOUR = "#BAB0AC"  # "before alignment" is neutral grey; "after" is the method's own colour
# KV groups (and query heads) are told apart by a qualitative palette, the same in every chart.
GROUP_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
                 "#9D755D")
CHECK_COLOURS = {"exact": "#54A24B", "approximate": "#EECA3B", "break": "#E45756"}
# Row backgrounds for a measured change: light versions of CHECK_COLOURS; grey when nothing was measured.
CHECK_TINTS = {"exact": "#DCEFD8", "approximate": "#FBF0C7", "break": "#F7D4D4", None: "#EEEEEE"}
CHECK_LABELS = {"exact": "symmetry (exact)", "approximate": "symmetry (approximate)", "break": "break test"}
# Group-dimension components: one colour per part of the group, on every symmetry chart.
PART_COLOURS = {
    "qk": "#4C78A8", "vo": "#72B7B2", "key_bias": "#9D755D", "value_bias": "#D6A5C9", "mlp": "#54A24B",
    "mlp_scale": "#54A24B", "residual_orth": "#B279A2", "pe_shift": "#EECA3B", "ln_reader_gauge": "#FF9DA6",
}
PART_LABELS = {
    "qk": "Q/K maps", "vo": "V/O maps", "key_bias": "key-bias shift", "value_bias": "value-bias fold",
    "mlp": "MLP scaling", "mlp_scale": "MLP scaling", "residual_orth": "residual rotation",
    "pe_shift": "embedding / PE shift", "ln_reader_gauge": "LayerNorm reader gauge",
}
# The symmetry classes (engine/spec.py, KINDS) in the reader's words: PART_LABELS where a class and a part of
# the group dimension are the same thing; there "mlp" is the continuous MLP scaling, here the neuron permutation.
CLASS_LABELS = {
    "heads": "head permutations", "mlp": "MLP neuron permutations", "mlp_scale": PART_LABELS["mlp_scale"],
    "qk": PART_LABELS["qk"], "vo": PART_LABELS["vo"], "residual_perm": "residual permutation",
    "residual_orth": PART_LABELS["residual_orth"],
}
# rope_qk_norm: RoPE with QK-norm, a case of the Symmetry page's comparison (engine.api.dims_by_pe), not an Arch.pe
PE_COLOURS = {"none": "#BAB0AC", "learned": "#4C78A8", "sinusoidal": "#F58518", "rope": "#E45756",
              "rope_qk_norm": "#9D2B2B"}
PE_NAMES = {"none": "NoPE", "learned": "learned PE", "sinusoidal": "sinusoidal PE", "rope": "RoPE",
            "rope_qk_norm": "RoPE + QK-norm"}
REL_CHANGE_AXIS = "Largest relative logit change ‖f(g·θ) − f(θ)‖ / ‖f(θ)‖"
LOG_FLOOR = 1e-18  # a change of exactly 0 is drawn here on log axes (the hover gives the true value)


def group_colour(i: int) -> str:
    return GROUP_COLOURS[i % len(GROUP_COLOURS)]


def ramp(colour: str, base: str = "#FFFFFF") -> list[list]:
    """Base-to-colour scale: matrices of an alignment are drawn in the method's own colour."""
    return [[0.0, base], [1.0, colour]]


CELL_BASE = "#EEEEEE"  # empty cells of a small 0/1 matrix: light grey, split by white gaps, so the grid reads



def compact(v: float) -> str:
    """4,096 stays exact; 8,386,560 -> '8.39M': bar labels that fit beside each other."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e4, "k")):
        if abs(v) >= div:
            return f"{v / (div if suffix != 'k' else 1e3):.3g}{suffix}"
    return f"{v:,}"

