"""The model families' boundaries (issue 36; docs/architecture.md, "Model families"), checked on the source with
`ast` (nothing is imported to find imports or names, but the registry itself):

- a family folder (tic_trace/families/<name>/) imports only the core (store, graph, view, replay, the contract
  families/base.py), never another family, the registry, a framework, or adapters / tools / integrations /
  testing; its `__init__`, `spec` and `names` load without torch;
- no module outside tic_trace/families/ names a family's config.json `model_type` (a string literal equal to
  it), nor an architecture its name tables verify, except the registry. Exempt: tic_trace/testing/ and tests/,
  which build the test models of every family by their frameworks' names;
- no module is over about 500 lines (the core's bound in test_architecture.py, here for adapters, tools,
  integrations and test support too), but the exceptions listed with their reason;
- README.md's family table is what the families' own `__init__`s say (`families.table.families_markdown`).
"""
from __future__ import annotations

import ast
import re
import sys

from pathlib import Path

from tic_trace.families import FAMILIES
from tic_trace.families.table import families_markdown
from tic_trace.testing import child

ROOT = Path(__file__).resolve().parents[1]
FAMILIES_DIR = ROOT / "tic_trace" / "families"
# The code that may not name a family (installed inside tic_trace: adapters, tools, integrations live beside it).
PRODUCT = {"tic_trace": ROOT / "tic_trace", "tic_trace.adapters": ROOT / "adapters", "tic_trace.tools": ROOT / "tools",
           "tic_trace.integrations": ROOT / "integrations"}
CORE = ("store", "graph", "view", "replay")
FRAMEWORKS = {"megatron", "sglang", "transformers"}
NOT_CORE = ("tic_trace.adapters", "tic_trace.tools", "tic_trace.integrations", "tic_trace.testing")
MAX_LINES = 530     # "no module over ~500 lines" (as tests/test_architecture.py's core bound)
# Modules over the bound, each with why it is not split yet. Shrinking one below the bound fails
# test_the_size_exceptions_are_still_needed: take it off this list then.
OVER_THE_BOUND = {
    "tic_trace/testing/sglang_cpu.py": "test support: SGLang's CPU stand-ins (distributed, attention backend, "
                                       "forward batch) that one harness installs together",
    "tic_trace/testing/faults.py": "test support: the planted faults of every demo pair, one registry",
    "tic_trace/testing/megatron_cpu.py": "test support: megatron-core's CPU harness (process groups, local-spec "
                                         "layers, weight loading)",
    "tic_trace/testing/sglang_source.py": "test support: the static checks of SGLang's source the slime-stack lane "
                                          "reads",
}


def _modules(src: Path, base: str) -> dict[str, Path]:
    out = {}
    for path in sorted(src.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([base, *parts])] = path
    return out


def _all_modules() -> dict[str, Path]:
    out = {}
    for base, src in PRODUCT.items():
        out.update(_modules(src, base))
    return out


