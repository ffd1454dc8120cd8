"""The canonical graph assembled from the base transformer's points and the model families' own (issue 36;
graph/canonical.py `assemble`, tic_trace/families/<name>/points.py): every family point placed once, in dataflow
order, read by the base points it stands before; where no family point is present the base's dataflow holds; a
declaration that does not fit is refused. And the HF weight names come from the families through the registry,
whatever was imported first (graph/weight_points.py)."""
from __future__ import annotations

import sys

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tic_trace.families import FAMILIES
from tic_trace.graph import canonical
from tic_trace.graph.canonical import BASE_POINTS, BY_NAME, SCHEMA, SchemaError, assemble, feeds_of
from tic_trace.graph.point_spec import FamilyPoint, PointSpec
from tic_trace.testing import child
from tic_trace.testing.source_imports import module_imports, package_modules

ROOT = Path(__file__).resolve().parents[1]

_SPECIAL = ("<prev>.output", "<last>.output")


def _declared() -> list[tuple[str, FamilyPoint]]:
    return [(fam.name, fp) for fam in FAMILIES for fp in fam.points]


def test_every_family_point_is_placed_once_and_nothing_else_is_added():
    names = [p.name for p in SCHEMA]
    assert len(names) == len(set(names))
    declared = {fp.spec.name for _, fp in _declared()}
    assert declared, "no family declares a point: the test would check nothing"
    assert set(names) == {p.name for p in BASE_POINTS} | declared
    assert [n for n in names if n not in declared] == [p.name for p in BASE_POINTS], "the base's order changed"
    for fam, fp in _declared():
        placed = BY_NAME[fp.spec.name]
        assert names.index(fp.spec.name) > names.index(fp.after), (fam, fp.spec.name)
        # the spec as declared, but for what other families' points rewire in it
        assert replace(placed, feeds=fp.spec.feeds, mixes=fp.spec.mixes, meaning=fp.spec.meaning) == fp.spec


def test_no_two_families_declare_one_point_otherwise():
    seen: dict[str, tuple[str, FamilyPoint]] = {}
    for fam, fp in _declared():
        first = seen.setdefault(fp.spec.name, (fam, fp))
        assert first[1] == fp, f"{fp.spec.name}: {first[0]} and {fam} declare it otherwise"


def test_every_feed_is_a_known_point_earlier_in_dataflow_order():
    order = {p.name: i for i, p in enumerate(SCHEMA)}
    for p in SCHEMA:
        for f in (*p.feeds, *p.mixes, *p.replaces):
            if f in _SPECIAL:
                continue
            assert f in BY_NAME, (p.name, f)
            if f in p.feeds or f in p.mixes:
                assert order[f] < order[p.name], f"{p.name} reads {f}, which comes after it"


def test_a_family_points_readers_read_it():
    for fam, fp in _declared():
        for reader, feed in fp.read_by:
            assert fp.spec.name in BY_NAME[reader].feeds, (fam, fp.spec.name, reader)
            assert feed not in BY_NAME[reader].feeds, f"{reader} still reads {feed}, which {fp.spec.name} replaced"
        for reader in fp.mixed_by:
            assert fp.spec.name in BY_NAME[reader].mixes, (fam, fp.spec.name, reader)


def test_without_family_points_every_base_point_reads_its_base_feeds():
    """A layer where no family's point is present: feeds_of gives each base point exactly the feeds the base
    transformer states (an absent family point resolves to its own feeds, an absent optional one to nothing)."""
    present = {(p.name, lay) for p in BASE_POINTS for lay in ((0, 1, 2) if p.layered else (None,))}
    for p in BASE_POINTS:
        if not p.layered:
            continue
        want = {("output", 0) if f == "<prev>.output" else (f, 1) for f in p.feeds}
        assert set(feeds_of(p.name, 1, present, 3)) == want, p.name


def test_the_base_alone_is_the_base():
    assert assemble(BASE_POINTS, ()) == BASE_POINTS
    assert len(SCHEMA) > len(BASE_POINTS)


def _family(name: str, *points: FamilyPoint, remarks=None) -> SimpleNamespace:
    return SimpleNamespace(name=name, points=points, remarks=remarks or {})


_NORM = PointSpec("attn.x_norm", True, ("attn_norm",), "H", op="rmsnorm")


