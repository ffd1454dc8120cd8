"""Routing replay (R3, issue 37): the trainer applied the rollout's expert ids, per token and MoE layer.

The engine: SGLang 0.5.23's Qwen3-MoE on CPU (its model code and weight loading; random weights), generating two
samples with its routed-experts capture on: SGLang's own capture site hands each layer's `topk_ids` (its slot
order) to a capturer whose buffer is the test's (`_Capturer`); they travel as SGLang returns them
(`meta_info["routed_experts"]`: base64 of int32 [tokens - 1, layers, topk]) through slime's own
`Sample.append_response_tokens` and
`validate_rollout_routed_experts_for_replay`, then slime's `prepare_routed_experts_for_routing_replay` packs them
for the micro-batch (the vendored slime 624b824a8). The trainer: megatron-core 0.16.1's GPTModel with
`moe_enable_routing_replay`, its `RouterReplay` in `REPLAY_FORWARD`, on a packed THD micro-batch, traced by
tic-trace. Faults go into what the trainer computes, never into the recorded data.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import numpy as np
import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch
import transformers

import tic_trace
from tic_trace.adapters import sglang as sga
from tic_trace.adapters.megatron import MegatronAdapter
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.compare.routing_replay import (
    WEIGHT_TOL, AppliedLayer, applied_from_packed, applied_from_view, check_routing_replay,
)
from tic_trace.store.errors import TraceFormatError
from tic_trace.store.routed_experts import RoutedExperts, read_routed_experts, write_routed_experts
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
from tic_trace.testing import child
from tic_trace.testing.slime_vendor import MEGATRON_ENV, SLIME_ENV, sources
from tic_trace.view.align import CanonicalView

from conftest import require_vendored_sources

LAYERS, EXPERTS, TOPK = 3, 8, 2
KEYS = ["0-0", "0-1"]
SEQ = 9                       # tokens per sample: a prompt of PROMPT, then the response
PROMPT = 5
FAULT_LAYER = 1


def _slime_root() -> Path:
    return next(s.path for s in sources() if s.name == "slime")


@contextmanager
def _slime_on_path():
    """slime's package importable for the block, then forgotten (no Megatron-LM: these modules import only
    torch and megatron.core's parallel_state, which the wheel provides)."""
    root = str(_slime_root())
    ours = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "slime" or m.startswith("slime.")}
    sys.path.insert(0, root)
    try:
        yield
    finally:
        sys.path.remove(root)
        for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
            del sys.modules[name]
        sys.modules.update(ours)        # whatever another test had imported under that name, as it was


