"""Bounded memory and reuse in the tracer's record path (issue 12): statistics and hash in bounded blocks,
alias reuse that never changes a value, the host-copy cap with its writer thread, and odd tensors."""
import json
import time

import numpy as np

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import tic_trace
from tic_trace.record import host_copy
from tic_trace.record import stats as stats_mod
from tic_trace import find_divergence, open_trace
from tic_trace.record.stats import (TRANSIENT_BYTES_MAX, device_hash, device_stats, numpy_hash, numpy_stats, stats_and_hash,
                             stats_dict)
from tic_trace.testing.faults import plant
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config

from conftest import trace_hf

IDS = sample_tokens(2, 10)


def _peak_bytes(fn, tmp_path) -> int:
    """Peak bytes held by torch's CPU allocator during fn() above what it held before: the profiler reports
    every allocation and free with the allocator's running total ("Total Allocated")."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = tmp_path / "prof.json"
    prof.export_chrome_trace(str(path))
    events = [e["args"] for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    path.unlink()
    if not events:
        return 0
    base = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - base


def _warm(x):
    # the per-device index table and the CPU scratch buffers are caches of bounded size, built on first use
    device_stats(x[:4096]), device_hash(x[:4096])


_BIG = 1 << 25     # 128 MiB of float32: twice the bound


@pytest.mark.parametrize("path", ["cpu", "device-path-forced"])
@pytest.mark.parametrize("case", ["contiguous", "transposed", "float64-with-nan", "int64"])
def test_transient_memory_per_record_is_bounded(monkeypatch, tmp_path, path, case):
    """Statistics and hash of a tensor twice the bound allocate at most TRANSIENT_BYTES_MAX (64 MiB) at once,
    on the CPU path and on the accelerator path forced on the CPU; without blocks the same call exceeds it
    (so the measurement can fail)."""
    monkeypatch.setattr(stats_mod, "FORCE_DEVICE_PATH", path != "cpu")
    g = torch.Generator().manual_seed(0)
    if case == "contiguous":
        x = torch.randn(_BIG, generator=g)
    elif case == "transposed":
        x = torch.randn(1 << 12, 1 << 13, generator=g).t()
    elif case == "float64-with-nan":
        x = torch.randn(_BIG // 2, generator=g, dtype=torch.float64)
        x[5] = float("nan")
    else:
        x = torch.randint(-1000, 1000, (_BIG // 2,), generator=g, dtype=torch.int64)
    _warm(x.reshape(-1)[:8192].contiguous())
    peak = _peak_bytes(lambda: (device_stats(x), device_hash(x), stats_and_hash(x)), tmp_path)
    assert peak <= TRANSIENT_BYTES_MAX, (peak / 2**20, "MiB")
    print(f"{path} {case}: peak {peak / 2**20:.1f} MiB")
    if case == "contiguous":     # the control: torch ops (the fused CPU kernel allocates nothing) without blocks
        monkeypatch.setattr(stats_mod, "USE_HOST_KERNELS", False)
        monkeypatch.setattr(stats_mod, "_CHUNK", 1 << 30)
        monkeypatch.setattr(stats_mod, "_HOST_CHUNK", 1 << 30)
        monkeypatch.setattr(stats_mod, "_TABLE_MAX", 1 << 30)
        unbounded = _peak_bytes(lambda: (device_stats(x), device_hash(x)), tmp_path)
        assert unbounded > 2 * TRANSIENT_BYTES_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.bool,
                                   torch.complex64], ids=str)
def test_forced_device_path_in_many_blocks_matches_numpy(monkeypatch, dtype):
    """The accelerator path (fresh buffers, branch-free masking), cut into many blocks of a strided tensor,
    gives numpy's hash bit for bit and its statistics (sums to float64 rounding)."""
    monkeypatch.setattr(stats_mod, "FORCE_DEVICE_PATH", True)
    monkeypatch.setattr(stats_mod, "_CHUNK", 37)
    monkeypatch.setattr(stats_mod, "_TABLE_MAX", 37)
    base = torch.randn(23, 19, 3, dtype=torch.float64) * 4
    base[3, 4, 1], base[7, 2, 0] = float("nan"), float("inf")
    if dtype == torch.bool:
        t = base > 0
    elif dtype == torch.complex64:
        t = torch.complex(base, -base).to(dtype)
    elif not dtype.is_floating_point:
        t = base.nan_to_num(0, 0, 0).to(dtype)
    else:
        t = base.to(dtype)
    t = t.permute(1, 2, 0)                         # strided: cut into slabs along the leading dimensions
    from tic_trace.store.dtypes import torch_dtype_name
    raw = host_copy.as_storage(t.contiguous())
    assert int(device_hash(t)) == numpy_hash(raw)
    dev, host = stats_dict(device_stats(t).numpy()), numpy_stats(raw, torch_dtype_name(t.dtype))
    for k in dev:
        assert dev[k] == pytest.approx(host[k], rel=1e-12, nan_ok=True), k


