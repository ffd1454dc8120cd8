"""Static checks of an SGLang release's source against what the SGLang adapter relies on. TEST SUPPORT ONLY.

slime pins SGLang 0.5.15.post1, whose model code cannot be imported beside our pins (transformers 5.24,
sgl-kernel APIs), so its source is read without importing it: straight out of the release wheel (a zip) with
``ast``. The same checker runs over the installed 0.5.23 as a control. What is checked (docs/sglang.md,
"Checked against SGLang 0.5.15.post1"):

* module paths: from a ``*ForCausalLM`` class, each attribute of a path such as
  ``model.layers.N.mlp.experts`` is assigned in the ``__init__`` of the class built for the previous one
  (classes followed through ``self.x = Cls(...)``, ``make_layers(lambda ...: Cls(...))``, constructor
  parameters such as ``decoder_layer_type`` and ``super().__init__(...)`` keywords, base classes, imports);
* dataclass fields (``ForwardBatch``, ``ServerArgs``, ``LogitsProcessorOutput``) with their annotations and
  defaults, methods of a class, and the ``--flags`` a parser defines;
* whether a MoE block all-reduces its own output: a TP all-reduce call reachable from the block's
  ``forward`` through ``self.method(...)`` calls, not under a guard that the constructor's constant
  arguments make false (``if self.reduce_results:`` with ``reduce_results=False`` passed by the layer).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

#: The SGLang release slime ships (its Dockerfile at 624b824a8) and the wheel read for it. The wheel's Python
#: source is the same for every interpreter tag; this one is fetched whatever the local platform is.
SLIME_SGLANG = "0.5.15.post1"
SLIME_SGLANG_WHEEL = "sglang-0.5.15.post1-cp311-cp311-manylinux_2_34_x86_64.whl"
SLIME_SGLANG_SHA256 = "8e182e1c449197cb6f98716a7cf432a3ea7af78c172f9b840ab28ad9e6cda9b4"
#: Collectives that sum TP ranks' partial outputs (0.5.15: the plain and the MoE-group spelling; 0.5.23's
#: DeepSeek block: ``post_experts_all_reduce``).
TP_REDUCTIONS = frozenset({"tensor_model_parallel_all_reduce", "moe_tensor_model_parallel_all_reduce",
                           "post_experts_all_reduce"})


# ================================================================== getting the source

def wheel_dir() -> Path:
    """Where scripts/setup.sh keeps release wheels that are read, never installed: inside the venv."""
    return Path(sys.prefix) / "tic-trace-wheels"


def fetch_slime_sglang_wheel(dest: Path | None = None) -> Path:
    """The SGLang 0.5.15.post1 wheel, downloaded once with pip (no dependencies, not installed) and checked
    against its sha256. Raises RuntimeError saying what failed and what to run."""
    dest = dest or wheel_dir()
    path = dest / SLIME_SGLANG_WHEEL
    if path.is_file() and _sha256(path) == SLIME_SGLANG_SHA256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"sglang=={SLIME_SGLANG}", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
           "--platform", "manylinux_2_34_x86_64", "-d", str(dest), "-q", "--disable-pip-version-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not path.is_file():
        raise RuntimeError(f"could not download SGLang {SLIME_SGLANG} (slime's pin) into {dest}: "
                           f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}\n"
                           "PyPI must be reachable; or put the wheel there by hand (scripts/setup.sh does this).")
    got = _sha256(path)
    if got != SLIME_SGLANG_SHA256:
        raise RuntimeError(f"{path}: sha256 {got}, expected {SLIME_SGLANG_SHA256} (not the released wheel); "
                           "delete it and run scripts/setup.sh again")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class SourceTree:
    """The ``sglang`` package's source, from a wheel (read from the zip) or a directory; paths are relative
    to the package (``srt/models/qwen3_moe.py``). Parsed modules are cached; nothing is imported."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self._zip = zipfile.ZipFile(self.root) if self.root.is_file() else None
        self._names = set(self._zip.namelist()) if self._zip else None
        self._ast: dict[str, ast.Module | None] = {}

    def __repr__(self) -> str:
        return f"SourceTree({self.root})"

    def has(self, rel: str) -> bool:
        if self._zip is not None:
            return f"sglang/{rel}" in self._names
        return (self.root / rel).is_file()

    def text(self, rel: str) -> str:
        if self._zip is not None:
            return self._zip.read(f"sglang/{rel}").decode("utf-8")
        return (self.root / rel).read_text(encoding="utf-8")

    def files(self, folder: str) -> list[str]:
        """The ``.py`` files directly in a folder of the package (``srt/models/``)."""
        if self._zip is not None:
            names = (n.removeprefix("sglang/") for n in self._names)
            return sorted(n for n in names if n.startswith(folder) and n.endswith(".py") and "/" not in n[len(folder):])
        return sorted(str(p.relative_to(self.root)) for p in (self.root / folder).glob("*.py"))

    def module(self, rel: str) -> ast.Module | None:
        if rel not in self._ast:
            self._ast[rel] = ast.parse(self.text(rel), filename=f"{self.root}:{rel}") if self.has(rel) else None
        return self._ast[rel]

    def module_file(self, dotted: str) -> str | None:
        """``sglang.srt.models.qwen2`` -> ``srt/models/qwen2.py`` (or the package's ``__init__.py``)."""
        if not dotted.startswith("sglang."):
            return None
        base = dotted.removeprefix("sglang.").replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if self.has(rel):
                return rel
        return None


