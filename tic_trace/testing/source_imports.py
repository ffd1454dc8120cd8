"""The installed package's modules and the imports each one writes, read from the source with `ast` (nothing is
imported to find them). Test support only: tests/test_architecture.py checks the layout with it (which
subpackage may import which, no circle), tests/test_family_boundaries.py the model families' boundaries.

Imports are read wherever they are written: at the top, inside functions (lazy imports), under
`if TYPE_CHECKING:`, and a family's `lazy(__name__, ".module", "attr")` hook (families/base.py)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Mapping


def package_modules(sources: Mapping[str, Path]) -> dict[str, Path]:
    """Every module by dotted name (a package is its `__init__`), for `sources`: installed package name -> the
    folder its source lives in (pyproject.toml's package-dir)."""
    out = {}
    for base, src in sources.items():
        for path in sorted(src.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([base, *parts])] = path
    return out


def module_imports(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The absolute names module `name` (its source `path`) imports: a module of `modules` where the name is one
    (`from a import b` with `a.b` a module is an import of `a.b`), else the imported module itself (a third-party
    name as written); relative imports resolved. The parent packages Python imports on the way are not counted:
    they hold no code of the module's."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = package.split(".")
                mod = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
        elif isinstance(node, ast.Call) and _lazy_module(node):
            # a family's hook `lazy(__name__, ".ops", "ops")` (families/base.py) imports its module on first call
            rel = _lazy_module(node)
            parts = package.split(".")
            level = len(rel) - len(rel.lstrip("."))
            out.add(".".join(parts[:len(parts) - level + 1] + [rel.lstrip(".")]))
    return out


def _lazy_module(node: ast.Call) -> str:
    """The relative module a `lazy(__name__, ".module", "attr")` call imports ("" for any other call)."""
    name = getattr(node.func, "id", getattr(node.func, "attr", ""))
    arg = node.args[1] if name == "lazy" and len(node.args) > 1 else None
    return arg.value if isinstance(arg, ast.Constant) and str(arg.value).startswith(".") else ""
