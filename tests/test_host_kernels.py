"""The fused CPU kernels (tic_trace/host_kernels.py) give the same bits as the torch-op path and numpy."""
from __future__ import annotations

import pytest
import torch

from tic_trace import host_copy, host_kernels
from tic_trace import stats as stats_mod
from tic_trace.stats import device_hash, numpy_hash

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


def _bits(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _stats_and_hash(v: torch.Tensor, fused: bool, monkeypatch) -> tuple[bytes, int]:
    monkeypatch.setattr(stats_mod, "USE_HOST_KERNELS", fused)
    return _bits(stats_mod.device_stats(v)), int(device_hash(v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", ["finite", "nan", "inf", "zeros-and-negatives", "signed-zeros", "all-zero"])
def test_fused_stats_equal_the_torch_ops_bit_for_bit(monkeypatch, dtype, case):
    """`device_stats` through the fused pass (float32/float64 on the CPU) returns exactly the bytes of the
    torch-op path: every statistic, sums included (same float64 copy, same torch reductions, same blocks),
    contiguous and strided, in one block and in many; the hash it hands to `device_hash` is the hash."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(301, 67, generator=g, dtype=torch.float64) * 50
    if case == "nan":
        base[5, 3], base[200, 1] = float("nan"), -float("nan")
    elif case == "inf":
        base[17, 0] = -float("inf")
    elif case == "zeros-and-negatives":
        base = -base.abs()
        base[::7] = 0.0
    elif case == "signed-zeros":
        base = base.abs()
        base[::5], base[1::5] = 0.0, -0.0
    elif case == "all-zero":
        base.zero_()
    t = base.to(dtype)
    for chunk in (1 << 17, 1000):
        monkeypatch.setattr(stats_mod, "_HOST_CHUNK", chunk)
        for v in (t, t.t(), t[3:, 1:]):
            fused, ops = _stats_and_hash(v, True, monkeypatch), _stats_and_hash(v, False, monkeypatch)
            assert fused == ops, (case, chunk, v.stride())
            assert fused[1] == numpy_hash(host_copy.as_storage(v.contiguous()))


def test_a_hash_kept_from_the_statistics_pass_serves_only_the_next_call_on_the_same_tensor(monkeypatch):
    """Inside `hash_kept_for_next_call` the fused pass keeps its hash for the next `device_hash` of the same
    tensor object (no second read: a planted wrong kept hash shows it is used); another tensor, a second call,
    or any call outside the block hash afresh."""
    t, other = torch.randn(1000), torch.randn(1000)
    with stats_mod.hash_kept_for_next_call():
        stats_mod.device_stats(t)
        assert stats_mod._LAST_HASH.entry[0] == id(t)                 # the fused pass kept its hash
        stats_mod._LAST_HASH.entry = (id(t), torch.tensor(7))        # what the next call of t must return
        assert int(device_hash(t)) == 7
        assert int(device_hash(t)) == numpy_hash(t.numpy())          # consumed
        stats_mod.device_stats(t)
        assert int(device_hash(other)) == numpy_hash(other.numpy())  # another tensor: its own hash
        assert int(device_hash(t)) == numpy_hash(t.numpy())
    stats_mod.device_stats(t)
    assert getattr(stats_mod._LAST_HASH, "entry", None) is None      # outside the block nothing is kept
    with torch.inference_mode():
        u = torch.randn(1000)
        with stats_mod.hash_kept_for_next_call():
            stats_mod.device_stats(u)
            assert int(device_hash(u)) == numpy_hash(u.numpy())      # inference tensors: no version needed
