"""The layout of tic_trace/ (docs/architecture.md), checked on the source: which subpackage may import which,
no framework in the core, no import circle, no module over about 500 lines, and reading and comparing traces
without torch.

Imports are read with `ast` from every module, wherever they are written: at the top, inside functions (lazy
imports), under `if TYPE_CHECKING:`. Nothing is imported to find them.
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib

from pathlib import Path

from tic_trace.testing import child
from tic_trace.testing.source_imports import module_imports, package_modules

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tic_trace"

# Where each installed package's source lives (pyproject.toml's package-dir): the framework adapters, the
# command line and the integrations are installed inside tic_trace but live beside it.
SOURCES = {"tic_trace": PKG, "tic_trace.adapters": ROOT / "adapters", "tic_trace.tools": ROOT / "tools",
           "tic_trace.integrations": ROOT / "integrations"}

# The core's subpackages and the subpackages each may import (its own always). The same table is written in
# each subpackage's __init__ docstring, on its "May import:" line, and in docs/architecture.md.
ALLOWED = {
    "store": set(),
    # the canonical graph is assembled from the base's points and every registered family's (issue 36)
    "graph": {"families"},
    "record": {"store", "graph"},
    "view": {"store", "graph"},
    "replay": {"store", "graph", "view", "record", "compare", "families"},
    "report": {"store", "graph", "view"},
    "compare": {"store", "graph", "view", "replay", "report", "record"},
    # drift over a training run: reads run directories, compares each pair with the finder, renders its own
    # `drift` object (issue 26)
    "drift": {"store", "graph", "view", "compare", "report"},
    # one folder per model family and their registry (issue 36): a family imports only the core, the replay
    # dispatches through the registry (tests/test_family_boundaries.py checks the rest)
    "families": {"store", "graph", "view", "replay"},
}
# Where only some modules of an allowed subpackage may be imported: the tracer resolves an adapter by name through
# the registry and keeps rows by the identity rule both flows read (graph.row_subset); a checkpoint tensor is
# hashed with the tracer's own hash (to compare it with a side's recorded parameter hash); the finder builds the
# report's schema (never a renderer); a replay checks the reference against the traces first with the
# contract's `check_reference` (the one edge from replay up to compare); and the canonical graph reads the
# families' points through their registry (never a family folder).
ONLY = {("record", "graph"): {"tic_trace.graph.adapter", "tic_trace.graph.row_subset"},
        ("compare", "record"): {"tic_trace.record.stats"},
        ("compare", "report"): {"tic_trace.report.schema"},
        ("replay", "record"): {"tic_trace.record.stats"},
        ("replay", "compare"): {"tic_trace.compare.contract"},
        ("graph", "families"): {"tic_trace.families"}}
ANSWER_FLOW = {"view", "compare", "replay", "report"}
FRAMEWORKS = {"megatron", "sglang", "transformers"}
OUTSIDE_CORE = ("tic_trace.adapters", "tic_trace.integrations", "tic_trace.tools")
MAX_LINES = 530     # "no module over ~500 lines" (issue 21)


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name (a package is its __init__)."""
    return package_modules(SOURCES)


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The absolute names a module imports (`source_imports.module_imports`)."""
    return module_imports(name, MODULES[name], MODULES)


GRAPH = {name: _imports(name) for name in MODULES}


def _core() -> list[str]:
    return [m for m in MODULES if m.startswith("tic_trace") and not m.startswith(("tic_trace.testing", *OUTSIDE_CORE))]


def _subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tic_trace" else None


def _ours(names: set[str]) -> set[str]:
    return {n for n in names if n == "tic_trace" or n.startswith("tic_trace.")}


def test_the_top_of_tic_trace_holds_only_subpackages():
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py"]
    dirs = sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert dirs == sorted([*ALLOWED, "testing"])
    for d in dirs:
        assert (PKG / d / "__init__.py").is_file(), d


def test_every_package_is_installed():
    """pyproject.toml lists every package (a subpackage missing there is missing from a wheel)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m in MODULES if _is_package(m)}
    assert packages <= listed, sorted(packages - listed)