def _slime_cp_utils():
    """slime's `slime/backends/megatron_utils/cp_utils.py`, loaded from its file (its package's __init__ sets up
    accelerators; this module needs only torch and megatron.core.mpu)."""
    path = _slime_root() / "slime/backends/megatron_utils/cp_utils.py"
    spec = importlib.util.spec_from_file_location("_slime_cp_utils_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg():
    return tiny_qwen3_config(moe=True, num_hidden_layers=LAYERS, num_experts=EXPERTS, num_experts_per_tok=TOPK)


# ---------------------------------------------------------------- the engine and what slime hands the trainer

class _Capturer:
    """Stands in for the buffer of SGLang's RoutedExpertsCapturer only: SGLang's own capture site
    (`capture_routed_experts_if_allowed` in layers/moe/topk.py, called by `select_experts`) hands it each MoE
    layer's `topk_ids` of a forward, its rows in the forward's order; the real one writes them into a buffer by KV
    slot and returns a request's rows when it finishes (`meta_info["routed_experts"]`)."""

    def __init__(self):
        self.calls: list[tuple[int, torch.Tensor]] = []

    def capture(self, layer_id, topk_indices):
        self.calls.append((int(layer_id), topk_indices.detach().clone()))


def _per_row(records, calls) -> dict:
    """(sample, position) -> [layers, k] from each forward's captures (one per MoE layer, in layer order)."""
    assert len(calls) == len(records) * LAYERS, (len(calls), len(records))
    out: dict = {}
    for f, rec in enumerate(records):
        mine = calls[f * LAYERS:(f + 1) * LAYERS]
        assert [c[0] for c in mine] == list(range(LAYERS))
        for i, row in enumerate(rec.row_keys):
            out[row] = np.stack([c[1][i].numpy() for c in mine])
    return out


def _sglang_rollout(hf, ids, out: Path):
    """SGLang 0.5.23's Qwen3-MoE (its model code and weight loading, on CPU) generates each sample's response
    (forced to the given tokens) with its routed-experts capture on, traced. Returns the trace directory, the ids
    it captured and the top-k weights its router gave, per (sample, position)."""
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer
    hf.save_pretrained(out / "ck")
    sc.init_sglang_distributed(tp_size=1)
    cap, weights = _Capturer(), []
    try:
        model = sc.build_sglang_model(transformers.AutoConfig.from_pretrained(str(out / "ck")), str(out / "ck"),
                                      dtype=torch.float32)
        for i, layer in enumerate(model.model.layers):
            layer.mlp.topk.register_forward_hook(
                lambda m, a, o, i=i: weights.append((i, o.topk_weights.detach().clone())))
        set_global_experts_capturer(cap)
        engine = sc.SGLangRollout(model)
        with sga.trace_forwards(model, out / "sg", points_mode="full") as t:
            res = engine.generate({k: ids[b, :PROMPT].tolist() for b, k in enumerate(KEYS)}, SEQ - PROMPT - 1,
                                  forced_tokens={k: ids[b, PROMPT:].tolist() for b, k in enumerate(KEYS)})
        assert t.failed is None, t.failed
        assert res.outputs == {k: ids[b, PROMPT:].tolist() for b, k in enumerate(KEYS)}
    finally:
        set_global_experts_capturer(None)
        sga.close_sessions()
        sc.destroy_sglang_distributed()
    return out / "sg", _per_row(engine.records, cap.calls), _per_row(engine.records, weights)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The engine's rollout, traced, and its routed experts per sample as slime's Sample holds them."""
    require_vendored_sources()
    cfg = _cfg()
    hf = build_hf_model(cfg, seed=3)
    ids = sample_tokens(len(KEYS), SEQ, seed=5)
    trace, routed_rows, weights = _sglang_rollout(hf, ids, tmp_path_factory.mktemp("engine"))
    args = SimpleNamespace(num_layers=LAYERS, moe_router_topk=TOPK, moe_layer_freq=None)
    with _slime_on_path():
        from slime.observability.rollout_data_utils import validate_rollout_routed_experts_for_replay
        from slime.utils.types import Sample
        samples = []
        for b, key in enumerate(KEYS):
            s = Sample(tokens=ids[b, :PROMPT].tolist())
            # what SGLang returns: every token it computed (prompt and response, not the last one sampled), as
            # base64 of int32 [tokens - 1, layers, topk]
            arr = np.stack([routed_rows[(key, p)] for p in range(SEQ - 1)]).astype("<i4")
            wire = base64.b64encode(arr.tobytes()).decode("ascii")
            s.append_response_tokens(args, tokens=ids[b, PROMPT:].tolist(), log_probs=[-1.0] * (SEQ - PROMPT),
                                     meta_info={"routed_experts": wire}, update_terminal_info=False)
            samples.append(s)
        routed = [torch.as_tensor(s.rollout_routed_experts) for s in samples]
        validate_rollout_routed_experts_for_replay(routed, args)
    return SimpleNamespace(cfg=cfg, hf=hf, ids=ids, trace=str(trace), routed=routed, weights=weights,
                           rollout={k: r.numpy() for k, r in zip(KEYS, routed)})


# ---------------------------------------------------------------- the trainer

def _train_forward(engine, out: Path, fault: str | None = None) -> dict:
    """megatron-core's forward of the packed micro-batch with R3 on (optionally a fault in its computation),
    traced into `out`. Returns, per layer, the ids its router replay applied (in their slot order), and the ids
    its router chose itself where a layer records instead of replaying."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    RouterReplay.clear_global_router_replay_instances()
    overrides = {"moe_enable_routing_replay": True}
    model = mc.per_segment_thd_attention(mc.build_gpt_model(engine.cfg, **overrides))
    sd = hf_to_megatron_state_dict(engine.hf.state_dict(), engine.cfg)
    if fault in ("dropped", "weights"):
        # the trainer's router of this layer scores differently from the engine's (e.g. moved by a step)
        name = f"decoder.layers.{FAULT_LAYER}.mlp.router.weight"
        sd[name] = sd[name] + 0.5 * torch.randn(sd[name].shape, generator=torch.Generator().manual_seed(7))
    load_into(model, sd)
    tokens = engine.ids.reshape(1, -1)
    with _slime_on_path():
        packed = _slime_cp_utils().prepare_routed_experts_for_routing_replay(
            engine.routed, list(engine.ids), num_experts=EXPERTS, data_pad_size_multiplier=1,
            sequence_parallel=False, allgather_cp=False)
    replays = RouterReplay.global_router_replay_instances
    assert len(replays) == LAYERS
    targets = [packed[:, layer].long() for layer in range(LAYERS)]
    if fault == "order":   # a conversion that sorts each token's ids before handing them to the router
        targets[FAULT_LAYER] = targets[FAULT_LAYER].sort(dim=-1).values
    RouterReplay.set_replay_data(targets)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    if fault == "dropped":  # this layer's router is not replayed: it chooses (and records) its own experts
        replays[FAULT_LAYER].set_router_replay_action(RouterReplayAction.RECORD)
    applied, scores = _capture_replayed(replays)
    cu = torch.tensor([0, SEQ, 2 * SEQ], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
    pos = torch.cat([torch.arange(SEQ)] * len(KEYS)).unsqueeze(0)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=engine.cfg.vocab_size), points_mode="full",
                         sample_keys=KEYS) as t, torch.no_grad():
        model(tokens, pos, attention_mask=None, packed_seq_params=psp)
    assert t.failed is None, t.failed
    own = {i: r.recorded_topk_idx for i, r in enumerate(replays) if r.recorded_topk_idx is not None}
    RouterReplay.clear_global_router_replay_instances()
    return {"applied": applied, "scores": scores, "own": own}