def test_a_declaration_that_does_not_fit_is_refused():
    ok = FamilyPoint(_NORM, after="attn_norm", read_by=(("attn.q", "attn_norm"),))
    graph = assemble(BASE_POINTS, (_family("a", ok), _family("b", ok), _family("c", remarks={"attn.q": "x: y"})))
    by = {p.name: p for p in graph}
    assert by["attn.q"].feeds == ("attn.x_norm",) and [p.name for p in graph].count("attn.x_norm") == 1
    assert by["attn.q"].meaning.endswith("(x: y)")
    bad = {
        "otherwise": (_family("a", ok), _family("b", replace(ok, spec=replace(_NORM, features="2H")))),
        "a base point": (_family("a", FamilyPoint(replace(_NORM, name="mid"), after="attn_norm")),),
        "not a base point": (_family("a", replace(ok, after="nowhere")),),
        "no canonical point": (_family("a", replace(ok, read_by=(("attn.nowhere", ""),))),),
        "does not read": (_family("a", replace(ok, read_by=(("attn.q", "mid"),))),),
        "unit mixture": (_family("a", replace(ok, mixed_by=("attn.q",))),),
        "remarks on": (_family("a", remarks={"attn.nowhere": "x"}),),
    }
    for why, families in bad.items():
        with pytest.raises(SchemaError, match=why):
            assemble(BASE_POINTS, families)


def test_the_registry_graph_is_the_assembled_one():
    """SCHEMA is assembled from the registry: dropping a family's point from its declaration changes it."""
    assert canonical.SCHEMA == assemble(BASE_POINTS, FAMILIES)
    for fam in FAMILIES:
        for fp in fam.points:
            dropped = [replace(f, points=tuple(p for p in f.points if p is not fp)) if f is fam else f
                       for f in FAMILIES]
            assert fp.spec.name not in {p.name for p in assemble(BASE_POINTS, dropped)}


def test_hf_weight_names_come_from_the_families_whatever_is_imported_first():
    """A family's checkpoint names (Family.weight_points) are read through the registry: importing
    graph.weight_points first, before any family, still finds them before the base's."""
    code = ("from tic_trace.graph.weight_points import hf_point_of\n"
            "print(hf_point_of('model.layers.1.mlp.router.weight'), hf_point_of('model.layers.2.mlp.up_proj.weight'),"
            " hf_point_of('model.layers.0.pre_feedforward_layernorm.weight'),"
            " hf_point_of('model.layers.3.self_attn.qkv_proj.weight'), hf_point_of('lm_head.weight'))")
    r = child.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[0] == ("('moe.router_logits', 1) ('mlp.out', 2) ('mlp_norm', 0) ('attn.q', 3) "
                                       "('logits', None)")


def test_a_familys_hooks_import_their_modules_on_first_call():
    """`families.base.lazy`: the registry loads no family's ops, variants or name tables; a hook imports its module
    when first called, and a cached one builds its table once."""
    code = ("import sys\n"
            "from tic_trace.families import FAMILIES\n"
            "loaded = lambda: sorted(m for m in sys.modules if m.startswith('tic_trace.families.')"
            " and m.rsplit('.', 1)[1] in ('ops', 'variants', 'names', 'weights'))\n"
            "print(loaded())\n"
            "fam = next(f for f in FAMILIES if f.name == 'gemma')\n"
            "print(fam.variants() is fam.variants(), bool(fam.names()), loaded())\n")
    r = child.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "True True ['tic_trace.families.gemma.names', "
                                               "'tic_trace.families.gemma.variants']"]


def test_a_familys_points_are_data_importing_only_point_spec():
    """points.py is read by graph/canonical.py through the registry: anything else it imported could close a circle
    or bring torch to the reading of a trace."""
    modules = package_modules({"tic_trace": ROOT / "tic_trace"})
    points = [n for n in modules if n.startswith("tic_trace.families.") and n.endswith(".points")]
    assert len(points) >= 3, points
    for n in points:
        assert module_imports(n, modules[n], modules) <= {"__future__", "tic_trace.graph.point_spec"}, n
    assert module_imports("tic_trace.graph.point_spec", modules["tic_trace.graph.point_spec"], modules) <= {
        "__future__", "dataclasses"}