# ------------------------------------------------------------------------------------------------ aliases

def _records(d):
    return {r.name: r for r in next(open_trace(d).passes()).records}


def test_alias_reuse_changes_no_value_and_skips_work(tmp_path):
    """Traces with and without alias reuse are identical record for record (stats, hashes, values), and reuse
    happened (a module's output is its last op's output)."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    _, t_on = trace_hf(model, tmp_path / "on", IDS)
    _, t_off = trace_hf(model, tmp_path / "off", IDS, reuse_aliases=False)
    assert t_on._alias.hits > 10
    on, off = _records(tmp_path / "on"), _records(tmp_path / "off")
    assert on.keys() == off.keys()
    for name in on:
        assert on[name].hash == off[name].hash and on[name].stats == off[name].stats, name
        assert on[name].mode == off[name].mode, name
        if on[name].has_data:                          # read back, CRC checked: the same values
            assert np.array_equal(on[name].values(), off[name].values()), name
    # Full records of the same tensor share one stored copy: the logits are the root's output and lm_head's.
    assert (on["lm_head:out"].offset, on["lm_head:out"].nbytes) == \
        (on["<root>:out['logits']"].offset, on["<root>:out['logits']"].nbytes)
    assert off["lm_head:out"].offset != off["<root>:out['logits']"].offset
    blob = lambda d: sum(p.stat().st_size for p in d.rglob("*.bin"))    # noqa: E731
    assert blob(tmp_path / "on") < blob(tmp_path / "off")


class _Reshapes(torch.nn.Module):
    def forward(self, x):
        y = x * 2                                            # op record of y (4 x 4, contiguous)
        return y.view(-1), y.view(2, 8), y[:2], y.t(), y.view(torch.int32), y[1:].reshape(-1)


def test_alias_reuse_spans_contiguous_reshapes_and_nothing_else(tmp_path):
    """A contiguous reshape of a captured tensor (same bytes, same order) reuses its slot; a shorter slice, a
    transpose of the same shape-class, another dtype or another offset does not; every record's hash and
    statistics are those of its own values."""
    x = torch.randn(4, 4)
    tracers = {}
    for d, reuse in (("on", True), ("off", False)):
        model = _Reshapes()
        with torch.no_grad(), tic_trace.trace(model, tmp_path / d, mode="full", reuse_aliases=reuse) as t:
            model(x)
        assert t.failed is None, t.failed
        tracers[d] = t
    t_on = tracers["on"]
    on, off = _records(tmp_path / "on"), _records(tmp_path / "off")
    assert t_on._alias.hits == 2           # out[0] and out[1]: reshapes of y
    y = (x * 2).numpy()
    want = {0: y.reshape(-1), 1: y.reshape(2, 8), 2: y[:2], 3: y.T, 4: y.view(np.int32), 5: y[1:].reshape(-1)}
    for i, v in want.items():
        name = f"<root>:out[{i}]"
        assert on[name].hash == off[name].hash == numpy_hash(np.ascontiguousarray(v)), name
        assert on[name].stats == off[name].stats, name
        assert tuple(on[name].shape) == v.shape, name


class _Writes(torch.nn.Module):
    """Records the same storage before and after in-place writes, through a view, a same-object return and
    an `_unsafe_view` (its own version counter)."""

    def forward(self, x):
        y = x * 2                                   # op record of y
        v = y.view(-1)
        v.add_(1)                                   # write through a view: version counter shared
        z = torch.ops.aten._unsafe_view(y, [-1])    # aliases y, fresh version counter
        z.mul_(3)                                   # dispatcher-visible write: forget()
        return y                                    # module output: y after both writes


def _assert_root_output_is(d, out: torch.Tensor) -> None:
    """The trace's root-output record holds `out` as it is now (after every write): hash and stored value."""
    final = _records(d)["<root>:out"]
    assert final.hash == numpy_hash(out.numpy()) and np.array_equal(final.values(), out.numpy())