def _capture_replayed(replays) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """What each router's replay returned in this forward: its top-k ids and the scores it gathered at them
    (a recording, not a change)."""
    got: dict[int, torch.Tensor] = {}
    scores: dict[int, torch.Tensor] = {}
    for i, r in enumerate(replays):
        def wrapped(*a, _orig=r.get_replay_topk, _i=i, **kw):
            probs, idx = _orig(*a, **kw)
            got[_i], scores[_i] = idx.detach().clone(), probs.detach().clone()
            return probs, idx
        r.get_replay_topk = wrapped
    return got, scores


@pytest.fixture(scope="module")
def trainer(engine, tmp_path_factory, megatron_rank):
    runs = {}

    def get(fault):
        if fault not in runs:
            out = tmp_path_factory.mktemp(f"trainer_{fault}") / "mg"
            runs[fault] = (str(out), _train_forward(engine, out, fault))
        return runs[fault]
    return get


def _check(engine, trace: str, captured: dict | None = None):
    """The R3 check from the trainer's trace (ids, weights against the engine's trace) and, when given, the ids
    its router replay applied in their slot order."""
    applied = applied_from_view(CanonicalView(trace))
    if captured is not None:
        segs = [(k, SEQ) for k in KEYS]
        for layer, ids in captured.items():
            ordered = applied_from_packed(layer, ids.numpy(), segs)
            applied[layer] = AppliedLayer(layer, ordered.rows, ordered.ids,
                                          _weights_at(applied[layer], ordered), ordered=True)
    return check_routing_replay(engine.rollout, applied, applied_from_view(CanonicalView(engine.trace)))


def _weights_at(sorted_layer: AppliedLayer, ordered: AppliedLayer) -> np.ndarray:
    """The traced weights (of the sorted ids) put in the slot order of the replayed ids."""
    at = {r: i for i, r in enumerate(sorted_layer.rows)}
    out = np.empty(ordered.ids.shape)
    for n, (row, ids) in enumerate(zip(ordered.rows, ordered.ids)):
        i = at[row]
        w = dict(zip(sorted_layer.ids[i].tolist(), sorted_layer.weights[i]))
        out[n] = [w[int(x)] for x in ids]
    return out


def _rollout_rows(engine) -> set:
    return {(k, p) for k in KEYS for p in range(SEQ - 1)}


# ---------------------------------------------------------------- cases

def test_r3_on_ids_applied_clean(engine, trainer):
    trace, run = trainer(None)
    res = _check(engine, trace, run["applied"])
    assert res.clean, res.summary
    assert [lc.layer for lc in res.layers] == list(range(LAYERS)) and not res.not_checked
    for lc in res.layers:
        assert lc.rows_checked == len(_rollout_rows(engine)) and lc.order_checked and lc.weights_checked
    assert res.differing_rows() == frozenset() and res.notes == ()
    assert res.summary == f"R3: ids applied in {LAYERS} of {LAYERS} layers"
    # from the trace alone the slot order is not checked, and said
    only_trace = _check(engine, trace)
    assert only_trace.clean and "slot order not checked" in only_trace.summary


