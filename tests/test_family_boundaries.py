"""The model families' boundaries (issue 36; docs/architecture.md, "Model families"), checked on the source with
`ast` (nothing is imported to find imports or names, but the registry itself):

- a family folder (tic_trace/families/<name>/) imports only the core (store, graph, view, replay, the contract
  families/base.py), never another family, the registry, a framework, or adapters / tools / integrations /
  testing; its `__init__`, `spec` and `names` load without torch;
- no module outside tic_trace/families/ names a family's config.json `model_type` (a string literal equal to
  it), nor an architecture its name tables verify, except the registry; nor a module, parameter or function name
  of the family's own (read off its name tables), nor one of its own canonical points. Exempt: tic_trace/testing/
  and tests/, which build the test models of every family by their frameworks' names;
- no module outside tic_trace/families/ writes a config.json key only one family's folder reads (its facts);
- no module is over about 500 lines (the core's bound in test_architecture.py, here for adapters, tools,
  integrations and test support too), but the exceptions listed with their reason;
- README.md's family table is what the families' own `__init__`s say (`families.table.families_markdown`).
"""
from __future__ import annotations

import ast
import re
import sys

from pathlib import Path
from typing import Mapping

from tic_trace.families import BASE, FAMILIES
from tic_trace.families.table import families_markdown
from tic_trace.graph.adapter import Architecture, PointMap
from tic_trace.graph.canonical import BY_NAME
from tic_trace.testing import child
from tic_trace.testing.source_imports import module_imports, package_modules

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