_LIB = torch.library.Library("tictest", "DEF")
_LIB.define("scale_(Tensor x) -> ()")        # in place by name, no `(a!)`: like c10d's allreduce_


def _scale_unannotated(x):
    x.numpy()[...] *= 3                       # behind torch's back: no version bump either


_LIB.impl("scale_", _scale_unannotated, "CPU")


class _WritesUnannotated(torch.nn.Module):
    def forward(self, x):
        y = x * 2                                   # op record of y
        torch.ops.tictest.scale_(y)                 # written in place, unannotated, version unchanged
        return y                                    # module output: 3 * y


def test_an_unannotated_in_place_op_ends_alias_reuse(tmp_path):
    """An op that writes its arguments without a schema annotation or a version bump (c10d's in-place
    collectives: SGLang's MoE blocks all-reduce their own output) must not let a later record of that tensor
    reuse the statistics or the stored bytes taken before the write."""
    x, model = torch.randn(4, 8), _WritesUnannotated()
    with torch.no_grad(), tic_trace.trace(model, tmp_path / "t", mode="stats", points_mode="full") as t:
        out = model(x)
    assert t.failed is None and torch.equal(out, x * 6)
    _assert_root_output_is(tmp_path / "t", out)


class _WritesWhilePaused(torch.nn.Module):
    tracer = None

    def forward(self, x):
        y = x * 2                                   # op record of y
        with self.tracer.pausing():                 # a block run untraced: its ops are not seen
            torch.ops.tictest.scale_(y)             # written in place, unannotated, version unchanged
        return y                                    # module output: 3 * y


def test_writes_in_a_paused_block_end_alias_reuse(tmp_path):
    """Ops run inside `tracer.pausing()` in the middle of a pass are not seen, so an unannotated write there
    could not end a reuse: a later record of that tensor must not reuse the statistics or bytes from before."""
    x, model = torch.randn(4, 8), _WritesWhilePaused()
    with torch.no_grad(), tic_trace.trace(model, tmp_path / "t", mode="full") as t:
        model.tracer = t
        out = model(x)
    assert t.failed is None and torch.equal(out, x * 6)
    _assert_root_output_is(tmp_path / "t", out)


class _Probe(torch.nn.Module):
    def forward(self, t):
        return t


class _WritesThroughAnInferenceAlias(torch.nn.Module):
    """A normal tensor written through an inference tensor over its memory (DLPack interop in an inference
    block): the write is seen by the dispatcher, but neither tensor's version counter moves."""

    def __init__(self):
        super().__init__()
        self.before, self.after = _Probe(), _Probe()

    def forward(self, x):
        y = x * 2
        self.before(y.view(-1))
        with torch.inference_mode():
            torch.from_dlpack(y).add_(7)
        return self.after(y.view(-1)), self.after(y.view(2, 16))


def test_a_write_through_an_inference_alias_ends_alias_reuse(tmp_path):
    x, model = torch.randn(4, 8), _WritesThroughAnInferenceAlias()
    with torch.no_grad(), tic_trace.trace(model, tmp_path / "t", mode="full") as t:
        out = model(x)
    assert t.failed is None
    assert torch.equal(out[0], (x * 2 + 7).view(-1))
    recs = _records(tmp_path / "t")
    assert recs["before:out"].hash == numpy_hash((x * 2).numpy())
    for name in ("after:out", "after#1:out"):
        assert recs[name].hash == numpy_hash(out[0].numpy()), name
        assert recs[name].stats["sum"] == pytest.approx(float(out[0].double().sum()), rel=1e-12), name
        assert np.array_equal(recs[name].values().reshape(-1), out[0].numpy()), name


def test_alias_reuse_sees_writes_through_views_and_unsafe_views(tmp_path):
    x, model = torch.randn(4, 8), _Writes()
    with tic_trace.trace(model, tmp_path / "t", mode="full") as t:
        out = model(x)
    assert t.failed is None
    recs = _records(tmp_path / "t")
    final = recs["<root>:out"]
    assert final.hash == numpy_hash(out.numpy()) == numpy_hash(final.values())
    assert final.stats["sum"] == pytest.approx(float(out.double().sum()), rel=1e-12)


