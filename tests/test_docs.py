"""References from the code to the project's documents: every `docs/MATH.md section N` (or `§N`), every
`docs/DESIGN.md section N` names a file that exists and a numbered heading it has, every
`bench/RESULTS.md, "Title"` a heading of the benchmark results, and every other `*.md`
the code mentions exists in the repository. Paths are relative to the repository root, or to the
referring file's folder (a document in docs/ may say SCALE.md); a bare MATH.md in the code points
outside the repository. And the documents' code names: a `module.function` whose function is defined in
engine/ or app/ names a module that has it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("engine", "app", "tests", "bench") for p in sorted((ROOT / d).rglob("*.py"))
           if p != Path(__file__).resolve()]  # this file's examples are wrong on purpose
SOURCES += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONED = ("MATH", "DESIGN")

NUM = r"\d+(?:\.\d+)?"
REF = re.compile(rf"(?P<path>(?:docs/)?(?P<doc>MATH|DESIGN)\.md)"
                 rf"(?:\s*,?\s*(?P<notation>notation)(?:\s+and)?)?"
                 rf"(?:\s*,?\s*(?:sections?\s+|§\s*)(?P<nums>{NUM}(?:\s*(?:-|,|and)\s*{NUM})*))?"
                 rf"(?:\s*,\s*\"(?P<title>[^\"]+)\")?")
# a named section of the benchmark results: bench/RESULTS.md, "Title" (the title may wrap across lines)
RESULT = re.compile(r'(?P<path>bench/RESULTS\.md),\s*"(?P<title>[^"]+)"')
MD = re.compile(r"(?<![\w{}./-])[\w./-]*[\w-]\.md\b")  # not a generated name (f"{stem}__x.md")


def headings(doc: Path) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,4}\s+(.+)$", doc.read_text(), re.MULTILINE)]


def title_of(quoted: str) -> str:
    """A quoted section title as one line: it may wrap across lines, inside a code comment too."""
    return " ".join(re.sub(r"\n\s*#", " ", quoted).split())


def has_heading(doc: Path, quoted: str) -> bool:
    title = title_of(quoted).lower()
    return any(title in h.lower() for h in headings(doc))


def numbers(spec: str) -> list[str]:
    """'1-3, 6' -> ['1', '2', '3', '6']; '4.5' -> ['4.5']."""
    out: list[str] = []
    for part in re.split(r"\s*(?:,|and)\s*", spec.strip()):
        lo, _, hi = part.partition("-")
        if hi and "." not in lo + hi:
            out += [str(i) for i in range(int(lo), int(hi) + 1)]
        else:
            out += [p.strip() for p in (lo, hi) if p.strip()]
    return out


def resolve(name: str, here: Path, root: Path = ROOT) -> Path | None:
    """The document `name` names, from the repository root or from the folder `here`; None if neither."""
    return next((p for p in (root / name, here / name) if p.is_file()), None)


def problems(text: str, where: str, here: Path = ROOT) -> list[str]:
    """Every reference in `text` (a file in folder `here`) that names no existing document or section."""
    bad = []
    for m in REF.finditer(text):
        doc = resolve(m.group("path"), here)
        if doc is None and not m.group("path").startswith("docs/"):
            bad.append(f"{where}: {m.group(0)!r} does not say docs/, so it names a file outside the repository")
            continue
        if doc is None:
            bad.append(f"{where}: {m.group('path')} does not exist")
            continue
        heads = headings(doc)
        if m.group("notation") and not any(h.lower().startswith("notation") for h in heads):
            bad.append(f"{where}: {m.group('path')} has no Notation heading")
        for n in numbers(m.group("nums") or ""):
            if not any(re.match(rf"{re.escape(n)}[.\s]", h) for h in heads):
                bad.append(f"{where}: {m.group('path')} has no section {n}")
        if m.group("title") and not has_heading(doc, m.group("title")):
            bad.append(f"{where}: {m.group('path')} has no heading {title_of(m.group('title'))!r}")
    for m in RESULT.finditer(text):
        doc = resolve(m.group("path"), here)
        if doc is not None and not has_heading(doc, m.group("title")):
            bad.append(f"{where}: {m.group('path')} has no heading {title_of(m.group('title'))!r}")
    for m in MD.finditer(text):
        name = m.group(0)
        if resolve(name, here) is None and not REF.fullmatch(name):  # REF's own misses are reported above
            bad.append(f"{where}: {name} does not exist")
    return bad


# a dotted code name in backticks: `classes.choose_classes`, `engine.api.run_pair()`
CODE = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
OUTSIDE = {"st", "torch", "np", "F", "nn"}  # libraries the documents name by their usual short name


def code_index(root: Path = ROOT) -> tuple[dict[str, list[str]], set[str]]:
    """Every engine / app module under each of its dotted names (engine.align.pair, align.pair, pair) with
    its sources, and every top-level function or class name defined in them."""
    mods: dict[str, list[str]] = {}
    defs: set[str] = set()
    for p in sorted((root / "engine").rglob("*.py")) + sorted((root / "app").rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        src = p.read_text(encoding="utf-8")
        for i in range(len(parts)):
            mods.setdefault(".".join(parts[i:]), []).append(src)
        defs |= set(re.findall(r"^(?:def|class)\s+(\w+)", src, re.MULTILINE))
    return mods, defs


def code_problems(text: str, where: str, index=None) -> list[str]:
    """Every `prefix.name` in `text` where `name` is an engine / app function or class but `prefix` is no
    module that defines or imports it (a module renamed or a function moved since the text was written).
    A class's attribute (`Arch.mismatch`) and a module named whole (`engine.interpolate`) are not checked."""
    mods, defs = index or code_index()
    bad = []
    for m in CODE.finditer(text):
        parts = m.group(1).split(".")
        prefix, name = ".".join(parts[:-1]), parts[-1]
        if name not in defs or m.group(1) in mods or parts[0] in OUTSIDE or parts[-2][:1].isupper():
            continue
        if prefix not in mods or not any(re.search(rf"\b{name}\b", s) for s in mods[prefix]):
            bad.append(f"{where}: `{m.group(1)}`: {prefix} is no module of engine/ or app/ that has {name}")
    return bad