MODULES = _all_modules()


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names a module imports, lazy ones included (relative imports resolved)."""
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
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return out


def _family_of_module(name: str) -> str | None:
    """The family folder a module is in (None: outside every family; the registry, base.py and table.py are
    tic_trace/families/'s own)."""
    parts = name.split(".")
    inside = len(parts) > 2 and parts[:2] == ["tic_trace", "families"] and (FAMILIES_DIR / parts[2]).is_dir()
    return parts[2] if inside else None


def test_every_family_folder_is_registered_and_says_what_it_is():
    folders = sorted(p.name for p in FAMILIES_DIR.iterdir() if (p / "__init__.py").is_file())
    assert folders == sorted(f.name for f in FAMILIES), "a family folder not in the registry, or the reverse"
    for fam in FAMILIES:
        doc = ast.get_docstring(ast.parse((FAMILIES_DIR / fam.name / "__init__.py").read_text())) or ""
        assert "verified" in doc.lower() and len(doc) > 200, f"families/{fam.name}/__init__.py: say what the " \
            "family is and what is verified per framework in its docstring"
        assert fam.model_types and fam.description and fam.verified, fam.name


def test_a_family_imports_only_the_core():
    bad = []
    for name, path in MODULES.items():
        fam = _family_of_module(name)
        if fam is None:
            continue
        for t in _imports(name, path):
            top = t.split(".")[0]
            if top in FRAMEWORKS or t.startswith(NOT_CORE):
                bad.append(f"{name} imports {t} (a framework or outside the core)")
            elif t == "tic_trace" or t == "tic_trace.families":
                bad.append(f"{name} imports {t} (the facade / the registry: an import circle)")
            elif t.startswith("tic_trace.families."):
                other = _family_of_module(t)
                if t != "tic_trace.families.base" and other != fam:
                    bad.append(f"{name} imports {t} (another family)")
            elif t.startswith("tic_trace.") and t.split(".")[1] not in CORE:
                bad.append(f"{name} imports {t} (families may import {', '.join(CORE)})")
    assert not bad, "\n".join(bad)


def test_a_familys_description_and_names_load_without_torch():
    names = ["tic_trace.families", *(n for n in MODULES if _family_of_module(n)
                                     and n.rsplit(".", 1)[-1] not in ("ops", "variants")
                                     and not n.rsplit(".", 1)[-1].endswith(("_ops", "_variants")))]
    code = ("import sys, importlib\n"
            f"for n in {names!r}:\n    importlib.import_module(n)\n"
            "sys.exit('torch' in sys.modules)")
    r = child.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, "a family's __init__ / spec / names imports torch\n" + r.stdout + r.stderr


def _family_names() -> dict[str, str]:
    """Each string only one family may name -> its family: its model_types and the architectures its name
    tables verify."""
    out = {}
    for fam in FAMILIES:
        for mt in fam.model_types:
            out[mt] = fam.name
        for tables in fam.names().values():
            for arch in tables.architectures:
                out[arch.name] = fam.name
    return out


# Family names still written outside their folder, each (module, name) with why: what of issue 36 is left. An entry
# that no longer occurs fails test_the_pending_names_are_still_there: take it off then.
PENDING: dict[tuple[str, str], str] = {}


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_module_outside_the_families_names_a_family():
    """A model_type (or a verified architecture) as a string literal anywhere outside its family's folder is
    family knowledge in the wrong place. tic_trace/testing/ builds the test models of every family (exempt, as
    tests/ is); the registry names no model_type (each family's __init__ does)."""
    owned = _family_names()
    bad = []
    for name, path in MODULES.items():
        if name.startswith("tic_trace.testing") or name.startswith("tic_trace.families"):
            continue
        rel = str(path.relative_to(ROOT))
        hits = sorted(s for s in _string_constants(path) if s in owned and (rel, s) not in PENDING)
        bad += [f"{rel} names {s!r} (family {owned[s]})" for s in hits]
    assert not bad, "\n".join(bad)


def test_the_pending_names_are_still_there():
    gone = [k for k in PENDING if k[1] not in _string_constants(ROOT / k[0])]
    assert not gone, f"no longer written there: take them off PENDING: {gone}"


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_is_over_about_500_lines():
    long = {str(p.relative_to(ROOT)): _lines(p) for p in MODULES.values() if _lines(p) > MAX_LINES}
    unlisted = {p: k for p, k in long.items() if p not in OVER_THE_BOUND}
    assert not unlisted, f"over {MAX_LINES} lines (split it, or list it in OVER_THE_BOUND with why): {unlisted}"


def test_the_size_exceptions_are_still_needed():
    fine = [p for p in OVER_THE_BOUND if _lines(ROOT / p) <= MAX_LINES]
    assert not fine, f"under the bound now: take them off OVER_THE_BOUND: {fine}"


def test_the_readme_family_table_is_the_families_own():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- families:begin.*?-->\n(.*?)<!-- families:end -->", readme, re.S)
    assert m, "README.md has no families block"
    assert m.group(1) == families_markdown(), "README.md's family table differs from the families' __init__s: " \
        "paste `python -c 'from tic_trace.families.table import families_markdown as f; print(f(), end=\"\")'`"