# ------------------------------------------------------------------------------------------------ host-copy cap

@pytest.fixture
def staged(monkeypatch):
    """The device path of the host copy (ring, writer thread, cap) on CPU tensors."""
    monkeypatch.setattr(host_copy, "STAGE_CPU", True)
    monkeypatch.setattr(host_copy, "_MIN_RING", 1 << 12)


def _values(d):
    return {n: (r.mode, r.values().tobytes() if r.has_data else None, r.hash) for n, r in _records(d).items()}


def test_cap_wait_keeps_every_value_and_notes_the_waits(tmp_path, staged, monkeypatch):
    """A cap smaller than the pass: the forward waits for the writer, every value is kept bit for bit, the
    pass notes say so, and the finder's answer is the uncapped one."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    plant(model, "hf", "router_bf16", 1)
    trace_hf(model, tmp_path / "free", IDS)
    # A slow disk: the writer takes longer per record than the forward, so the ring must fill and the forward
    # wait (without it, whether the writer keeps up depends on the machine's load).
    write_now = host_copy.HostStager.write_now

    def slow_write(self, *args, **kwargs):
        time.sleep(0.002)
        return write_now(self, *args, **kwargs)
    monkeypatch.setattr(host_copy.HostStager, "write_now", slow_write)
    _, t = trace_hf(model, tmp_path / "capped", IDS, pinned_cap_bytes=64 << 10)
    assert t._stager.peak_ring_bytes <= 64 << 10
    assert _values(tmp_path / "capped") == _values(tmp_path / "free")
    notes = next(open_trace(tmp_path / "capped").passes()).meta["notes"]
    assert any("waited for the disk writer" in n for n in notes), notes
    clean = build_hf_model(tiny_qwen3_config(moe=True))
    trace_hf(clean, tmp_path / "ref", IDS)
    a, b = find_divergence(tmp_path / "ref", tmp_path / "free"), find_divergence(tmp_path / "ref", tmp_path / "capped")
    assert a.first["key"] == b.first["key"] == "L1.moe.router_logits"
    assert a.to_json()["points"] == b.to_json()["points"]


def test_cap_degrades_to_statistics_with_a_note_never_silently(tmp_path, staged):
    """`on_cap="stats"` with a tiny cap: records that do not fit keep statistics and hash (mode stats),
    every one is counted in the pass notes, the trace reads, and the finder still answers."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    _, t = trace_hf(model, tmp_path / "free", IDS)
    _, t = trace_hf(model, tmp_path / "capped", IDS, pinned_cap_bytes=8 << 10, on_cap="stats")
    free, capped = _records(tmp_path / "free"), _records(tmp_path / "capped")
    degraded = [n for n in free if free[n].has_data and not capped[n].has_data]
    assert degraded and all(capped[n].mode == "stats" for n in degraded)
    assert all(capped[n].hash == free[n].hash and capped[n].stats == free[n].stats for n in free)
    kept = [n for n in free if capped[n].has_data]
    assert kept and all(np.array_equal(capped[n].values(), free[n].values()) for n in kept)
    notes = next(open_trace(tmp_path / "capped").passes()).meta["notes"]
    assert any(f"{len(degraded)} record(s) kept statistics" in n for n in notes), notes
    rep = find_divergence(tmp_path / "free", tmp_path / "capped")
    assert rep.verdict == "consistent"


def test_cap_wait_keeps_cpu_values_larger_than_the_ring(tmp_path):
    """`on_cap="wait"` (the default) with a cap below the model's larger values: on the CPU they need no host
    copy, so they are written directly and kept bit for bit, never degraded to statistics."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    trace_hf(model, tmp_path / "free", IDS)
    _, t = trace_hf(model, tmp_path / "capped", IDS, pinned_cap_bytes=4 << 10)
    assert t._stager.peak_ring_bytes <= 4 << 10
    free, capped = _values(tmp_path / "free"), _values(tmp_path / "capped")
    assert any(len(v[1] or b"") > 4 << 10 for v in free.values())       # values larger than the cap exist
    assert capped == free
    notes = next(open_trace(tmp_path / "capped").passes()).meta["notes"]
    assert not any("kept statistics" in n for n in notes), notes


def test_writer_error_disables_tracing_not_the_forward(tmp_path, staged, monkeypatch):
    """A failing blob write in the writer thread surfaces at pass end as a tracer failure: the forward's
    output is untouched and no half-written pass is left as complete."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    ref = model(IDS).logits
    from tic_trace.store import writer as fmt

    def boom(self, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fmt.PassWriter, "write_bytes", boom)
    with tic_trace.trace(model, tmp_path / "t", adapter="hf", points_mode="full") as t, torch.no_grad():
        out = model(IDS).logits
    assert torch.equal(out, ref)
    assert isinstance(t.failed, OSError)
    assert not list((tmp_path / "t").rglob("*.idx"))


