"""tic_trace.compare.parallel: ordered results from worker processes, errors that name the item."""
import os

import numpy as np
import pytest

from tic_trace.compare.parallel import ItemFailed, map_ordered


def _square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def _fails_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x


def _compare_memmaps(item: tuple[str, str, str]) -> float:
    from tic_trace.compare.metrics import compare_values
    a, b, dtype = item
    return compare_values(np.load(a, mmap_mode="r"), np.load(b, mmap_mode="r"), dtype).rel_l2


def test_results_are_in_item_order_and_come_from_other_processes():
    out = map_ordered(_square_and_pid, range(12), workers=2)
    assert [v for v, _ in out] == [x * x for x in range(12)]
    assert {pid for _, pid in out} - {os.getpid()}, "no item ran in a worker process"
    assert map_ordered(_square_and_pid, range(5), workers=1) == [(x * x, os.getpid()) for x in range(5)]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_item_is_named(workers):
    with pytest.raises(ItemFailed, match="work item 3 .*ValueError: three"):
        map_ordered(_fails_on_three, range(6), workers=workers)


def test_memmapped_points_compared_in_workers_match_in_process(tmp_path):
    rng = np.random.default_rng(0)
    items = []
    for i in range(4):
        a = rng.standard_normal((64, 32)).astype(np.float32)
        np.save(tmp_path / f"a{i}.npy", a)
        np.save(tmp_path / f"b{i}.npy", a + np.float32(10.0 ** -i))
        items.append((str(tmp_path / f"a{i}.npy"), str(tmp_path / f"b{i}.npy"), "float32"))
    assert map_ordered(_compare_memmaps, items, workers=2) == map_ordered(_compare_memmaps, items, workers=1)


_INHERITED_STATE: list = []


def _read_inherited(x: int) -> tuple[int, int]:
    return _INHERITED_STATE[x], os.getpid()


def test_forked_workers_inherit_the_callers_state_and_fork_needs_one_thread():
    """start_method="fork": workers see what the caller built before the pool (nothing pickled but the item),
    results in item order from other processes; fork_is_safe() says no while another thread runs or torch is
    loaded (this test process has torch)."""
    import sys
    import threading

    from tic_trace.compare.parallel import fork_is_safe
    _INHERITED_STATE[:] = [x * 10 for x in range(8)]
    try:
        out = map_ordered(_read_inherited, range(8), workers=2, start_method="fork")
    finally:
        _INHERITED_STATE.clear()
    assert [v for v, _ in out] == [x * 10 for x in range(8)]
    assert {pid for _, pid in out} - {os.getpid()}
    assert fork_is_safe() is ("torch" not in sys.modules and threading.active_count() == 1)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not fork_is_safe()
    finally:
        stop.set()
        t.join()
    with pytest.raises(ValueError, match="start_method must be one of"):
        map_ordered(_square_and_pid, range(3), workers=2, start_method="forkserver")
