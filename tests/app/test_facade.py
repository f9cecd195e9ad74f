"""The app reaches the engine through one door, engine.api: no module under app/ imports another engine
module, and every name the app takes from engine.api is there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import engine.api

APP = Path(__file__).resolve().parents[2] / "app"
ALLOWED = {"engine", "engine.api"}


def engine_imports(source: str) -> set[str]:
    """Every engine module a source imports, anywhere in it (functions included): `import engine.x`,
    `from engine.x import y`, and `from engine import x` (x a module of the package)."""
    tree = ast.parse(source)
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names if a.name.split(".")[0] == "engine"}
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "engine":
            found.add(n.module)
            if n.module == "engine":
                found |= {f"engine.{a.name}" for a in n.names}
    return found


def import_lines(source: str) -> list[str]:
    """A plain text check beside the syntax tree: import lines and import_module calls naming an engine
    module other than engine.api."""
    lines = re.findall(r"^\s*(?:from|import)\s+engine[.\w]*.*$", source, re.MULTILINE)
    bad = [ln.strip() for ln in lines
           if not re.match(r"\s*(from engine\.api import |from engine import api\s*(#.*)?$|import engine\.api\b)", ln)]
    return bad + re.findall(r"import_module\(\s*['\"]engine\.(?!api['\"])[^'\"]*['\"]", source)


def app_files() -> list[Path]:
    files = sorted(APP.rglob("*.py"))
    assert {"streamlit_app.py", "live_run.py", "sidebar.py", "exports.py", "messages.py"} <= {f.name for f in files}
    assert {"connectivity.py", "runs.py", "alignment.py", "symmetry.py"} <= {f.name for f in files}
    return files


def test_no_app_module_imports_an_engine_module_other_than_the_api():
    for f in app_files():
        src = f.read_text()
        assert engine_imports(src) <= ALLOWED, (f.relative_to(APP), engine_imports(src) - ALLOWED)
        assert import_lines(src) == [], (f.relative_to(APP), import_lines(src))


def test_the_checks_catch_each_way_of_reaching_past_the_api():
    for src in ("from engine.history import scan_runs\n", "from engine import zoo\n", "import engine.errors\n",
                "def f():\n    from engine.align import METHODS\n", "from engine.api import x\nfrom engine import api, zoo\n"):
        assert engine_imports(src) - ALLOWED, src
    assert import_lines("def f():\n    from engine.align import METHODS\n") == ["from engine.align import METHODS"]
    assert import_lines("importlib.import_module('engine.history')\n")
    assert not import_lines("from engine import api\nfrom engine.api import LMCError, RunConfig\n")


def api_names(source: str) -> set[str]:
    """Names the source takes from engine.api: `api.<name>` attributes and `from engine.api import <name>`."""
    tree = ast.parse(source)
    names = {n.attr for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "api"}
    return names | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "engine.api"
                    for a in n.names}


def test_every_name_the_app_takes_from_the_api_is_there():
    used = set()
    for f in app_files():
        used |= api_names(f.read_text())
    assert {"run_pair", "RunConfig", "LMCError", "CancelToken", "Cancelled", "scan_runs", "delete_run",
            "method_names", "pairs", "ENTRIES"} <= used
    assert sorted(n for n in used if not hasattr(engine.api, n)) == []


def test_the_api_s_thin_functions_answer_like_the_engine():
    from engine.align import METHODS
    from engine.evaluate import lm_eval_set, vit_eval_set

    assert engine.api.method_names() == {k: m.display_name for k, m in METHODS.items()}
    assert next(iter(engine.api.method_names())) == "naive"
    assert engine.api.eval_size("lm", 32, 1000) == lm_eval_set("test", 1000, n_ctx=32).size == 992
    assert engine.api.eval_size("lm", 512, 1000) == 896  # context capped at 128: 7 windows
    assert engine.api.eval_size("vit", 65, 50) == vit_eval_set("test", 50).size == 50