def test_each_subpackage_says_what_it_holds_and_what_it_may_import():
    """The docstring's "May import:" sentence is the table this file enforces."""
    for sub, allowed in ALLOWED.items():
        doc = ast.get_docstring(ast.parse((PKG / sub / "__init__.py").read_text())) or ""
        m = re.search(r"^May import: (.*?\.)(?=\s|$)", doc, re.M | re.S)
        assert m, f"tic_trace/{sub}/__init__.py: no 'May import:' sentence"
        named = set(re.findall(r"\b(" + "|".join(ALLOWED) + r")\b", m.group(1))) - {sub}
        assert named == allowed, (sub, named, allowed)


def test_subpackages_import_only_what_they_may():
    bad = []
    for name in _core():
        sub = _subpackage(name)
        if sub is None:
            continue        # the package's own __init__: the public API, it may re-export anything
        for target in _ours(GRAPH[name]):
            tsub = _subpackage(target)
            if tsub == sub:
                continue
            if tsub not in ALLOWED[sub]:
                bad.append(f"{name} imports {target}")
            elif (sub, tsub) in ONLY and target not in ONLY[(sub, tsub)]:
                bad.append(f"{name} imports {target} (of {tsub}, {sub} may import only {sorted(ONLY[(sub, tsub)])})")
    assert not bad, "\n".join(bad)


def test_record_never_imports_the_answer_flow():
    bad = [f"{n} imports {t}" for n in _core() if _subpackage(n) == "record"
           for t in _ours(GRAPH[n]) if _subpackage(t) in ANSWER_FLOW
           or (_subpackage(t) == "graph" and t not in ONLY[("record", "graph")])]
    assert not bad, "\n".join(bad)


def test_store_imports_nothing_of_the_answer_flow():
    bad = [f"{n} imports {t}" for n in _core() if _subpackage(n) == "store"
           for t in _ours(GRAPH[n]) if _subpackage(t) != "store"]
    assert not bad, "\n".join(bad)


def test_the_core_imports_no_framework():
    """Nothing in tic_trace/ but tic_trace/testing imports megatron, sglang, transformers, or tic-trace's own
    framework adapters, integrations and tools (adapters are loaded by name through the registry)."""
    bad = [f"{n} imports {t}" for n in _core() for t in GRAPH[n]
           if t.split(".")[0] in FRAMEWORKS or t.startswith(OUTSIDE_CORE)]
    assert not bad, "\n".join(bad)


def test_nothing_inside_a_subpackage_imports_the_package_facade():
    bad = [n for n in _core() if _subpackage(n) is not None and "tic_trace" in GRAPH[n]]
    assert not bad, bad


def test_no_import_circle():
    """No cycle in the graph of the modules in tic_trace/ (the core and its test support), lazy imports
    included (Tarjan's strongly connected components)."""
    inside = {n for n in MODULES if not n.startswith(OUTSIDE_CORE)}
    edges = {n: sorted(t for t in GRAPH[n] if t in inside) for n in inside}
    index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges[v]:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in edges:
        if v not in index:
            visit(v)
    assert not sccs, sccs


def test_no_core_module_is_over_about_500_lines():
    long = {n: len(MODULES[n].read_text().splitlines()) for n in _core()}
    assert not {n: k for n, k in long.items() if k > MAX_LINES}


def test_reading_and_comparing_traces_import_no_torch():
    """Everything but the record flow and the exact replay loads without torch: the public names the answer
    needs, every module of store, graph, view, compare and report."""
    names = [n for n in _core() if _subpackage(n) in {"store", "graph", "view", "compare", "report", "drift"}]
    code = ("import sys, importlib, tic_trace\n"
            "from tic_trace import Report, Trace, find_divergence, open_trace\n"
            f"for n in {names!r}:\n    importlib.import_module(n)\n"
            "sys.exit('torch' in sys.modules)")
    r = child.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
