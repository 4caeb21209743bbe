"""The package's layering: imports point down (no two modules import each other, directly or through others),
and the library never imports the app."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pop_vlm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """Every module of the package, or `app...`, that `path` imports, at any depth of its code."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            # `from . import zoo` imports the module zoo, not the package's own __init__
            targets = [f"{root}.{alias.name}" for alias in node.names] + ([root] if node.module else [])
        else:
            continue
        for target in targets:
            while target and target not in modules and not target.startswith("app"):
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def test_the_library_never_imports_the_app():
    offenders = {m: sorted(i for i in imports if i.split(".")[0] == "app") for m, imports in import_graph().items()}
    assert not {m: i for m, i in offenders.items() if i}


def test_no_import_cycle_in_the_package():
    graph = {m: {i for i in imports if i.startswith("pop_vlm")} for m, imports in import_graph().items()}
    # a package's __init__ re-exports its modules: importing it is importing them, not a layer of its own
    cycles = []

    def reaches(start, goal, seen):
        for nxt in graph.get(start, ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                if reaches(nxt, goal, seen):
                    return True
        return False

    for module, imports in graph.items():
        for imported in imports:
            if not imported.startswith(module + ".") and reaches(imported, module, {imported}):
                cycles.append((module, imported))
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The cycle test above can fail: two modules that import each other are found."""
    package = tmp_path / "pop_vlm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import x\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", package)
    graph = import_graph()
    assert "pop_vlm.b" in graph["pop_vlm.a"] and "pop_vlm.a" in graph["pop_vlm.b"]


def test_serve_comes_from_the_app_through_an_entry_point():
    from pop_vlm.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "shapes-qwen3-vl"])
    assert args.func.__module__ == "app.cli"


ROOT = PACKAGE.parent
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "app").glob("*.py"), *(ROOT / "scripts").glob("*.py")])


def test_modules_and_functions_stay_small_and_say_what_they_are_for():
    too_long, no_docstring = [], []
    for path in sources():
        text = path.read_text()
        tree = ast.parse(text)
        name = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        if path.name != "__init__.py" and ast.get_docstring(tree) is None:
            no_docstring.append(str(name))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.name}: {length} lines")
    assert not too_long, too_long
    assert not no_docstring, no_docstring
