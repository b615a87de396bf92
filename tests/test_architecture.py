"""docs/ARCHITECTURE.md's import stack is the package's: every module of layerbraid/ sits in one
row, and every import (at the top of a file or inside a function) goes to a row below its own,
or within a package drawn as one entry.  The package's layout and its statements the same:
the runtime package does not import its tooling, and no module but launch changes process-wide
state (tests/test_process_hooks.py checks what it changes)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "layerbraid"
WIDTH = 46  # the names' column of the drawing


def _rows():
    """[set of entries] from the top row down; an entry is a module ("_engine/chain") or a
    package drawn whole ("accuracy/")."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("### The import stack", 1)[1].split("```", 2)[1]
    rows, pending = [], ""
    for line in block.strip("\n").splitlines():
        names = pending + line[:WIDTH].strip()
        if names.endswith(","):
            pending = names + " "
            continue
        pending = ""
        rows.append({n.strip() for n in names.split(",")})
    return rows


def _modules():
    """{dotted module name relative to layerbraid: path} of every module but the packages'
    __init__ files and the compiled core."""
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        if rel.name == "__init__":
            continue
        out["/".join(rel.parts)] = p
    return out


def _entry(module, rows):
    for k, row in enumerate(rows):
        for e in row:
            if e == module or (e.endswith("/") and module.startswith(e)):
                return k, e
    return None


def _imports(path):
    """The modules of layerbraid that ``path`` imports, anywhere in the file."""
    rel = path.relative_to(PKG).with_suffix("")
    package = list(rel.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = base + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == "layerbraid":
                mod = node.module.split(".")[1:]
            else:
                continue
            targets = [mod] + [mod + [a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names
                       if a.name.split(".")[0] == "layerbraid"]
        for t in targets:
            if (PKG.joinpath(*t).with_suffix(".py")).exists() and t:
                found.add("/".join(t))
    return found


def test_every_module_is_drawn_once():
    rows = _rows()
    assert len(rows) >= 15, rows  # the drawing was found
    missing = [m for m in _modules() if _entry(m, rows) is None]
    assert not missing, f"modules not in docs/ARCHITECTURE.md's import stack: {missing}"
    drawn = [e for row in rows for e in row]
    assert len(drawn) == len(set(drawn)), drawn


def test_every_import_goes_down_the_stack():
    rows = _rows()
    wrong = []
    for module, path in _modules().items():
        k, entry = _entry(module, rows)
        for target in _imports(path):
            kt, et = _entry(target, rows)
            same_package = entry.endswith("/") and et == entry
            if not (kt > k or same_package):
                wrong.append(f"{module} (row {k}) imports {target} (row {kt})")
    assert not wrong, "\n".join(wrong)


def test_the_runtime_package_does_not_import_its_tooling():
    for module, path in _modules().items():
        if not module.startswith("tools/"):
            assert not any(t.startswith("tools/") for t in _imports(path)), module


def test_only_launch_changes_process_wide_state():
    pattern = re.compile(r"(sys\.excepthook|threading\.excepthook|sys\.exit)\s*=|atexit\.register")
    for module, path in _modules().items():
        if module != "launch":
            assert not pattern.search(path.read_text()), module


def test_the_top_level_is_the_training_surface():
    """At most 15 top-level names, each of them real; the names that left it still resolve,
    with a DeprecationWarning naming where they live now."""
    import warnings

    import layerbraid

    assert len(layerbraid.__all__) <= 15, layerbraid.__all__
    for name in layerbraid.__all__:
        assert getattr(layerbraid, name) is not None, name
    for name, where in layerbraid._MOVED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(layerbraid, name)
        assert value is getattr(getattr(layerbraid, where), name)
        assert any(issubclass(w.category, DeprecationWarning) and f"layerbraid.{where}.{name}"
                   in str(w.message) for w in caught), name


def test_the_benchmarks_and_the_drill_use_public_names_only():
    """bench/ and the fault drill run layerbraid as a user would: no private module and no
    private name of one (what they need is public: layerbraid.plan.OPS, launch.world, ...)."""
    files = sorted((ROOT / "bench").rglob("*.py")) + [PKG / "tools" / "drill.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layerbraid"):
                parts = node.module.split(".") + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                parts = [p for a in node.names if a.name.startswith("layerbraid")
                         for p in a.name.split(".")]
            else:
                continue
            private = [p for p in parts if p.startswith("_")]
            assert not private, f"{path.relative_to(ROOT)}:{node.lineno} imports {private}"


def test_the_modules_that_moved_still_import_with_a_warning():
    import importlib
    import sys
    import warnings

    for old, new, name in (("layerbraid.mgopt", "layerbraid.depth.mgopt", "MGOpt"),
                           ("layerbraid.spline", "layerbraid.depth.spline", "SplineModule"),
                           ("layerbraid.audit", "layerbraid.accuracy", "audit_gradients")):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert getattr(module, name) is getattr(importlib.import_module(new), name)
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
                   for w in caught), old
