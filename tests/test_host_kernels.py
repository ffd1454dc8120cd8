"""The fused CPU kernels (tic_trace/record/host_kernels.py) give the same bits as the torch-op path and numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tic_trace.record import host_copy, host_kernels
from tic_trace.record import stats as stats_mod
from tic_trace.record.stats import device_hash, numpy_hash, numpy_stats, stats_dict

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]


def _tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    base = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 300
    if dtype == torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    if not dtype.is_floating_point:
        return base.to(torch.int64).to(dtype)
    t = base.to(dtype)
    if t.numel() > 9:
        t.view(-1)[3], t.view(-1)[7], t.view(-1)[9] = float("nan"), float("inf"), -0.0
    return t


def _hash(t: torch.Tensor, fused: bool, monkeypatch) -> int:
    monkeypatch.setattr(stats_mod, "USE_HOST_KERNELS", fused)
    return int(device_hash(t))


def test_numba_is_installed_and_compiles():
    """numba is pinned (requirements/base.txt): the fast path must be the one the tests exercise."""
    assert host_kernels.hash_kernel() is not None


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_fused_hash_equals_torch_ops_and_numpy(monkeypatch, dtype):
    """Contiguous, transposed (hashed in strided blocks, with block starts > 0), a slice at a storage offset,
    0-d and empty tensors: the fused kernel, the torch ops and numpy give the same int64."""
    monkeypatch.setattr(stats_mod, "_HOST_CHUNK", 1000)     # many blocks for the strided cases
    for i, shape in enumerate([(), (0,), (1,), (7, 5), (300, 67), (3, 41, 29)]):
        t = _tensor(dtype, shape, seed=i)
        views = [t]
        if t.dim() >= 2:
            views += [t.transpose(0, 1), t[1:, 2:]]
        for v in views:
            fused, ops = _hash(v, True, monkeypatch), _hash(v, False, monkeypatch)
            assert fused == ops == numpy_hash(host_copy.as_storage(v.contiguous())), (dtype, shape, v.stride())


def test_fused_hash_beyond_the_index_table(monkeypatch):
    """A tensor longer than the cached index table (the torch path then offsets the table per block):
    both paths agree, so the index arithmetic wraps the same way in both."""
    monkeypatch.setattr(stats_mod, "_TABLE_MAX", 1 << 10)
    monkeypatch.setattr(stats_mod, "_HOST_CHUNK", 1 << 10)
    t = _tensor(torch.float32, (5000, 3), seed=7)
    for v in (t, t.t()):
        assert _hash(v, True, monkeypatch) == _hash(v, False, monkeypatch)


def test_without_numba_the_torch_path_gives_the_same_hash(monkeypatch):
    """numba missing (or failing to compile): hashing still works, with the same values."""
    t = _tensor(torch.bfloat16, (64, 33), seed=3)
    want = int(device_hash(t))
    monkeypatch.setattr(stats_mod, "hash_kernel", lambda: None)
    assert int(device_hash(t)) == want
    assert int(device_hash(t.t())) == numpy_hash(host_copy.as_storage(t.t().contiguous()))


def _stats_and_hash(v: torch.Tensor, fused: bool, monkeypatch) -> tuple[dict, int]:
    monkeypatch.setattr(stats_mod, "USE_HOST_KERNELS", fused)
    st, h = stats_mod.stats_and_hash(v)
    assert torch.equal(stats_mod.device_stats(v), st) and int(device_hash(v)) == int(h)   # one definition
    return stats_dict(st.numpy()), int(h)


def _planted(dtype: torch.dtype, case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    base = torch.randn(301, 67, generator=g, dtype=torch.float64) * 50
    if case == "nan":
        base[5, 3], base[200, 1] = float("nan"), -float("nan")
    elif case == "inf":
        base[17, 0] = -float("inf")
    elif case == "all-nonfinite":
        base.fill_(float("inf"))
        base[::3] = float("nan")
    elif case == "zeros-and-negatives":
        base = -base.abs()
        base[::7] = 0.0
    elif case == "signed-zeros":
        base = base.abs()
        base[::5], base[1::5] = 0.0, -0.0
    elif case == "all-zero":
        base.zero_()
    elif case == "extremes":
        base[0, 0], base[1, 1] = torch.finfo(dtype).max, -torch.finfo(dtype).max
        base[2, 2] = torch.finfo(dtype).smallest_normal / 4     # a subnormal
    return base.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", ["finite", "nan", "inf", "all-nonfinite", "zeros-and-negatives", "signed-zeros",
                                  "all-zero", "extremes"])
def test_fused_stats_agree_with_the_torch_ops_and_numpy(monkeypatch, dtype, case):
    """`stats_and_hash` through the fused kernel (float32/float64 on the CPU) against the torch-op path and
    `numpy_stats` from the stored bits: the hash, count, extremes and non-finite counts exactly; sum and sum of
    squares to float64 rounding (the kernel adds in its own vectorised order). Contiguous and strided, in one
    block and in many (blocks with and without non-finite values)."""
    t = _planted(dtype, case)
    for chunk in (1 << 17, 1000):
        monkeypatch.setattr(stats_mod, "_HOST_CHUNK", chunk)
        for v in (t, t.t(), t[3:, 1:]):
            (fused, fh), (ops, oh) = _stats_and_hash(v, True, monkeypatch), _stats_and_hash(v, False, monkeypatch)
            raw = host_copy.as_storage(v.contiguous())
            host = numpy_stats(raw, str(dtype).removeprefix("torch."))
            assert fh == oh == numpy_hash(raw), (case, chunk, v.stride())
            finite = v.double()[torch.isfinite(v)]
            # float64 rounding of a sum is relative to the sum of magnitudes (the planted +-max cancel)
            scale = {"sum": float(finite.abs().sum()), "sumsq": float((finite * finite).sum())}
            for k in fused:
                if k in scale:
                    assert fused[k] == pytest.approx(ops[k], rel=0, abs=1e-13 * scale[k] + 1e-300), (k, case)
                    assert fused[k] == pytest.approx(host[k], rel=0, abs=1e-13 * scale[k] + 1e-300), (k, case)
                else:
                    assert fused[k] == ops[k] == host[k], (k, case, chunk, v.stride(), fused[k], ops[k], host[k])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "ops"])
def test_lazily_negated_and_conjugated_views_are_read_as_their_values(monkeypatch, fused):
    """`c.conj().imag` is a float tensor whose memory holds the imaginary parts un-negated (torch's negative
    bit), `c.conj()` a complex one: statistics and hash are those of the values they read as."""
    c = torch.complex(_planted(torch.float32, "finite"), _planted(torch.float32, "nan"))
    for lazy in (c.conj().imag, c.conj().imag.t(), c.conj()):
        assert lazy.is_neg() or lazy.is_conj()
        got = _stats_and_hash(lazy, fused, monkeypatch)
        want = _stats_and_hash(lazy.resolve_conj().resolve_neg(), fused, monkeypatch)
        assert got == want


def test_fused_sums_are_as_accurate_as_torch_on_long_tensors(monkeypatch):
    """A 4 Mi-element float32 tensor with a large mean: the kernel's sums (vectorised runs added in order) stay
    within float64 rounding of an exact sum (math.fsum), as torch's do."""
    import math
    g = torch.Generator().manual_seed(5)
    t = torch.randn(1 << 22, generator=g) * 3 + 1000
    exact = math.fsum(t.double().tolist())
    fused, _ = _stats_and_hash(t, True, monkeypatch)
    assert fused["sum"] == pytest.approx(exact, rel=1e-13)
    exact_sq = math.fsum((t.double() ** 2).tolist())
    assert fused["sumsq"] == pytest.approx(exact_sq, rel=1e-13)