def test_every_code_name_in_the_documents_names_a_module_that_has_it():
    index = code_index()
    bad = [b for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
           for b in code_problems(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)), index)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("text", "expected"), [
    ("`classes.choose_classes`", 0),
    ("`engine.classes.choose_classes()`", 0),
    ("`common.choose_classes`", 1),  # no module common
    ("`history.choose_classes`", 1),  # a module, but not one that has it
    ("`engine.interpolate`", 0),  # a module named whole
    ("`Arch.mismatch`, `st.error`, `torch.lerp`", 0),  # a class's attribute, libraries
])
def test_the_code_name_checker_catches_what_it_should(text, expected):
    assert len(code_problems(text, "example")) == expected, code_problems(text, "example")


def test_every_document_reference_names_an_existing_file_and_section():
    found = {doc: 0 for doc in SECTIONED}
    bad = []
    for p in SOURCES:
        text = p.read_text(encoding="utf-8")
        for m in REF.finditer(text):
            found[m.group("doc")] += 1
        bad += problems(text, str(p.relative_to(ROOT)), p.parent)
    assert all(found.values()), found  # the code does point at both documents
    assert not bad, "\n".join(bad)


def test_the_merged_notes_are_gone_and_nothing_points_at_them():
    assert not (ROOT / "docs" / "MATH_NOTES.md").exists()
    assert not [p for p in SOURCES if "MATH_NOTES" in p.read_text(encoding="utf-8")]


@pytest.mark.parametrize(("text", "expected"), [
    ("see docs/MATH.md section 4.2", 0),
    ("see docs/MATH.md sections 1-3, 6 and 7", 0),
    ('docs/MATH.md section 4.1, "Within head"', 1),  # no heading of that name
    ("docs/MATH.md section 99", 1),
    ("docs/MATH.md sections 98-99", 2),  # neither exists
    ("docs/DESIGN.md §3", 0),
    ("(MATH.md section 1)", 1),  # bare: outside the repository
    ("docs/NOWHERE.md", 1),
    ("docs/MATH.md, notation", 0),
    ('f"{stem}__report.md"', 0),  # a file name the code generates, not a reference
    ('bench/RESULTS.md, "The ViT anomalies"', 0),
    ('bench/RESULTS.md, "The ViT\n   anomalies"', 0),  # wrapped
    ('# bench/RESULTS.md, "The ViT\n# anomalies"', 0),  # wrapped in a comment
    ('bench/RESULTS.md, "A section nobody wrote"', 1),
])
def test_the_checker_catches_what_it_should(text, expected):
    assert len(problems(text, "example")) == expected, problems(text, "example")