def test_cpu_values_go_through_the_ring_whose_pages_the_next_tracer_reuses(tmp_path, monkeypatch):
    """CPU tensors are staged (memcpy into the ring, written by the writer thread), values as produced even when
    the model later writes into them; the pageable ring outlives its tracer for the next one (no fresh page
    faults), up to SPARE_RING_MAX, and `release_host_memory` frees it."""
    monkeypatch.setattr(host_copy, "_MIN_RING", 1 << 16)
    host_copy.release_host_memory()
    x, model = torch.randn(4, 8), _Writes()
    with tic_trace.trace(model, tmp_path / "a", mode="full") as t:
        out = model(x)
    assert t._stager.peak_ring_bytes == 1 << 16                  # staged: the ring was used
    assert _records(tmp_path / "a")["<root>:out"].hash == numpy_hash(out.numpy())
    (spare,) = host_copy._SPARE
    ptr = spare.data_ptr()
    with tic_trace.trace(model, tmp_path / "b", mode="full") as t2:
        model(x)
    assert t2._stager.peak_ring_bytes == 1 << 16 and host_copy._SPARE[0].data_ptr() == ptr   # taken and returned
    assert _values(tmp_path / "a") == _values(tmp_path / "b")
    host_copy.release_host_memory()
    assert not host_copy._SPARE
    monkeypatch.setattr(host_copy, "SPARE_RING_MAX", 1 << 10)    # a ring above the bound is not kept
    with tic_trace.trace(model, tmp_path / "c", mode="full"):
        model(x)
    assert not host_copy._SPARE


# ------------------------------------------------------------------------------------------------ comparator

def _reference_metrics(a, b, mant):
    """The metrics' definitions, whole-array (what compare_values computed before it streamed)."""
    n = a.shape[0]
    a2, b2 = a.reshape(n, -1).astype(np.float64), b.reshape(n, -1).astype(np.float64)
    fa, fb = np.isfinite(a2), np.isfinite(b2)
    both = fa & fb
    with np.errstate(invalid="ignore"):
        d = np.where(both, a2 - b2, 0.0)
    ra, rb = np.where(both, a2, 0.0), np.where(both, b2, 0.0)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ra), 2.0 ** -126))) - mant)
    defined = ~((ra == 0) & (d != 0))          # no ULP at an exact zero of A (Metrics.ulp_na)
    one_sided = (fa != fb) | ((~fa & ~fb) & ~(np.isnan(a2) & np.isnan(b2)) & (a2 != b2))
    return {"max_abs": np.abs(d).max(), "mean_abs": np.abs(d).mean(),
            "rel_l2": np.sqrt((d * d).sum() / (ra * ra).sum()),
            "cosine": (ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()),
            "max_ulp": (np.abs(d) / ulp)[defined].max(), "mean_ulp": (np.abs(d) / ulp)[defined].mean(),
            "ulp_na": int((~defined).sum()),
            "bitwise_equal": ((a2 == b2) | (np.isnan(a2) & np.isnan(b2))).mean(),
            "nonfinite": int((fa != fb).sum() + ((~fa & ~fb) & ~(np.isnan(a2) & np.isnan(b2)) & (a2 != b2)).sum()),
            "nonfinite_shared": int(((~fa & ~fb) & ~one_sided).sum()),
            # a row with NaN/Inf on one side only has an infinite error, never that of its finite elements
            "per_row_rel": np.where(one_sided.any(1), np.inf, np.sqrt((d * d).sum(1) / (ra * ra).sum(1))),
            "per_row_max": np.where(one_sided.any(1), np.inf, np.abs(d).max(1)),
            # the all-rows error judged: the 0.9 quantile of the rows' own errors, read as an order statistic
            "rel_rows": _row_quantile(np.where(one_sided.any(1), np.inf,
                                               np.sqrt((d * d).sum(1) / (ra * ra).sum(1))), 0.9)}