def installed_sglang_tree() -> SourceTree:
    """The installed SGLang's source directory (found without importing SGLang)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SGLang is not installed: run scripts/setup.sh")
    return SourceTree(Path(list(spec.submodule_search_locations)[0]))


def installed_sglang_version() -> str:
    from importlib.metadata import version
    return version("sglang")


# ================================================================== following classes through __init__s

@dataclass(frozen=True)
class ClassRef:
    """A class of the source, as one constructor call builds it: ``args`` are the call's keyword arguments
    that resolved statically (to a ClassRef or a constant)."""
    rel: str
    node: ast.ClassDef
    args: tuple = ()

    @property
    def name(self) -> str:
        return self.node.name

    def arg(self, name: str):
        return dict(self.args).get(name, _UNKNOWN)


@dataclass(frozen=True)
class Opaque:
    """An attribute that is assigned, but not from a class this checker can follow (a factory's result)."""
    expr: str


_UNKNOWN = object()


def _top_level(mod: ast.Module):
    """Top-level statements, including those inside top-level ``if`` / ``try`` (guarded imports)."""
    todo = list(mod.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            todo[:0] = node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
        elif isinstance(node, ast.ExceptHandler):
            todo[:0] = node.body


def find_class(tree: SourceTree, rel: str, name: str, _depth: int = 0) -> ClassRef | None:
    """The class ``name`` as seen from module ``rel``: defined there, or imported from another module of
    SGLang (followed). None: not in SGLang's source (torch, a missing name)."""
    mod = tree.module(rel)
    if mod is None or _depth > 8:
        return None
    for node in _top_level(mod):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ClassRef(rel, node)
    for node in _top_level(mod):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    src = tree.module_file(node.module)
                    if src is not None:
                        return find_class(tree, src, alias.name, _depth + 1)
    return None


def _methods(tree: SourceTree, cls: ClassRef) -> list[tuple[ClassRef, ast.FunctionDef]]:
    """(defining class, method) for the class and its SGLang base classes, most derived first."""
    out, seen, todo = [], set(), [cls]
    while todo:
        c = todo.pop(0)
        if (c.rel, c.name) in seen:
            continue
        seen.add((c.rel, c.name))
        out += [(c, n) for n in c.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for b in c.node.bases:
            if isinstance(b, ast.Name):
                base = find_class(tree, c.rel, b.id)
                if base is not None:
                    todo.append(ClassRef(base.rel, base.node, c.args))
    return out


def _method(tree: SourceTree, cls: ClassRef, name: str):
    return next(((c, m) for c, m in _methods(tree, cls) if m.name == name), (None, None))


class _Frame:
    """Name resolution inside one class's ``__init__``: constructor arguments, parameter defaults, module."""

    def __init__(self, tree: SourceTree, cls: ClassRef, init: ast.FunctionDef):
        self.tree, self.cls, self.init = tree, cls, init
        a = init.args
        pos = a.posonlyargs + a.args
        self.defaults = {p.arg: d for p, d in zip(pos[len(pos) - len(a.defaults):], a.defaults)}
        self.defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
        self.params = {p.arg for p in pos + a.kwonlyargs}

    def resolve(self, expr: ast.expr):
        if isinstance(expr, ast.Constant):
            return expr.value
        if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):    # x = x or Default
            return next((v for v in map(self.resolve, expr.values) if v is not _UNKNOWN and v is not None),
                        _UNKNOWN)
        if not isinstance(expr, ast.Name):
            return _UNKNOWN
        if expr.id in self.params:
            passed = self.cls.arg(expr.id)
            if passed is not _UNKNOWN:
                return passed
            return self.resolve(self.defaults[expr.id]) if expr.id in self.defaults else _UNKNOWN
        found = find_class(self.tree, self.cls.rel, expr.id)
        return found if found is not None else _UNKNOWN

    def built(self, call: ast.Call) -> ClassRef | None:
        """The class a call constructs (with its resolved keyword arguments), if it is one."""
        target = self.resolve(call.func)
        if not isinstance(target, ClassRef):
            return None
        args = tuple((k.arg, v) for k in call.keywords if k.arg
                     for v in [self.resolve(k.value)] if v is not _UNKNOWN)
        return ClassRef(target.rel, target.node, args)


def _constructed(frame: _Frame, expr: ast.expr) -> list[ClassRef]:
    """The outermost class constructions inside an expression (``make_layers(n, lambda ...: Cls(...))``)."""
    if isinstance(expr, ast.Call):
        built = frame.built(expr)
        if built is not None:
            return [built]
    return [c for child in ast.iter_child_nodes(expr) for c in _constructed(frame, child)]


def _self_targets(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [t.attr for t in flat if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"]


def assigned(tree: SourceTree, cls: ClassRef, attr: str, _depth: int = 0) -> list[ClassRef | Opaque]:
    """What ``self.<attr>`` is assigned in the class's ``__init__`` (every branch), following
    ``super().__init__(...)`` into the base class with its keyword arguments. [] when never assigned."""
    owner, init = _method(tree, cls, "__init__")
    if init is None or _depth > 8:
        return []
    frame = _Frame(tree, ClassRef(owner.rel, owner.node, cls.args), init)
    out: list[ClassRef | Opaque] = []
    for node in ast.walk(init):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and attr in _self_targets(node):
            out += (_constructed(frame, node.value) or _returned_by_self_method(tree, cls, node.value)
                    or [Opaque(ast.unparse(node.value)[:80])])
        elif isinstance(node, ast.Call) and _is_super_init(node):
            out += _assigned_in_base(tree, frame, owner, node, attr, _depth)
    return out


def _returned_by_self_method(tree: SourceTree, cls: ClassRef, expr: ast.expr) -> list[ClassRef]:
    """The classes a ``self.method(...)`` call constructs in its ``return`` statements (llama.py's
    ``self.model = self._init_model(...)``); [] for any other expression."""
    f = expr.func if isinstance(expr, ast.Call) else None
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
        return []
    owner, fn = _method(tree, cls, f.attr)
    if fn is None:
        return []
    frame = _Frame(tree, ClassRef(owner.rel, owner.node, cls.args), fn)
    return [c for node in ast.walk(fn) if isinstance(node, ast.Return) and node.value is not None
            for c in _constructed(frame, node.value)]


def _is_super_init(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "__init__" and isinstance(f.value, ast.Call)
            and isinstance(f.value.func, ast.Name) and f.value.func.id == "super")


def _assigned_in_base(tree, frame: _Frame, owner: ClassRef, call: ast.Call, attr: str, depth: int) -> list:
    args = tuple((k.arg, v) for k in call.keywords if k.arg
                 for v in [frame.resolve(k.value)] if v is not _UNKNOWN)
    out = []
    for b in owner.node.bases:
        base = find_class(tree, owner.rel, b.id) if isinstance(b, ast.Name) else None
        if base is not None:
            out += assigned(tree, ClassRef(base.rel, base.node, args), attr, depth + 1)
    return out


def follow_path(tree: SourceTree, root: ClassRef, path: str) -> tuple[list[ClassRef | Opaque], str | None]:
    """Follow a module path (``model.layers.N.mlp.experts``; ``N`` = any layer) from a root class: the
    objects the last attribute may be, and None; or [] and why the path does not exist."""
    current: list[ClassRef | Opaque] = [root]
    done = [root.name]
    for seg in path.split("."):
        if seg == "N":
            continue
        classes = [c for c in current if isinstance(c, ClassRef)]
        if not classes:
            return [], f"{'.'.join(done)} is {current[0].expr!r}: cannot follow it to .{seg}"
        nxt = [t for c in classes for t in assigned(tree, c, seg)]
        if not nxt:
            names = sorted({c.name for c in classes})
            return [], f"{'.'.join(done)} ({', '.join(names)}) never assigns self.{seg}"
        current, done = nxt, done + [seg]
    return current, None


# ================================================================== model classes, fields, flags

def model_class(tree: SourceTree, name: str) -> tuple[ClassRef | None, bool]:
    """(the ``*ForCausalLM`` class ``name`` in ``srt/models/<file>.py``, whether that file lists it in
    ``EntryClass``, i.e. SGLang's model registry serves it for that HF architecture)."""
    for rel in tree.files("srt/models/"):
        if f"class {name}(" not in tree.text(rel):
            continue
        ref = find_class(tree, rel, name)
        if ref is not None and ref.rel == rel:
            return ref, name in _entry_classes(tree.module(rel))
    return None, False


def _entry_classes(mod: ast.Module) -> set[str]:
    for node in _top_level(mod):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
            return {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    return set()


@dataclass(frozen=True)
class Field:
    annotation: str
    default: str | None       # source text; None: no default


def class_fields(tree: SourceTree, rel: str, name: str) -> dict[str, Field]:
    """Annotated class-level fields (dataclass / NamedTuple) of ``name`` in ``rel``, with their source."""
    ref = find_class(tree, rel, name)
    if ref is None:
        raise LookupError(f"{tree}: no class {name} in {rel}")
    return {n.target.id: Field(ast.unparse(n.annotation), None if n.value is None else ast.unparse(n.value))
            for n in ref.node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def class_methods(tree: SourceTree, rel: str, name: str) -> set[str]:
    ref = find_class(tree, rel, name)
    if ref is None:
        raise LookupError(f"{tree}: no class {name} in {rel}")
    return {m.name for _, m in _methods(tree, ref)}


def module_functions(tree: SourceTree, rel: str) -> set[str]:
    """Functions a module defines or imports (what ``getattr(module, name)`` finds)."""
    mod = tree.module(rel)
    if mod is None:
        return set()
    out = set()
    for node in _top_level(mod):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names}
    return out


def server_arg_fields(tree: SourceTree) -> dict[str, Field]:
    """``ServerArgs``' fields: declared in the class (0.5.15) or in the namespaces of ``srt/arg_groups/fields/``
    it is assembled from (0.5.2x)."""
    out = class_fields(tree, "srt/server_args.py", "ServerArgs")
    for rel in tree.files("srt/arg_groups/fields/"):
        for node in _top_level(tree.module(rel)):
            if isinstance(node, ast.ClassDef):
                out.update(class_fields(tree, rel, node.name))
    return out


def server_cli_flags(tree: SourceTree) -> set[str]:
    """The command-line flags of ``ServerArgs``: fields annotated ``A[type, help-or-Arg(...)]`` become
    ``--field-name`` (or their ``cli_name``) unless ``Arg(no_cli=True)``, plus literal ``add_argument`` flags."""
    out = parser_flags(tree)
    for name, f in server_arg_fields(tree).items():
        if f.annotation.startswith("A[") and "no_cli=True" not in f.annotation:
            m = re.search(r"cli_name=['\"](--[\w-]+)['\"]", f.annotation)
            out.add(m.group(1) if m else "--" + name.replace("_", "-"))
    return out


def parser_flags(tree: SourceTree, rel: str = "srt/server_args.py") -> set[str]:
    """Every ``--flag`` string passed to an ``add_argument(...)`` call in the module."""
    out = set()
    for node in ast.walk(tree.module(rel)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    and a.value.startswith("--")}
    return out


# ================================================================== does a MoE block all-reduce its output?

@dataclass(frozen=True)
class Reduction:
    method: str
    line: int
    callee: str
    guards: tuple[str, ...] = field(default=())


def moe_blocks(tree: SourceTree, root: ClassRef) -> list[ClassRef]:
    """The classes ``model.layers.N.mlp`` may be that have ``experts`` (the MoE blocks), as the layer
    constructs them."""
    mlps, why = follow_path(tree, root, "model.layers.N.mlp")
    if why:
        raise LookupError(f"{tree}: {why}")
    return [m for m in mlps if isinstance(m, ClassRef) and assigned(tree, m, "experts")]


def self_reductions(tree: SourceTree, block: ClassRef) -> list[Reduction]:
    """The TP all-reduce calls (:data:`TP_REDUCTIONS`) the block's ``forward`` can reach through
    ``self.<method>(...)`` calls, skipping branches its constructor's constant arguments rule out. Non-empty:
    the block returns its output already summed over TP ranks (at TP > 1, unless a runtime guard skips it)."""
    consts = _self_constants(tree, block)
    methods = {m.name: m for _, m in reversed(_methods(tree, block))}
    found: list[Reduction] = []
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        _scan(methods[name].body, name, (), consts, found, todo)
    return sorted(found, key=lambda r: r.line)


def _self_constants(tree: SourceTree, block: ClassRef) -> dict[str, object]:
    """``self.x`` attributes the constructor sets to a constant (directly or from a constant argument)."""
    owner, init = _method(tree, block, "__init__")
    if init is None:
        return {}
    frame = _Frame(tree, ClassRef(owner.rel, owner.node, block.args), init)
    out: dict[str, object] = {}
    for node in init.body:               # top-level statements only: a conditional assignment is not constant
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            for attr in _self_targets(node):
                v = frame.resolve(node.value)
                if isinstance(v, (bool, int, str)) or v is None:
                    out[attr] = v
    return out


def _static_truth(test: ast.expr, consts: dict) -> bool | None:
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "self" \
            and test.attr in consts:
        return bool(consts[test.attr])
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = _static_truth(test.operand, consts)
        return None if v is None else not v
    if isinstance(test, ast.BoolOp):
        vals = [_static_truth(v, consts) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in vals else (True if all(v is True for v in vals) else None)
        return True if True in vals else (False if all(v is False for v in vals) else None)
    return None


def _scan(body: list, method: str, guards: tuple, consts: dict, found: list, todo: list) -> None:
    for stmt in body:
        if isinstance(stmt, ast.If):
            truth = _static_truth(stmt.test, consts)
            text = ast.unparse(stmt.test)
            _calls(stmt.test, method, guards, found, todo)
            if truth is not False:
                _scan(stmt.body, method, guards + (text,), consts, found, todo)
            if truth is not True:
                _scan(stmt.orelse, method, guards + (f"not ({text})",), consts, found, todo)
            continue
        nested = [getattr(stmt, k) for k in ("body", "orelse", "handlers", "finalbody") if hasattr(stmt, k)]
        if nested and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for expr in (getattr(stmt, k, None) for k in ("test", "iter", "items")):
                if isinstance(expr, ast.AST):
                    _calls(expr, method, guards, found, todo)
            for part in nested:
                _scan([s for s in part if isinstance(s, ast.stmt)] +
                      [s for h in part if isinstance(h, ast.ExceptHandler) for s in h.body],
                      method, guards, consts, found, todo)
            continue
        _calls(stmt, method, guards, found, todo)


def _calls(node: ast.AST, method: str, guards: tuple, found: list, todo: list) -> None:
    for n in ast.walk(node):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in TP_REDUCTIONS:
            found.append(Reduction(method, n.lineno, name, guards))
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            todo.append(f.attr)


# ================================================================== what our code reads

def attribute_reads(path: Path | str, var: str, function: str | None = None) -> dict[str, bool]:
    """Attribute names a Python file (or one of its functions) reads from the variable ``var``: ``var.x`` and
    ``getattr(var, "x"[, default])`` -> whether the read has a fallback (a ``getattr`` default: the
    attribute may be absent). An f-string name keeps its placeholders as ``{}``."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    if function is not None:
        tree = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.name == function)
    out: dict[str, bool] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == var:
            out[n.attr] = False
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" \
                and len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and n.args[0].id == var:
            name = n.args[1]
            if isinstance(name, ast.JoinedStr):
                name = ast.Constant("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in name.values))
            if isinstance(name, ast.Constant):
                out[name.value] = out.get(name.value, True) and len(n.args) == 3
    return out


if __name__ == "__main__":      # scripts/setup.sh: fetch the wheel once (a no-op when it is there and intact)
    try:
        fetch_slime_sglang_wheel()
    except RuntimeError as e:
        sys.exit(f"tic-trace setup: {e}")