def test_r3_ids_dropped_in_one_layer(engine, trainer):
    trace, run = trainer("dropped")
    own = run["own"][FAULT_LAYER]                # what the un-replayed router chose itself, packed rows
    want = set()
    for b, key in enumerate(KEYS):
        for p in range(SEQ - 1):
            if sorted(own[b * SEQ + p].tolist()) != sorted(engine.rollout[key][p, FAULT_LAYER].tolist()):
                want.add((key, p))
    assert want, "the planted fault must change some rows' experts"
    res = _check(engine, trace)
    assert res.layers_with("ids") == [FAULT_LAYER], res.summary
    lc = res.layers[FAULT_LAYER]
    assert lc.rows_of("ids") == want and {(d.sample, d.position) for d in lc.of_kind("ids")} == want
    assert res.differing_rows(["ids"]) == frozenset(want)
    d = lc.of_kind("ids")[0]
    assert d.detail.startswith("dropped ") and set(d.rollout) != set(d.applied)
    assert res.summary.startswith(f"R3: ids applied in {LAYERS - 1} of {LAYERS} layers; ids differ in layer "
                                  f"{FAULT_LAYER} ({len(want)} rows)")


def test_r3_slot_order_differs(engine, trainer):
    trace, run = trainer("order")
    want = {(k, p) for k in KEYS for p in range(SEQ - 1)
            if list(engine.rollout[k][p, FAULT_LAYER]) != sorted(engine.rollout[k][p, FAULT_LAYER])}
    assert want, "the engine's descending-weight order must leave some rows unsorted"
    res = _check(engine, trace, run["applied"])
    assert res.layers_with("order") == [FAULT_LAYER] and not res.layers_with("ids"), res.summary
    assert res.layers[FAULT_LAYER].rows_of("order") == want
    # megatron scatters the replayed ids into a dense map: its weights do not depend on their order
    assert not res.layers_with("weights")
    assert f"slot order differs in layer {FAULT_LAYER} ({len(want)} rows)" in res.summary


def test_r3_weights_differ_with_ids_equal(engine, trainer):
    trace, run = trainer("weights")
    res = _check(engine, trace, run["applied"])
    assert not res.layers_with("ids") and not res.layers_with("order"), res.summary
    # the ids held because they were replayed: the trainer's own router would have chosen others in some rows
    logits = CanonicalView(trace).load("moe.router_logits", FAULT_LAYER)
    own = {r: sorted(np.argsort(-v)[:TOPK].tolist()) for r, v in zip(logits.rows, logits.values)}
    assert any(own[(k, p)] != sorted(engine.rollout[k][p, FAULT_LAYER].tolist()) for k, p in _rollout_rows(engine))
    assert res.layers_with("weights") == [FAULT_LAYER]
    rows = res.layers[FAULT_LAYER].rows_of("weights")
    assert {(d.sample, d.position) for d in res.layers[FAULT_LAYER].of_kind("weights")} == rows
    # the rows where the weights megatron made of its replayed scores (softmax over the k, moe_utils'
    # topk_routing_with_score_function) are off the engine router's, both in slot order
    trained = torch.softmax(run["scores"][FAULT_LAYER], dim=-1, dtype=torch.float32).numpy()
    want = set()
    for b, key in enumerate(KEYS):
        for p in range(SEQ - 1):
            e = engine.weights[(key, p)][FAULT_LAYER]
            if np.linalg.norm(trained[b * SEQ + p] - e) / np.linalg.norm(e) > WEIGHT_TOL:
                want.add((key, p))
    assert rows == want and want
    assert res.differing_rows() == frozenset(rows)
    assert f"weights differ in layer {FAULT_LAYER}" in res.summary


