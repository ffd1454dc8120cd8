"""R3's recording on slime's own ``MegatronTrainRayActor.fill_routing_replay``, in a process of its own:
``python tests/routing_replay_slime_script.py OUT_DIR`` (run by tests/test_routing_replay.py).

The vendored Megatron-LM and slime first on the path (tic_trace.testing.slime_vendor.activate); the integration's
Megatron patches installed as ``megatron_init`` installs them; then slime's own ``fill_routing_replay`` runs on a
``DataIterator`` over this DP rank's rollout data (two samples, one traced). What is not slime's: the actor object
is made without ``__init__`` (Ray, CUDA, model build) and holds no model chunk, so no router receives the ids
(test_routing_replay.py checks the replay itself on megatron-core's routers); the rollout id is set as the
``train_actor`` wrapper sets it before calling ``fill_routing_replay``. Writes ``OUT_DIR/result.json``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from tic_trace.testing import slime_vendor

slime_vendor.activate()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tic_trace.testing import megatron_cpu as mc  # noqa: E402
from tic_trace.testing import slime_real as sr  # noqa: E402

LAYERS, TOPK, EXPERTS = 3, 2, 8


def main(out: Path) -> dict:
    mc.init_parallel(0, 1)
    sr.install_cpu_accelerator()
    sr.install_cpu_shims()
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.data import DataIterator

    from tic_trace.integrations.slime import megatron_hooks
    from tic_trace.store.routed_experts import read_routed_experts_dir

    megatron_hooks.install_megatron_patches()
    args = SimpleNamespace(tic_trace=True, tic_trace_dir=str(out), tic_trace_rollout_ids=[0], tic_trace_every=0,
                           tic_trace_mode="rows", tic_trace_max_samples=1, rollout_batch_size=2, n_samples_per_prompt=1,
                           num_experts=EXPERTS, data_pad_size_multiplier=1, sequence_parallel=False,
                           allgather_cp=False)
    g = torch.Generator().manual_seed(0)
    lengths = (7, 5)
    data = {"sample_indices": [0, 1],
            "tokens": [torch.randint(0, 128, (n,), generator=g) for n in lengths],
            "rollout_routed_experts": [torch.randint(0, EXPERTS, (n - 1, LAYERS, TOPK), generator=g, dtype=torch.int32)
                                       for n in lengths]}
    given = [e.clone() for e in data["rollout_routed_experts"]]
    actor = object.__new__(MegatronTrainRayActor)
    actor.args, actor.model = args, []
    megatron_hooks._S.rollout_id = 0
    actor.fill_routing_replay([DataIterator(data, [[0, 1]])], [1], data)
    recs = read_routed_experts_dir(out / "rollout_00000" / "routing_replay")
    return {"wrapped": bool(getattr(MegatronTrainRayActor.fill_routing_replay, "_tic_trace", False)),
            "slime_consumed": "rollout_routed_experts" not in data,    # slime's own function ran after ours
            "files": len(recs), "samples": sorted(k for r in recs for k in r.samples),
            "equal": all(np.array_equal(r.samples["0-0"], given[0].numpy()) for r in recs),
            "source": recs[0].source if recs else None}


if __name__ == "__main__":
    d = Path(sys.argv[1])
    d.mkdir(parents=True, exist_ok=True)
    (d / "result.json").write_text(json.dumps(main(d)))
    os._exit(0)       # gloo groups: no slow interpreter teardown
