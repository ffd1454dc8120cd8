"""The CPU part of benchmarks/gpu_check.py, as CI runs it: the checks that need CUDA report "skip", the
others must pass (device statistics vs numpy on the accelerator code path's dtypes and sizes, the host-copy
cap with its writer thread, the overhead table's plumbing)."""
import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_cpu_part_runs_and_passes(tmp_path):
    mod = _load()
    out = tmp_path / "gpu_check.json"
    threads = torch.get_num_threads()
    try:
        doc = mod.main(["--device", "cpu", "--quick", "--repeats", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["checks"].keys() == doc["checks"].keys()
    status = {k: v["status"] for k, v in doc["checks"].items()}
    needs_cuda = {"no_sync_per_op", "transient_memory", "peak_memory", "cuda_graph"}
    assert {k for k, s in status.items() if s == "skip"} == needs_cuda, doc["checks"]
    assert all(status[k] == "pass" for k in status if k not in needs_cuda), doc["checks"]
    assert doc["checks"]["pinned_cap"]["ring_bytes"] <= doc["checks"]["pinned_cap"]["cap"]
    assert set(doc["checks"]["overhead"]["table"]) >= {"untraced", "tic-trace stats", "DebugMode + log_tensor_hashes('norm')"}
