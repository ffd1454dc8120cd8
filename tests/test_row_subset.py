"""The identity row subset (tic_trace/graph/row_subset.py): slime's periodic default traces keep the values of
a few rows per sample, chosen from (sample key, position) alone, so that two sides that batch the same samples
differently keep the same rows and the comparator meets them. Real traced forwards of a tiny HF model, batched
three ways (one forward over the batch, a prefill and decode steps through the KV cache, one sample per forward
in the other order)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import tic_trace
from tic_trace.compare.diverge import find_divergence
from tic_trace.graph.row_subset import DEFAULT_STRIDE, RowSubset
from tic_trace.store.format import open_trace
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config

PROMPT = 6
IDS = sample_tokens(2, PROMPT + 6, seed=3)       # two samples of 12 positions
KEYS = ["7-0", "7-1"]
SUBSET = RowSubset(stride=5)                     # small enough that the strided rows fall inside 12 positions


# ------------------------------------------------------------------------------------------------ the rule

def test_rule_keeps_powers_of_two_and_one_row_per_stride_per_sample():
    s = RowSubset(stride=64)
    for key in ("0-0", "0-1", "12-345", "req-0"):
        kept = [p for p in range(1000) if s.keeps(key, p)]
        assert {0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512} <= set(kept)
        strided = [p for p in kept if p & (p - 1)]
        # the other kept rows are exactly one every `stride` positions, at this sample's phase
        assert strided and all(b - a == 64 for a, b in zip(strided, strided[1:]))
        assert all((p + s.phase(key)) % 64 == 0 for p in strided)
    # padding rows and negative positions are never kept
    assert not s.keeps(None, 0) and not s.keeps("0-0", -1)


def test_rule_depends_on_identity_only_and_differs_between_samples():
    a, b = RowSubset(stride=64), RowSubset(stride=64)
    rows = [(f"{r}-{i}", p) for r in range(3) for i in range(4) for p in range(300)]
    assert [a.keeps(k, p) for k, p in rows] == [b.keeps(k, p) for k, p in rows]
    # phases spread over the samples: they see different residues of the position
    assert len({a.phase(f"0-{i}") for i in range(32)}) > 16
    # CRC-32, not Python's per-process salted hash: the same in every process and on every machine
    import zlib
    assert a.phase("3-1") == zlib.crc32(b"3-1") % 64


@pytest.mark.parametrize("stride", [1, 5, 64, DEFAULT_STRIDE])
def test_rows_kept_per_sample_are_bounded(stride):
    s = RowSubset(stride=stride)
    for length in (1, 2, 3, 9, 17, 100, 1000, 3072, 40_000):
        for key in ("0-0", "5-9", "r"):
            n = sum(s.keeps(key, p) for p in range(length))
            assert 1 <= n <= s.max_rows(length) <= length + 1 + (length - 1).bit_length()
    # the default on a 2k-prompt, 1k-response sample: 19 rows at most of 3072
    assert RowSubset().max_rows(3072) == 19


def test_bad_stride_is_refused():
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="stride"):
            RowSubset(stride=bad)


# ------------------------------------------------------------------------------------------------ traced

def _model():
    return build_hf_model(tiny_qwen3_config(moe=True), seed=5)


def _trace(out, model, run, subset=SUBSET, mode="rows") -> str:
    with tic_trace.trace(model, out, adapter="hf", points_mode=mode, sample_rows=list(range(64)),
                         row_subset=subset) as t, torch.no_grad():
        run(model, t)
    assert t.failed is None, t.failed
    return str(out)


def _one_batch(m, t):
    t.sample_keys = KEYS
    m(IDS)


def _prefill_and_decode(m, t):
    t.sample_keys = KEYS
    cache = m(IDS[:, :PROMPT], use_cache=True).cache
    for j in range(PROMPT, IDS.shape[1]):
        t.step()
        cache = m(IDS[:, j:j + 1], cache=cache, use_cache=True).cache


def _one_sample_each_in_other_order(m, t):
    for b in (1, 0):
        t.sample_keys = [KEYS[b]]
        m(IDS[b:b + 1])
        t.step()


def _stored_rows(path: str, record_suffix: str) -> list[tuple[str, int]]:
    """(key, position) of every stored row of the records named `*record_suffix`, over every pass."""
    tr = open_trace(path)
    out = []
    for r in tr.ranks:
        for i in tr.pass_indices(r):
            p = tr.open_pass(r, i)
            for rec in p.records:
                if rec.name.endswith(record_suffix) and rec.has_data:
                    assert rec.mode == "rows" and rec.stored_shape[0] == len(rec.row_index)
                    out += [(p.rows["keys"][j], p.rows["positions"][j]) for j in rec.row_index]
    return out


def test_same_rows_are_kept_whatever_the_batching(tmp_path):
    """The same samples as one batch, as a prefill plus decode steps, one at a time in the other order: each
    trace stores the values of exactly the rows the rule keeps, so every pair meets on all of them."""
    model = _model()
    want = sorted((k, p) for k in KEYS for p in range(IDS.shape[1]) if SUBSET.keeps(k, p))
    assert any(p >= PROMPT for _, p in want) and len(want) < IDS.numel()   # decode rows in, and not every row
    runs = {"batch": _one_batch, "decode": _prefill_and_decode, "single": _one_sample_each_in_other_order}
    paths = {name: _trace(tmp_path / name, model, fn) for name, fn in runs.items()}
    for name, path in paths.items():
        got = _stored_rows(path, "layers.1.post_attention_layernorm:in[0]")
        assert sorted(got) == want, name
        assert open_trace(path).manifest["tracer"]["row_subset"] == {"rule": "powers_of_two+stride", "stride": 5}
    for b in ("decode", "single"):
        rep = find_divergence(paths["batch"], paths[b])
        assert rep.verdict == "consistent", (b, rep.verdict)
        mid = [p for p in rep.to_json()["points"] if p["point"] == "mid" and p["layer"] == 1][0]
        assert mid["rows"] == len(want), mid


def test_a_fault_on_kept_rows_is_measured_as_numbers(tmp_path):
    """A bf16 residual add in layer 1 on one side, batched differently: the subset gives the error at L1.mid
    (not a statistics-only 'not comparable')."""
    from tic_trace.testing.faults import plant
    a = _trace(tmp_path / "a", _model(), _one_batch)
    faulty = _model()
    plant(faulty, "hf", "residual_bf16", 1)
    b = _trace(tmp_path / "b", faulty, _prefill_and_decode)
    rep = find_divergence(a, b).to_json()
    assert rep["verdict"] != "not_comparable"
    fd = rep["first_divergence"]
    assert (fd["point"], fd["layer"]) == ("mid", 1), fd


def test_subset_stores_less_than_rows(tmp_path):
    model = _model()
    sub = _stored_rows(_trace(tmp_path / "sub", model, _one_batch), "layers.0.input_layernorm:out")
    every = _stored_rows(_trace(tmp_path / "all", model, _one_batch, subset=None), "layers.0.input_layernorm:out")
    assert len(every) == IDS.numel() and 0 < len(sub) < len(every) and set(sub) < set(every)


# ------------------------------------------------------------------------------------------------ row identity

def test_the_shared_rule_is_read_from_both_manifests_only_when_it_is_the_same():
    from tic_trace.graph.row_subset import shared_subset, subset_of_manifest
    m5, m7 = ({"tracer": {"row_subset": RowSubset(stride=s).describe()}} for s in (5, 7))
    assert subset_of_manifest(m5) == RowSubset(stride=5) and shared_subset(m5, dict(m5)) == RowSubset(stride=5)
    assert shared_subset(m5, m7) is None and shared_subset(m5, {"tracer": {}}) is None
    assert subset_of_manifest({"tracer": {"row_subset": {"rule": "another", "stride": 5}}}) is None


def _decode_pausing(step):
    """A prefill plus decode steps whose decode step `step` runs untraced (the engine paused the tracer for it):
    that forward's rows are in neither the trace's row table nor its records."""
    def run(m, t):
        t.sample_keys = KEYS
        cache = m(IDS[:, :PROMPT], use_cache=True).cache
        for j in range(PROMPT, IDS.shape[1]):
            t.step()
            ctx = t.pausing() if j == step else contextlib.nullcontext()
            with ctx:
                cache = m(IDS[:, j:j + 1], cache=cache, use_cache=True).cache
    return run


def test_rows_the_rule_drops_are_not_unmatched_but_lost_kept_rows_are(tmp_path):
    """Both traces kept rows by the same rule: a decode step missing from one trace whose rows the rule drops
    is nothing lost (consistent, no unmatched row); one that held a kept row is said, as a row the other side
    has inside this side's span (which blocks a consistent verdict); against a trace of every row (no rule),
    the dropped rows are unmatched too."""
    model = _model()
    decode = range(PROMPT, IDS.shape[1] - 1)           # not the last step: its rows would be "outside"
    dropped = [j for j in decode if not any(SUBSET.keeps(k, j) for k in KEYS)]
    kept = [j for j in decode if any(SUBSET.keeps(k, j) for k in KEYS)]
    assert dropped and kept
    batch = _trace(tmp_path / "batch", model, _one_batch)
    gap = _trace(tmp_path / "gap_dropped", model, _decode_pausing(dropped[0]))
    rep = find_divergence(batch, gap)
    assert (rep.rows["unmatched_a"], rep.rows["unmatched_b"]) == (0, 0), rep.rows
    assert not [n for n in rep.notes if n.kind == "unmatched_rows"]
    # every point but HF's RoPE taps ([batch, heads, T, dim]: statistics only in `rows` mode, over whole passes,
    # which differ here) compared and equal
    assert {p.point for p in rep.points if p.status != "ok"} <= {"attn.q_rope", "attn.k_rope"}
    mid = [p for p in rep.points if p.point == "mid" and p.layer == 1][0]
    assert mid.status == "ok" and mid.rows == rep.rows["matched"] > 0
    lost = _trace(tmp_path / "gap_kept", model, _decode_pausing(kept[0]))
    rep = find_divergence(batch, lost)
    n_kept = sum(SUBSET.keeps(k, kept[0]) for k in KEYS)
    assert rep.rows["unmatched_a"] == n_kept and rep.identity["unmatched"]["a"]["inside"] == n_kept, rep.rows
    said = [n for n in rep.notes if n.kind == "unmatched_rows"]
    assert len(said) == 1 and said[0].detail["blocks"] and rep.verdict != "consistent", rep.notes
    every = _trace(tmp_path / "every", model, _one_batch, subset=None)
    rep = find_divergence(every, gap)
    assert rep.rows["unmatched_a"] == len(KEYS), rep.rows         # both rows of the step it did not trace