def test_a_thread_asking_while_another_loads_the_kernels_waits_for_them(monkeypatch):
    """The weight-hash thread often loads numba first: the forward thread asking meanwhile must get the
    kernels, not None (which would send its records down the torch path)."""
    import threading
    import time
    real_build = host_kernels._build
    started = threading.Event()

    def slow_build():
        started.set()
        time.sleep(0.3)
        return real_build()
    monkeypatch.setattr(host_kernels, "_build", slow_build)
    monkeypatch.setattr(host_kernels, "_TRIED", False)
    monkeypatch.setattr(host_kernels, "_KERNELS", None)
    loader = threading.Thread(target=host_kernels.kernels)
    loader.start()
    started.wait(5)
    assert host_kernels.kernels() is not None        # waited for the loader instead of answering None
    loader.join()


def test_stat_slots_match_stats_and_hash_across_paths_and_growth():
    """A pass's slots: fused CPU rows written in place, other dtypes kept as tensors until `fetch`, the arrays
    grown past their capacity; every slot equals `stats_and_hash` of its tensor, in slot order."""
    from tic_trace.record.stat_slots import StatSlots
    from tic_trace.record.stats import stats_and_hash
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    tensors = [torch.randn(7), torch.randn(3, 4).bfloat16(), torch.arange(9), torch.randn(4, dtype=torch.float64),
               base.t(), torch.tensor([1.0, float("nan"), float("inf")]), torch.randn(2, 2).half()]
    slots = StatSlots(capacity=2)
    got = [slots.add(t) for t in tensors]
    assert got == list(range(len(tensors))) and len(slots) == len(tensors)
    rows, hashes = slots.fetch()
    for i, t in enumerate(tensors):
        want_row, want_hash = stats_and_hash(t)
        np.testing.assert_allclose(rows[i], want_row.numpy(), rtol=1e-12, err_msg=str(i))
        assert hashes[i] == int(want_hash), i
    slots.clear()
    assert len(slots) == 0 and slots.add(tensors[1]) == 0
    assert slots.fetch()[1][0] == int(stats_and_hash(tensors[1])[1])