def test_recorded_where_slime_hands_them_to_megatron_and_checked_per_rollout(engine, trainer, tmp_path):
    """The train side's record (integrations/slime/routing_replay.py) of slime's rollout_data, read back and
    checked from the rollout directory's layout."""
    from tic_trace.compare.routing_replay import check_rollout
    from tic_trace.integrations.slime.routing_replay import record_rollout_routed_experts, routed_experts_path
    args = SimpleNamespace(tic_trace=True, tic_trace_dir=str(tmp_path), tic_trace_rollout_ids=[0], tic_trace_every=0,
                           tic_trace_mode="rows", tic_trace_max_samples=2, rollout_batch_size=2, n_samples_per_prompt=2)
    # this DP rank's share of rollout 0 as _split_train_data_by_dp ships it: samples 0, 1 traced, 3 not
    data = {"sample_indices": [0, 1, 3], "rollout_routed_experts": [*engine.routed, engine.routed[0]]}
    assert record_rollout_routed_experts(args, 0, data, rank=0) == 2
    assert record_rollout_routed_experts(args, 1, data, rank=0) == 0          # rollout 1 is not traced
    assert set(read_routed_experts(routed_experts_path(tmp_path, 0, 0)).samples) == set(KEYS)
    trace, _ = trainer("dropped")
    res = check_rollout(tmp_path / "rollout_00000", trainer=CanonicalView(trace), engine=CanonicalView(engine.trace))
    assert res.layers_with("ids") == [FAULT_LAYER], res.summary
    assert res.as_dict()["layers"][FAULT_LAYER]["diffs"][0]["kind"] == "ids"
    assert check_rollout(tmp_path / "rollout_00001", trainer=CanonicalView(trace)) is None   # nothing recorded
    # slime-report's reconciliation reads the same directory: the check, and its JSON form
    from tic_trace.tools.slime_reconcile import routing_replay
    r3, note = routing_replay(tmp_path / "rollout_00000",
                              {"megatron": CanonicalView(trace), "sglang": CanonicalView(engine.trace)})
    assert note is None and r3.summary == res.summary
    assert json.loads(json.dumps(r3.as_dict()))["summary"] == res.summary


def test_recording_wraps_slimes_own_fill_routing_replay(tmp_path):
    """megatron_init's patches wrap slime's MegatronTrainRayActor.fill_routing_replay: the traced sample's ids are
    written, then slime's own function runs on them (its own process: the vendored Megatron-LM must not meet the
    megatron-core wheel)."""
    require_vendored_sources()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for s in sources():
        env[MEGATRON_ENV if s.name == "Megatron-LM" else SLIME_ENV] = str(s.path)
    script = Path(__file__).with_name("routing_replay_slime_script.py")
    r = child.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                  cwd=script.parents[1], env=env)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["wrapped"] and res["slime_consumed"], res
    assert res["files"] == 1 and res["samples"] == ["0-0"] and res["equal"], res   # sample 1 is not traced


# ---------------------------------------------------------------- without megatron

def test_the_disk_budget_prunes_the_routed_experts_with_the_traces(tmp_path):
    from tic_trace.integrations.slime.budget import PRUNED_MARK, prune
    from tic_trace.integrations.slime.routing_replay import routed_experts_path
    args = SimpleNamespace(tic_trace_dir=str(tmp_path), tic_trace_rollout_ids=[0, 1], tic_trace_every=0,
                           tic_trace_mode=None, tic_trace_disk_budget=3000)
    for rid in (0, 1):
        (tmp_path / f"rollout_{rid:05d}" / "megatron").mkdir(parents=True)
        (tmp_path / f"rollout_{rid:05d}" / "megatron" / "pass00000.bin").write_bytes(b"x" * 1000)
        write_routed_experts(routed_experts_path(tmp_path, rid, 0),
                             RoutedExperts(rid, "test", {f"{rid}-0": np.zeros((100, 2, 2), np.int32)}))
    assert prune(args, keep=1) == [0]
    assert (tmp_path / "rollout_00000" / PRUNED_MARK).is_file()
    assert not routed_experts_path(tmp_path, 0, 0).exists() and routed_experts_path(tmp_path, 1, 0).exists()


def test_a_layer_without_trainer_trace_is_not_checked_never_agreeing():
    rollout = {"0-0": np.array([[[1, 2], [3, 0]], [[2, 1], [0, 3]]], dtype=np.int32)}   # 2 rows, 2 layers
    rows = [("0-0", 0), ("0-0", 1)]
    applied = {0: AppliedLayer(0, rows, np.array([[1, 2], [1, 2]]))}
    res = check_routing_replay(rollout, applied)
    assert [lc.status for lc in res.layers] == ["applied", "not_checked"] and not res.clean
    assert res.not_checked == [1]
    assert "ids applied in 1 of 2 layers" in res.summary and "not checked: layer 1" in res.summary
    with pytest.raises(ValueError, match="no rollout routed experts"):
        check_routing_replay({}, applied)
    # a trainer trace of some rows only (a `subset` trace): the others are missing, not applied
    part = check_routing_replay(rollout, {0: AppliedLayer(0, rows[:1], np.array([[2, 1]]))}, layers=[0])
    assert part.layers[0].rows_checked == 1 and part.layers[0].rows_missing == 1
    assert "1 of 2 (layer, row) pairs not in the trainer's trace" in part.summary