def _row_quantile(e: np.ndarray, q: float) -> float:
    return float(np.sort(e)[int(np.ceil(q * (e.size - 1)))])


@pytest.mark.parametrize("block", [1 << 20, 37, 5])
@pytest.mark.parametrize("case", ["close", "equal-rows", "nonfinite", "rows-longer-than-a-block", "zeros"])
def test_streamed_metrics_equal_the_whole_array_definitions(monkeypatch, block, case):
    from tic_trace.compare import metrics as compare
    monkeypatch.setattr(compare, "BLOCK_ELEMS", block)
    rng = np.random.default_rng(1)
    shape = (40, 3, 16) if case != "rows-longer-than-a-block" else (3, 200)
    a = rng.standard_normal(shape).astype(np.float32)
    if case == "zeros":
        a[5] = 0.0                                     # exact zeros of A where B is not zero
    b = (a + rng.standard_normal(shape).astype(np.float32) * 1e-3).astype(np.float32)
    if case == "equal-rows":
        b[::2] = a[::2]
    if case == "nonfinite":
        a[1, 0, 2], b[1, 0, 2] = np.nan, np.nan
        a[2, 1, 3], b[3, 0, 0], a[4, 0, 0], b[4, 0, 0] = np.inf, -np.inf, np.inf, np.inf
    got, want = compare.compare_values(a, b, "float32"), _reference_metrics(a, b, 23)
    for k, v in want.items():
        g = getattr(got, k)
        assert np.allclose(g, v, rtol=1e-12, atol=0, equal_nan=True), (k, g, v)
    assert got.rows == shape[0] and got.numel == a.size
    assert got.to_json().keys() == {"rows", "numel", "max_abs", "mean_abs", "rel_l2", "cosine", "max_ulp",
                                    "mean_ulp", "bitwise_equal", "ref_rms", "nonfinite", "nonfinite_shared",
                                    "rel_rows", "ulp_na"}


def test_routing_comparison_matches_per_row_sets():
    from tic_trace.compare.metrics import compare_routing
    rng = np.random.default_rng(2)
    n, k, e = 300, 4, 16
    A = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    B = A.copy()
    B[::7, 0] = (B[::7, 0] + 1) % e                    # some rows flip (or land on a member: no flip)
    B[5] = B[5, 0]                                     # duplicate ids in one row
    logits = rng.standard_normal((n, e)).astype(np.float32)
    err = np.abs(rng.standard_normal(n)) * 0.2
    got = compare_routing(A, B, logits, err)
    inter = [len(set(A[i]) & set(B[i])) for i in range(n)]
    flipped = [i for i in range(n) if inter[i] < k]
    margins = [float(np.sort(logits[i])[::-1][k - 1] - np.sort(logits[i])[::-1][k]) for i in flipped]
    assert got.flipped_index == flipped and got.flipped_rows == len(flipped)
    assert got.flip_margins == margins
    assert got.unexplained_flips == sum(not (m <= 2 * err[i]) for m, i in zip(margins, flipped))
    assert got.set_agreement == pytest.approx(np.mean(inter) / k, rel=1e-15)
    assert compare_routing(A, B).unexplained_flips == len(flipped)      # no logits: no flip is explained


def test_comparator_heap_is_bounded_by_blocks_not_the_tensor(tmp_path):
    """compare_values on two memory-mapped 128 MiB float32 arrays: the Python heap peak (tracemalloc sees
    numpy's allocations) stays within a few float64 blocks plus the per-row results, far below one input."""
    import tracemalloc
    from tic_trace.compare.metrics import BLOCK_ELEMS, compare_values
    rows, cols = 8192, 4096
    paths = []
    for side in "ab":
        mm = np.lib.format.open_memmap(tmp_path / f"{side}.npy", mode="w+", dtype=np.float32, shape=(rows, cols))
        mm[:] = 1.0
        if side == "b":
            mm[::5, 7] = 1.5
        mm.flush()
        paths.append(tmp_path / f"{side}.npy")
        del mm
    a, b = (np.load(p, mmap_mode="r") for p in paths)
    tracemalloc.start()
    m = compare_values(a, b, "float32")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert m.max_abs == 0.5 and m.rows == rows
    # a few float64 blocks, plus the per-row results (three float64 sums per row and the per-row lists)
    assert peak <= 3.5 * 8 * BLOCK_ELEMS + 128 * rows, peak / 2**20
    assert peak < a.nbytes / 32


