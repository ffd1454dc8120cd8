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