def test_nothing_recorded_for_a_statistics_only_rollout(tmp_path):
    from tic_trace.integrations.slime.routing_replay import record_rollout_routed_experts
    data = {"sample_indices": [0], "rollout_routed_experts": [np.ones((3, 2, 2), np.int32)]}
    args = SimpleNamespace(tic_trace=True, tic_trace_dir=str(tmp_path), tic_trace_rollout_ids=[0], tic_trace_every=5,
                           tic_trace_mode=None, tic_trace_periodic_mode="stats", tic_trace_max_samples=1)
    assert record_rollout_routed_experts(args, 0, data) == 1          # listed: rows
    assert record_rollout_routed_experts(args, 5, data) == 0          # periodic, statistics only
    assert not (tmp_path / "rollout_00005").exists()


def test_an_engine_trace_that_routed_otherwise_than_it_returned_is_noted():
    rollout = {"0-0": np.array([[[1, 2]], [[2, 3]]], dtype=np.int32)}
    rows = [("0-0", 0), ("0-0", 1)]
    w = np.full((2, 2), 0.5)
    trainer = {0: AppliedLayer(0, rows, np.array([[1, 2], [2, 3]]), w)}
    engine = {0: AppliedLayer(0, rows, np.array([[1, 2], [0, 3]]), w)}
    res = check_routing_replay(rollout, trainer, engine)
    assert res.clean and res.engine_off == {0: 1}
    assert "the engine's trace disagrees with its returned ids in layer 0 (1 rows)" in res.summary
    assert res.notes == ("layer 0: the engine's trace routed 1 of 2 rows otherwise than the ids it "
                                       "returned (the returned record does not match the traced forward there; "
                                       "weights not compared at those rows)",)


def test_every_differing_row_is_kept_and_a_bounded_number_described():
    from tic_trace.compare.routing_replay import DETAILED
    n = 3 * DETAILED
    rollout = {"0-0": np.tile(np.array([[[1, 2]]], dtype=np.int32), (n, 1, 1))}
    applied = {0: AppliedLayer(0, [("0-0", p) for p in range(n)], np.tile(np.array([[1, 3]]), (n, 1)))}
    res = check_routing_replay(rollout, applied)
    lc = res.layers[0]
    assert len(lc.rows_of("ids")) == n and len(lc.of_kind("ids")) == DETAILED
    assert res.differing_rows() == frozenset(("0-0", p) for p in range(n))
    assert res.as_dict()["layers"][0]["differing"]["ids"] == n and f"ids differ in layer 0 ({n} rows)" in res.summary


def test_routed_experts_file_round_trip_and_bad_input(tmp_path):
    a = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    p = tmp_path / "rank00000.routed_experts.msgpack"
    write_routed_experts(p, RoutedExperts(4, "test", {"4-1": a}))
    back = read_routed_experts(p)
    assert back.rollout_id == 4 and np.array_equal(back.samples["4-1"], a)
    bad = tmp_path / "bad.routed_experts.msgpack"
    bad.write_bytes(b"\x81\xa6format\xa3xyz")
    with pytest.raises(TraceFormatError, match="not a tic-trace routed-experts file") as e:
        read_routed_experts(bad)
    assert str(bad) in str(e.value)
    import msgpack
    short = msgpack.packb({"format": "tic-trace routed experts", "version": 1, "rollout_id": 0, "source": "",
                           "samples": [{"key": "0-0", "shape": [2, 3, 2], "ids": b"\0" * 8}]})
    bad.write_bytes(short)
    with pytest.raises(TraceFormatError, match=r"8 bytes of ids, shape \[2, 3, 2\] needs 48"):
        read_routed_experts(bad)
    flipped = bytearray(p.read_bytes())
    at = flipped.index(a.tobytes()) + 5            # one bit of one id
    flipped[at] ^= 1
    bad.write_bytes(bytes(flipped))
    with pytest.raises(TraceFormatError, match="checksum mismatch: the file is corrupted"):
        read_routed_experts(bad)