# ------------------------------------------------------------------------------------------------ odd tensors

class _Sub(torch.Tensor):
    pass


class _Odd(torch.nn.Module):
    """One child per odd kind, each returning it as its module output, and a plain output at the end."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        k, y = self.kind, x * 2
        if k == "zero-size":
            return y[:0] + 1                      # an expert that got no tokens
        if k == "sparse":
            return y.to_sparse()
        if k == "sparse_csr":
            return y.to_sparse_csr()
        if k == "complex":
            return torch.complex(y, x)
        if k == "quantized":
            return torch.quantize_per_tensor(y, 0.05, 3, torch.quint8)
        if k == "subclass":
            return y.as_subclass(_Sub)
        if k == "nested":
            return torch.nested.nested_tensor([y[0], y[1, :2]])
        if k == "negated-view":                   # float32 whose memory holds the imaginary parts un-negated
            return torch.complex(y, x).conj().imag
        if k == "conjugated":
            return torch.complex(y, x).conj()
        raise AssertionError(k)


class _OddModel(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.odd = _Odd(kind)

    def forward(self, x):
        self.odd(x)
        return x + 1


_ODD_NOTES = {"zero-size": None, "sparse": "sparse_coo tensors not recorded", "sparse_csr": "sparse_csr tensors",
              "complex": "complex64 tensors recorded as their real view", "quantized": "quantized tensors (quint8)",
              "subclass": "tensor subclass _Sub recorded as the plain tensor", "nested": "nested tensors not recorded",
              "negated-view": "complex64 tensors recorded", "conjugated": "complex64 tensors recorded as their real view"}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", list(_ODD_NOTES))
@pytest.mark.parametrize("staged_copy", [False, True], ids=["direct", "staged"])
def test_odd_tensors_are_recorded_or_named_never_fatal(tmp_path, monkeypatch, kind, staged_copy):
    monkeypatch.setattr(host_copy, "STAGE_CPU", staged_copy)
    x = torch.randn(4, 3)
    model = _OddModel(kind)
    with tic_trace.trace(model, tmp_path / "t", mode="full") as t:
        out = model(x)
    assert t.failed is None, t.failed
    assert torch.equal(out, x + 1)
    p = next(open_trace(tmp_path / "t").passes())
    recs = {r.name: r for r in p.records}
    for r in p.records:                                   # every record reads back, with its CRC checked
        if r.has_data:
            r.raw()
    assert np.array_equal(recs["<root>:out"].values(), (x + 1).numpy())
    want_note = _ODD_NOTES[kind]
    assert (want_note is None and not p.meta["notes"]) or any(want_note in n for n in p.meta["notes"]), p.meta
    rec = recs.get("odd:out")
    y = x * 2
    if kind == "zero-size":
        assert rec.shape == (0, 3) and rec.values().shape == (0, 3) and rec.stats["count"] == 0
    elif kind == "complex":
        assert rec.extra["complex"] == "complex64" and rec.shape == (4, 3, 2)
        assert np.array_equal(rec.values(), torch.view_as_real(torch.complex(y, x)).numpy())
        assert rec.hash == numpy_hash(torch.complex(y, x).numpy())
    elif kind == "quantized":
        q = torch.quantize_per_tensor(y, 0.05, 3, torch.quint8)
        assert rec.extra == {"quantized": "quint8", "qscheme": "per_tensor_affine", "scale": 0.05, "zero_point": 3}
        assert np.array_equal(rec.raw(), q.int_repr().numpy())
    elif kind == "subclass":
        assert np.array_equal(rec.values(), y.numpy())
    elif kind == "negated-view":
        assert np.array_equal(rec.values(), (-x).numpy()) and rec.hash == numpy_hash((-x).numpy())
        assert rec.stats == pytest.approx(numpy_stats((-x).numpy(), "float32"), rel=1e-12)
    elif kind == "conjugated":
        want = torch.view_as_real(torch.complex(y, -x)).numpy()
        assert np.array_equal(rec.values(), want) and rec.hash == numpy_hash(want)
    else:
        assert rec is None
