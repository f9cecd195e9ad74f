"""A method's run options: typed, validated when made, recorded as text.

Each aligner's registry entry (engine.align.METHODS) names its options type: a frozen dataclass whose
fields are None until set (None: the method's default), each declared with `option` (how it is given:
its kind, bounds or choices, the CLI flag, a label and a sentence of help). One validator, `Options`'s,
checks every field by that declaration, so a config built by the CLI from its flags, by the app from
its widgets (both generated from the declarations) or read back from a record obeys the same rules.

A RunConfig records its options as `extra`: the fields that are set, in declaration order, as
(name, text) pairs. Numbers of a real kind are kept as floats, so 600 and 600.0 seconds record and hash
alike, and a run that sets nothing records `[]` whatever its method.

This module imports nothing of the engine but its errors: engine.results holds an `Options` in every
RunConfig without depending on the aligners that define the subclasses (engine/align/options.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from engine.errors import LMCError

KINDS = {  # kind -> what a value must be, as the error sentence says it
    "seconds": "a positive number of seconds",
    "rate": "a finite number of at least 0",
    "fraction": "a number between 0 and 1",
    "count": "a whole number from 1 to {most:,}",
    "choice": "one of {choices}",
    "choice_or_file": "one of {choices}, or the path of a {suffix} file",
    "flag": "True or False",
}
REAL = ("seconds", "rate", "fraction")


@dataclass(frozen=True)
class Option:
    """How one option is given and checked."""

    kind: str  # a key of KINDS
    flag: str  # the CLI's flag
    label: str  # a few words for a widget
    help: str  # one sentence
    choices: tuple[str, ...] = ()  # kind "choice"
    most: int = 0  # kind "count": the largest value
    suffix: str = ""  # kind "choice_or_file": how a file's name ends (its content is the method's to check)

    def describe(self) -> str:
        return KINDS[self.kind].format(most=self.most, choices=", ".join(self.choices), suffix=self.suffix)

    def valid(self, v: object) -> bool:
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if self.kind == "seconds":
            return number and math.isfinite(v) and v > 0
        if self.kind == "rate":
            return number and math.isfinite(v) and v >= 0
        if self.kind == "fraction":
            return number and 0 < v < 1
        if self.kind == "count":
            return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= self.most
        if self.kind == "choice":
            return isinstance(v, str) and v in self.choices
        if self.kind == "choice_or_file":
            return isinstance(v, str) and (v in self.choices or (v.endswith(self.suffix) and len(v) > len(self.suffix)))
        return isinstance(v, bool)

    def parse(self, text: str) -> object:
        """The value a recorded text stands for (ValueError when it stands for none)."""
        if self.kind in REAL:
            return float(text)
        if self.kind == "count":
            return int(text)
        if self.kind == "flag":
            if text not in ("True", "False"):
                raise ValueError(text)
            return text == "True"
        return text


def option(kind: str, flag: str, label: str, help: str, choices: Iterable[str] = (), most: int = 0,
           suffix: str = ""):
    """A field of an options type: unset (None) by default, declared by its Option."""
    if kind not in KINDS:
        raise ValueError(f"option kind {kind!r} is not one of {', '.join(KINDS)}")
    return field(default=None, metadata={"option": Option(kind, flag, label, help, tuple(choices), most, suffix)})


@dataclass(frozen=True)
class Options:
    """The options of a method that takes none (naive, activation), and the base of every options type."""

    def __post_init__(self) -> None:
        for name, spec in self.specs().items():
            v = getattr(self, name)
            if v is None:
                continue
            if not spec.valid(v):
                raise LMCError(f"Option {name} ({spec.flag}) must be {spec.describe()}, not {v!r}.")
            if spec.kind in REAL:
                object.__setattr__(self, name, float(v))

    @classmethod
    def specs(cls) -> dict[str, Option]:
        """Every option of this type, in declaration order."""
        return {f.name: f.metadata["option"] for f in fields(cls)}

    def given(self) -> dict[str, object]:
        """The options that are set."""
        return {name: getattr(self, name) for name in self.specs() if getattr(self, name) is not None}

    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The options that are set as a record keeps them: RunConfig's `extra`."""
        return tuple((name, str(v)) for name, v in self.given().items())

    @classmethod
    def from_pairs(cls, pairs: Iterable[Iterable[str]]) -> Options:
        """The options a record's `extra` pairs stand for, validated."""
        specs, out = cls.specs(), {}
        for pair in pairs:
            name, text = pair
            if name not in specs:
                raise LMCError(f"Run option {name!r} is not known; the options are {', '.join(specs) or 'none'}.")
            try:
                out[name] = specs[name].parse(text)
            except ValueError:
                raise LMCError(f"Run option {name} is {text!r}; it must be {specs[name].describe()}.") from None
        return cls(**out)

    def align_kwargs(self) -> dict:
        """Keyword arguments of engine.align.run.align that carry these options."""
        return {}