MODULES = package_modules(PRODUCT)


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names a module imports, lazy ones included (relative imports resolved)."""
    return module_imports(name, path, MODULES)


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


# ---------------------------------------------------------------- the families' module and parameter names
#
# The names a family's tables give its modules, parameters and functions (`kv_b_proj`, `linear_attn`,
# `apply_rotary_pos_emb_interleave`, `MLASelfAttention`), its module paths in a framework, and its own canonical
# points are that family's knowledge: no product module outside tic_trace/families/ may write them, in a string
# (`hasattr(attn, "kv_b_proj")`, "attn.kv_b"), as an attribute, function or variable name (`attn.linear_attn`) or in
# an import; nor its ops' names (`softcapped_logits`). They are read off the families' own tables: every
# identifier of a family's PointMap records (each spelling of the regex), architectures, refused classes, named
# tables (their values), checkpoint weight points and op names (its variants', envelopes', report words' keys)
# that is not in the base transformer's tables, not a canonical point's own word, in no other family's tables, not
# a plain word (a module name has an inner underscore, a digit or an inner capital: `sinks`, `router`, `norm` are
# the domain's words), and not in GENERIC. Docstrings and comments may say which family a mechanic serves; code
# may not name it.

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME_SHAPED = re.compile(r"[A-Za-z0-9]_[A-Za-z0-9]|[0-9]|[a-z][A-Z]")
# Names some family's tables give that every transformer has (the base's tables name no weights), each with why.
# A name here that no family's tables hold any more fails test_the_generic_names_are_still_in_the_tables.
GENERIC = {
    "down_proj": "every gated MLP's down projection (GPT-OSS's tables name its fused experts' one)",
    "out_proj": "any attention's output projection (Qwen3-Next's linear attention names its own so)",
    "expert_bias": "megatron-core's router attribute wherever moe_router_enable_expert_bias is on (DeepSeek's "
                   "table names it as the target of its selection bias)",
}


def _spellings(pattern: str, cap: int = 64) -> list[str]:
    """The names a record regex spells: its optional groups and alternatives expanded (`q_(b_)?proj` ->
    q_proj, q_b_proj; `attn_m[hq]a` -> attn_mha, attn_mqa), a named group (the layer index) and a digit class
    a separator."""
    p = re.sub(r"\(\?P<\w+>[^()]*\)", " ", pattern).replace("\\d+", " ").replace("\\d", " ")
    todo, out = [p], []
    while todo and len(out) < cap:
        s = todo.pop()
        m = re.search(r"\((?:\?:)?([^()]*)\)(\??)", s)
        chars = None if m else re.search(r"(?<!\\)\[([^\]]*)\]", s)
        if m is None and chars is None:
            out.append(s.replace("\\", ""))
            continue
        if m is not None:
            alts = m.group(1).split("|") + ([""] if m.group(2) else [])
        else:
            m, alts = chars, list(chars.group(1))
        todo += [s[:m.start()] + a + s[m.end():] for a in alts]
    return out


def _strings_of(obj, out: set[str]) -> None:
    """Every string a name table holds: row records (and their `also` records), architecture names, the values
    of mappings (their keys are the adapters' words, `router_weight`, or name what a value names too: a class);
    callables (a family's describe / applies hooks) hold none."""
    if isinstance(obj, str):
        out.add(obj)
    elif isinstance(obj, PointMap):
        out.add(obj.record)
        _strings_of(list(obj.also.values()), out)
    elif isinstance(obj, Architecture):
        out.add(obj.name)
    elif isinstance(obj, Mapping):
        _strings_of(list(obj.values()), out)
    elif isinstance(obj, (tuple, list, set, frozenset)):
        for x in obj:
            _strings_of(x, out)


def _table_identifiers(fam) -> set[str]:
    strings: set[str] = set()
    for tables in fam.names().values():
        _strings_of([tables.points, tables.architectures, list(tables.refused), list(tables.tables.values())],
                    strings)
    _strings_of([rx for rx, _ in fam.weight_points], strings)
    # its ops' names (`op_of`'s: the keys of its variants, envelopes, report words)
    _strings_of([list(fam.variants()), list(fam.envelopes), list(fam.op_words), list(fam.judged_in_compute),
                 list(fam.whole_sample_ops)], strings)
    return {t for s in strings for spelling in _spellings(s) for t in _IDENT.findall(spelling)}


def _own_identifiers() -> dict[str, str]:
    """Identifier -> the one family whose tables alone name it."""
    points = [*BY_NAME, *(fp.spec.name for fam in FAMILIES for fp in fam.points)]
    common = _table_identifiers(BASE) | {t for p in points for t in _IDENT.findall(p)} | set(GENERIC)
    seen: dict[str, set[str]] = {}
    for fam in FAMILIES:
        if fam is not BASE:
            for t in _table_identifiers(fam):
                seen.setdefault(t, set()).add(fam.name)
    return {t: next(iter(f)) for t, f in seen.items() if len(f) == 1 and t not in common and _NAME_SHAPED.search(t)}


def _own_points() -> dict[str, str]:
    return {fp.spec.name: fam.name for fam in FAMILIES if fam is not BASE for fp in fam.points}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
            and isinstance(n.body[0].value.value, str)}


def _names_written(source: str, filename: str) -> set[tuple[str, int]]:
    """(identifier, line) of what a module's code writes: the identifiers inside its string literals (docstrings
    excepted), its attribute, function, class, variable, argument and keyword names and the modules it imports;
    and (point, line) of each family's own canonical point its string literals name ("attn.kv_b", "L1.attn.kv_b")."""
    tree = ast.parse(source, filename)
    docs, out = _docstrings(tree), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out |= {(t, n.lineno) for t in _IDENT.findall(n.value)}
            out |= {(p, n.lineno) for p, rx in _OWN_POINT_RX.items() if rx.search(n.value)}
        elif isinstance(n, ast.Attribute):
            out.add((n.attr, n.lineno))
        elif isinstance(n, ast.Name):
            out.add((n.id, n.lineno))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add((n.name, n.lineno))
        elif isinstance(n, ast.arg):
            out.add((n.arg, n.lineno))
        elif isinstance(n, ast.keyword) and n.arg:
            out.add((n.arg, n.lineno))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            written = [getattr(n, "module", None) or "", *(a.name for a in n.names)]
            out |= {(t, n.lineno) for w in written for t in _IDENT.findall(w)}
    return out


def _family_names_written(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(name, line, family) for each family's own module / parameter name or point a module's code writes."""
    owned = {**_OWN, **_OWN_POINTS}
    return sorted((t, line, owned[t]) for t, line in _names_written(source, filename) if t in owned)


_OWN = _own_identifiers()
_OWN_POINTS = _own_points()
_OWN_POINT_RX = {p: re.compile(r"(?<![\w])" + re.escape(p) + r"(?![\w])") for p in _OWN_POINTS}
# Family module names still written outside their folder, each (module, name) with why: what of issue 36 is left.
# An entry that no longer occurs fails test_the_pending_module_names_are_still_there: take it off then.
PENDING_NAMES: dict[tuple[str, str], str] = {}


def test_no_module_outside_the_families_names_a_familys_modules():
    """Every product module but the family folders and the registry (the contract families/base.py and the
    README table's families/table.py included); tic_trace/testing/ is exempt, as tests/ is."""
    bad = []
    for name, path in MODULES.items():
        if name.startswith("tic_trace.testing") or _family_of_module(name) or name == "tic_trace.families":
            continue
        rel = str(path.relative_to(ROOT))
        bad += [f"{rel}:{line} names {t!r} (family {fam}'s: read it from the family's tables)"
                for t, line, fam in _family_names_written(path.read_text(encoding="utf-8"), rel)
                if (rel, t) not in PENDING_NAMES]
    assert not bad, "\n".join(bad)


def test_the_pending_module_names_are_still_there():
    gone = [k for k in PENDING_NAMES if not any(t == k[1] for t, _, _ in _family_names_written(
        (ROOT / k[0]).read_text(encoding="utf-8"), k[0]))]
    assert not gone, f"no longer written there: take them off PENDING_NAMES: {gone}"


def test_the_family_names_are_read_off_every_familys_tables():
    """The identifiers are the families' own: each family with tables has some, none is a base transformer's
    or a plain word, and the check finds them where code writes them (and not in a docstring)."""
    for fam in FAMILIES:
        if fam is not BASE and fam.names():
            assert any(f == fam.name for f in _OWN.values()), f"family {fam.name}: no module name of its own found"
    assert not {"self_attn", "q_proj", "o_proj", "qkv_proj", "input_layernorm", "sinks", "router"} & set(_OWN)
    assert {"kv_b_proj", "linear_attn"} <= set(_OWN) and "attn.kv_b" in _OWN_POINTS, sorted(_OWN)
    src = ('"""a docstring may say kv_b_proj"""\n'
           'def f(attn, cfg, feeds):\n'
           '    return (hasattr(attn, "kv_b_proj"), attn.linear_attn, cfg.q_proj, "self_attn.q_proj",\n'
           '            feeds["attn.kv_b"])\n')
    got = {t for t, _, _ in _family_names_written(src, "<example>")}
    assert got == {"kv_b_proj", "linear_attn", "attn.kv_b"}, got


def test_the_generic_names_are_still_in_the_tables():
    held = set().union(*(_table_identifiers(fam) for fam in FAMILIES if fam is not BASE))
    stale = sorted(set(GENERIC) - held)
    assert not stale, f"no family's tables name these any more: take them off GENERIC: {stale}"


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


# ---------------------------------------------------------------- the families' config.json keys
#
# The config.json keys a family's folder reads through model_spec's typed reader (the first argument of
# `c.int("kv_lora_rank", ...)`, c.ints / num / bool / str / raw / has / obj / error, in any of its modules) are its
# config facts. Those no other family's folder reads, but SHARED_CONFIG_KEYS, are its own: no product module
# outside tic_trace/families/ may write them (a string literal, an attribute, keyword or variable name:
# replay/model_spec.py once read MLA's ranks itself). tic_trace/testing/ is exempt (it builds every family's models).
_READS = {"int", "ints", "num", "bool", "str", "raw", "has", "obj", "error"}
# Keys a family reads that are every model's, each with why. One no family reads any more fails
# test_the_shared_config_keys_are_still_read.
SHARED_CONFIG_KEYS = {
    "num_hidden_layers": "every decoder's layer count (Qwen3-Next's facts size its layer kinds by it)",
    "layer_types": "any family's kinds of layer (replay/layer_types.py reads sliding windows from it; Qwen3-Next "
                   "names its linear-attention layers there)",
}


def _config_reads(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in _READS and n.args and isinstance(n.args[0], ast.Constant)
            and isinstance(n.args[0].value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n.args[0].value)}


def _family_config_keys() -> dict[str, set[str]]:
    """Family -> the config.json keys its folder reads."""
    out: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        fam = _family_of_module(name)
        if fam is not None:
            out.setdefault(fam, set()).update(_config_reads(path))
    return out


def _own_config_keys() -> dict[str, str]:
    """Config key -> the one family whose folder alone reads it."""
    seen: dict[str, set[str]] = {}
    for fam, keys in _family_config_keys().items():
        for k in keys:
            seen.setdefault(k, set()).add(fam)
    return {k: next(iter(f)) for k, f in seen.items() if len(f) == 1 and k not in SHARED_CONFIG_KEYS}


def test_no_module_outside_the_families_reads_a_familys_config_keys():
    own = _own_config_keys()
    # the check knows each family's keys, and finds one where code writes it (not in a docstring)
    assert {own.get(k) for k in ("kv_lora_rank", "rope_interleave", "query_pre_attn_scalar", "swiglu_limit",
                                 "linear_conv_kernel_dim")} == {"deepseek", "gemma", "gpt_oss", "qwen3_next"}, own
    src = '"""kv_lora_rank"""\ndef f(c, cfg):\n    return c.int("kv_lora_rank", 1, 9), cfg.swiglu_limit, c.int("vocab_size")\n'
    assert {t for t, _ in _names_written(src, "<example>") if t in own} == {"kv_lora_rank", "swiglu_limit"}
    bad = []
    for name, path in MODULES.items():
        if name.startswith("tic_trace.testing") or name.startswith("tic_trace.families"):
            continue
        rel = str(path.relative_to(ROOT))
        bad += [f"{rel}:{line} names config key {t!r} (family {own[t]}'s: read it in the family's facts)"
                for t, line in sorted(_names_written(path.read_text(encoding="utf-8"), rel)) if t in own]
    assert not bad, "\n".join(bad)


def test_the_shared_config_keys_are_still_read():
    read = set().union(*_family_config_keys().values())
    assert not set(SHARED_CONFIG_KEYS) - read, f"no family reads these any more: take them off SHARED_CONFIG_KEYS: " \
        f"{sorted(set(SHARED_CONFIG_KEYS) - read)}"
