"""The SGLang adapter on real SGLang 0.5.23 model code (CPU): an SGLang rollout (prefill + decode steps, two
requests of different lengths batched, responses forced to fixed tokens) meets one Megatron forward over
the full sequences and an HF forward, row by row per (request, position), at every canonical point both
sides have; planted faults on the SGLang side (including one that only exists in decode steps) are found at
their point and layer; chunked prefill and a partly cached prefix still align; TP=2 traces (two gloo ranks,
traced through SGLang's own ``--forward-hooks`` mechanism) reassemble to TP=1; the hook factory and the
slime-facing ``forward_hooks_spec`` (per-rollout directories, chosen samples only); name tables of
DeepSeek-V2/V3 and GLM-4-MoE on module trees built on the meta device.

Order matters in this process: the Megatron reference trace is made first (megatron's gloo group is torn
down again) and then SGLang's distributed state is initialised for the rest of the module.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import types

import numpy as np
import pytest
import torch

import sglang  # noqa: E402,F401 - a required test dependency: fail loudly if missing
import megatron.core  # noqa: E402,F401 - a required test dependency: fail loudly if missing

import tic_trace  # noqa: E402
from tic_trace.graph.adapter import get_adapter  # noqa: E402
from tic_trace.adapters import sglang as sga  # noqa: E402
from tic_trace.adapters import sglang_server as sgs  # noqa: E402
from tic_trace.adapters.megatron import MegatronAdapter  # noqa: E402
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into  # noqa: E402
from tic_trace.adapters.sglang import (  # noqa: E402
    ARCH_MODULES, ARCH_OF_CLASS, POINTS, SGLangAdapter, close_sessions, forward_hooks_spec, record_module,
    tracing_problems)
from tic_trace.view.align import CanonicalView, align_rows  # noqa: E402
from tic_trace.graph.canonical import key_name  # noqa: E402
from tic_trace import find_divergence  # noqa: E402
from tic_trace.compare.diverge import DEFAULT_TOL, rejudge  # noqa: E402
from tic_trace.testing import megatron_cpu as mc  # noqa: E402
from tic_trace.testing import sglang_cpu as sc  # noqa: E402
from tic_trace.testing.faults import FAULTS, hf_faults, plant, prepare, sglang_faults  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config  # noqa: E402
from tic_trace.testing.sglang_versions import moe_block_reduces_itself  # noqa: E402

PROMPTS = {"req-a": [3, 5, 7, 9, 11], "req-b": [2, 4, 6, 8, 10, 12, 14, 16]}
RESPONSES = {"req-a": [20, 21, 22, 23, 24], "req-b": [30, 31, 32, 33, 34]}
DECODE = 4                       # decode steps: response tokens 0..3 are fed, token 4 is sampled, never fed
FAULT_LAYER = 1
SEQS = {rid: PROMPTS[rid] + RESPONSES[rid] for rid in PROMPTS}
N_PROMPT = sum(len(p) for p in PROMPTS.values())                    # 13 prompt rows
SG_ROWS = N_PROMPT + DECODE * len(PROMPTS)                          # 21 rows SGLang computes
MG_ROWS = sum(len(s) for s in SEQS.values())                        # 23 rows of the full sequences
SG_LOGIT_ROWS = (1 + DECODE) * len(PROMPTS)                         # last prompt row + each decode row
SG_LOGPROB_ROWS = DECODE * len(PROMPTS)                             # ... whose next token SGLang was fed


# ------------------------------------------------------------------------------------------------
# helpers (also used in the spawned TP ranks)
# ------------------------------------------------------------------------------------------------

def moe_cfg():
    return tiny_qwen3_config(moe=True)


@contextlib.contextmanager
def traced_engine(model, out, eng=None, **trace_kw):
    """An SGLang engine over `model` whose forwards (and only those: not the engine's KV bookkeeping between
    them) are traced into `out`, one pass each."""
    trace_kw.setdefault("points_mode", "full")
    eng = eng or sc.SGLangRollout(model)
    with sgs.trace_forwards(model, out, **trace_kw) as t:
        yield t, eng
    assert t.failed is None, t.failed
    assert "forward" not in vars(model)


def rollout(model, out, *, chunked=None, fault=None, **trace_kw):
    """One traced SGLang rollout (prefill + DECODE decode steps, forced responses) of `model` into `out`."""
    if fault is not None:
        plant(model, "sglang", fault, FAULT_LAYER)
    with traced_engine(model, out, **trace_kw) as (_, eng):
        res = eng.generate(PROMPTS, DECODE, forced_tokens=RESPONSES, chunked_prefill_size=chunked)
    assert res.outputs == RESPONSES
    return res


def trace_megatron(out, cfg, hf_sd, seqs):
    """One Megatron forward (local spec, TP1, SBHD ``[s, b]`` with one batch column per sample, right-padded;
    the padding rows get no key) over the full prompt+response sequences."""
    keys = list(seqs)
    length = max(len(s) for s in seqs.values())
    ids = torch.zeros(len(keys), length, dtype=torch.long)
    for b, k in enumerate(keys):
        ids[b, :len(seqs[k])] = torch.tensor(seqs[k])
    rk, rp, rt = [], [], []
    for s in range(length):                         # megatron rows are s-major
        for b, k in enumerate(keys):
            rk.append(k if s < len(seqs[k]) else None)
            rp.append(s)
            rt.append(int(ids[b, s]))
    mc.init_parallel(0, 1)
    try:
        model = mc.build_gpt_model(cfg)
        load_into(model, hf_to_megatron_state_dict(hf_sd, cfg))
        pos = torch.arange(length).unsqueeze(0).expand(len(keys), -1)
        with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=cfg.vocab_size),
                             points_mode="full") as t, torch.no_grad():
            t.set_rows(rk, rp, rt)                  # causal attention: right padding cannot reach real rows
            model(ids, pos, attention_mask=None)
        assert t.failed is None, t.failed
    finally:
        mc.destroy(remove_patches=True)


def _detail(rep):
    return [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]


def _promised(v: CanonicalView) -> set[str]:
    return set(v.adapter.promised_points(v.config)) | {"logprobs"}


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    return build_hf_model(moe_cfg(), seed=0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_adapter")


@pytest.fixture(scope="module")
def mg_trace(root, hf):
    out = root / "megatron"
    trace_megatron(out, hf.config, hf.state_dict(), SEQS)
    return out


@pytest.fixture(scope="module")
def hf_trace(root, hf):
    out = root / "hf"
    with tic_trace.trace(hf, out, adapter="hf", points_mode="full") as t, torch.no_grad():
        for rid, seq in SEQS.items():
            t.sample_keys = [rid]
            hf(torch.tensor([seq]))
            t.step()
    assert t.failed is None
    return out


@pytest.fixture(scope="module")
def hf_tied(hf):
    """The model with experts NEAR_TIE of layer FAULT_LAYER nearly tied (the routing_near_tie setup)."""
    tied = copy.deepcopy(hf)
    prepare(tied, "hf", "routing_near_tie", FAULT_LAYER)
    return tied


@pytest.fixture(scope="module")
def mg_tied_trace(root, hf_tied):
    out = root / "megatron_tied"
    trace_megatron(out, hf_tied.config, hf_tied.state_dict(), SEQS)
    return out


@pytest.fixture(scope="module")
def sglang_env(mg_trace, mg_tied_trace):
    """SGLang TP=1 in this process (after the Megatron trace: one torch.distributed group at a time)."""
    sc.init_sglang_distributed(tp_size=1)
    yield
    close_sessions()
    sc.destroy_sglang_distributed()


@pytest.fixture(scope="module")
def weights(sglang_env, hf):
    return sc.hf_checkpoint_weights(hf)


@pytest.fixture
def new_model(weights):
    return lambda: sc.build_sglang_model(moe_cfg(), weights)


@pytest.fixture(scope="module")
def sg_trace(root, weights):
    out = root / "sglang"
    res = rollout(sc.build_sglang_model(moe_cfg(), weights), out)
    return out, res


# ------------------------------------------------------------------------------------------------
# SGLang rollout vs Megatron / HF, fp32
# ------------------------------------------------------------------------------------------------

def test_sglang_vs_megatron_consistent_at_every_point(mg_trace, sg_trace):
    va, vb = CanonicalView(str(mg_trace)), CanonicalView(str(sg_trace[0]))
    rep = find_divergence(va, vb)
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.not_comparable == []
    assert {p.point for p in rep.points} == _promised(va) == _promised(vb)
    n_layers = vb.n_layers
    layered = {pm.point for pm in POINTS} & _promised(vb) - {"embed", "final_norm", "logits", "logprobs"}
    assert len(rep.points) == len(layered) * n_layers + 4
    # rows: SGLang computes every prompt row and one row per decode step; Megatron also the last response
    # token (sampled by SGLang, never fed back): counted as rows of A that match no row of B, after B's positions
    assert _counts(rep.rows) == {"a": MG_ROWS, "b": SG_ROWS, "matched": SG_ROWS, "unmatched_a": MG_ROWS - SG_ROWS,
                                 "unmatched_b": 0}
    assert rep.identity["unmatched"]["a"]["outside"] == MG_ROWS - SG_ROWS
    for p in rep.points:
        if p.point == "logits":         # SGLang's LogitsProcessor: last prompt row + decode rows only
            assert (p.rows, p.only_a, p.only_b) == (SG_LOGIT_ROWS, MG_ROWS - SG_LOGIT_ROWS, 0), p.key
        elif p.point == "logprobs":     # ... and of those, rows whose next token was fed back
            assert (p.rows, p.only_a, p.only_b) == (SG_LOGPROB_ROWS, MG_ROWS - len(PROMPTS) - SG_LOGPROB_ROWS, 0)
        else:
            assert (p.rows, p.only_a, p.only_b) == (SG_ROWS, MG_ROWS - SG_ROWS, 0), p.key
    assert max(p.error for p in rep.points) < 1e-5


def test_sglang_vs_hf_consistent(hf_trace, sg_trace):
    rep = find_divergence(str(hf_trace), str(sg_trace[0]))
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.not_comparable == []
    assert _counts(rep.rows) == {"a": MG_ROWS, "b": SG_ROWS, "matched": SG_ROWS, "unmatched_a": MG_ROWS - SG_ROWS,
                                 "unmatched_b": 0}
    assert max(p.error for p in rep.points) < 1e-5


def test_rows_passes_and_residual_identities(sg_trace):
    out, res = sg_trace
    v = CanonicalView(str(out))
    assert v.adapter.name == "sglang" and v.config["attention"] == "mha" and v.config["qk_norm"]
    assert {p for p, _ in v.points()} == _promised(v)           # promises only what it produces
    # the row table of every pass is the engine's (request, position) per row; tokens are the fed ids
    assert v.trace.pass_indices(0) == list(range(1 + DECODE))
    for i, rec in enumerate(res.records):
        rows = v.trace.open_pass(0, i).rows
        assert list(zip(rows["keys"], rows["positions"])) == rec.row_keys
        assert rows["tokens"] == rec.input_ids.tolist()
    # logits rows: the last prompt row of each request, then each decode row
    want = sorted((rid, len(p) - 1 + j) for rid, p in PROMPTS.items() for j in range(DECODE + 1))
    lg = v.load("logits", None)
    assert sorted(lg.rows) == want and lg.values.shape == (SG_LOGIT_ROWS, 128)
    by_pos = res.next_token_logits_by_position()
    for i, r in enumerate(lg.rows):
        np.testing.assert_array_equal(lg.values[i], by_pos[r].numpy())
    # the residual stream taken from the norms' second outputs adds up
    for lay in range(2):
        inp, att, mid, mlp, out_ = (v.load(p, lay).values for p in ("input", "attn.out", "mid", "mlp.out", "output"))
        np.testing.assert_allclose(inp + att, mid, rtol=0, atol=1e-6)
        np.testing.assert_allclose(mid + mlp, out_, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(v.load("output", 0).values, v.load("input", 1).values)
    np.testing.assert_array_equal(v.load("input", 0).values, v.load("embed", None).values)


def test_dense_qwen3_consistent_with_hf(tmp_path, sglang_env):
    cfg = tiny_qwen3_config(moe=False)
    hf = build_hf_model(cfg, seed=3)
    with tic_trace.trace(hf, tmp_path / "hf", adapter="hf", points_mode="full") as t, torch.no_grad():
        for rid, seq in SEQS.items():
            t.sample_keys = [rid]
            hf(torch.tensor([seq]))
            t.step()
    model = sc.build_sglang_model(cfg, hf)
    rollout(model, tmp_path / "sg")
    vb = CanonicalView(str(tmp_path / "sg"))
    assert not any(p.startswith("moe.") for p in vb.adapter.promised_points(vb.config))
    assert {p for p, _ in vb.points()} == _promised(vb)
    rep = find_divergence(str(tmp_path / "hf"), vb)
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.not_comparable == [] and rep.rows["matched"] == SG_ROWS


# ------------------------------------------------------------------------------------------------
# planted faults on the SGLang side
# ------------------------------------------------------------------------------------------------

def test_every_hf_fault_has_an_sglang_planter():
    assert set(hf_faults(moe=True)) <= set(sglang_faults(moe=True))
    assert "decode_only_scale" in sglang_faults(moe=False)


@pytest.mark.parametrize("fault", sglang_faults(moe=True))
def test_planted_fault_found_at_its_point_and_layer(tmp_path, mg_trace, new_model, fault):
    f = FAULTS[fault]
    rollout(new_model(), tmp_path / "sg", fault=fault)
    va, vb = CanonicalView(str(mg_trace)), CanonicalView(str(tmp_path / "sg"))
    rep = find_divergence(va, vb)
    assert rep.verdict == "divergent"
    assert rep.first["key"] == key_name(f.point, FAULT_LAYER if f.layered else None), rep.first["key"]
    cause = rep.first["cause"]
    assert cause == f.cause or (f.point == "moe.router_logits" and cause == "routing"), cause
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc
    if fault == "decode_only_scale":
        # only the decode rows diverge at the point: prefill rows are bitwise what they were
        pair = align_rows(va.load(f.point, FAULT_LAYER), vb.load(f.point, FAULT_LAYER))
        err = np.linalg.norm((pair.a - pair.b).reshape(len(pair.rows), -1), axis=1) / \
            np.linalg.norm(pair.a.reshape(len(pair.rows), -1), axis=1)
        bad = {r for r, e in zip(pair.rows, err) if e > DEFAULT_TOL["float32"]}
        decode_rows = {(rid, len(p) + j) for rid, p in PROMPTS.items() for j in range(DECODE)}
        assert bad == decode_rows
        assert rep.first["rows"] == SG_ROWS


@pytest.mark.parametrize("fault", ["routing_near_tie", "routing_near_tie_decode"])
def test_near_tie_routing_megatron_vs_sglang(tmp_path, mg_tied_trace, hf_tied, sglang_env, fault):
    """Both models with two nearly tied experts; SGLang's gate rounds their difference the other way (in
    every forward, or in decode steps only): a routing finding at FAULT_LAYER, never an operator divergence.
    (Which prefill rows also flip depends on how each machine's kernels round a ~1e-6 gap: every flip is a
    near tie, wherever it is; test_decode_only_routing_change_megatron_vs_sglang pins the decode rows.)"""
    model = sc.build_sglang_model(moe_cfg(), sc.hf_checkpoint_weights(hf_tied))
    rollout(model, tmp_path / "sg", fault=fault)
    rep = find_divergence(str(mg_tied_trace), str(tmp_path / "sg"))
    assert rep.verdict == "divergent"
    assert rep.first["key"] == key_name("moe.topk_ids", FAULT_LAYER) and rep.first["cause"] == "routing"
    f = next(x for x in rep.findings if x.cause == "routing")
    assert f.layer == FAULT_LAYER and not f.computational
    assert f.detail["flipped"] > 0 and f.detail["near_tie"] == f.detail["flipped"]
    assert not [p.key for p in rep.points if p.status == "divergent" and p.cause != "routing"]
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc
    accepted = rejudge(doc, accept_near_tie=True)
    assert accepted["verdict"] == "consistent" and accepted["findings"][0]["cause"] == "routing"


def test_decode_only_routing_change_megatron_vs_sglang(tmp_path, mg_trace, new_model, sglang_env):
    """SGLang's router adds a selection bias in decode steps only, on margins no rounding reaches: the flips
    are exactly decode rows, computational (not near ties), at FAULT_LAYER."""
    rollout(new_model(), tmp_path / "sg", fault="expert_bias_decode")
    rep = find_divergence(str(mg_trace), str(tmp_path / "sg"))
    assert rep.verdict == "divergent"
    assert rep.first["key"] == key_name("moe.topk_ids", FAULT_LAYER) and rep.first["cause"] == "routing"
    f = next(x for x in rep.findings if x.cause == "routing")
    assert f.layer == FAULT_LAYER and f.computational and f.detail["flipped"] > 0
    decode_rows = {f"{rid}@{len(p) + j}" for rid, p in PROMPTS.items() for j in range(DECODE)}
    assert {x["row"] for x in f.detail["flips"]} <= decode_rows
    assert all(x["margin"] > 2 * x["logit_error"] for x in f.detail["flips"])


def test_clean_tied_pair_is_consistent(mg_tied_trace, hf_tied, sglang_env, tmp_path):
    """The near-tie setup alone (no fault): nothing computes differently. A row whose ~1e-6 gap is within the
    two frameworks' router rounding may resolve the other way on some machine: then it is a near-tie flip,
    never a computational one nor an operator divergence, and accepting near ties makes the pair consistent."""
    rollout(sc.build_sglang_model(moe_cfg(), sc.hf_checkpoint_weights(hf_tied)), tmp_path / "sg")
    rep = find_divergence(str(mg_tied_trace), str(tmp_path / "sg"))
    assert not [p.key for p in rep.points if p.status == "divergent" and p.cause != "routing"], _detail(rep)
    assert all(f.cause == "routing" and not f.computational and f.detail["near_tie"] == f.detail["flipped"]
               for f in rep.findings), _detail(rep)
    accepted = find_divergence(str(mg_tied_trace), str(tmp_path / "sg"), accept_near_tie=True)
    assert accepted.verdict == "consistent", _detail(accepted)


# ------------------------------------------------------------------------------------------------
# chunked prefill, a partly cached prefix, input logprobs
# ------------------------------------------------------------------------------------------------

def test_chunked_prefill_aligns(tmp_path, mg_trace, new_model):
    res = rollout(new_model(), tmp_path / "sg", chunked=6)
    ext = [r for r in res.records if r.is_extend]
    assert [(r.rids, r.extend_prefix_lens, r.extend_seq_lens) for r in ext] == [
        (["req-a", "req-b"], [0, 0], [5, 1]), (["req-b"], [1], [6]), (["req-b"], [7], [1])]
    vb = CanonicalView(str(tmp_path / "sg"))
    rep = find_divergence(str(mg_trace), vb)
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.not_comparable == [] and rep.rows["matched"] == SG_ROWS
    # each chunk's last row has logits too (real logits of a prompt row): (b,0) and (b,6) on top
    lg = next(p for p in rep.points if p.point == "logits")
    assert lg.rows == SG_LOGIT_ROWS + 2
    assert {("req-b", 0), ("req-b", 6)} <= set(vb.load("logits", None).rows)


def test_partly_cached_prefix_aligns(tmp_path, mg_trace, new_model):
    """req-b's first 3 prompt tokens are in the KV cache before the traced passes (as after a radix-cache
    hit): its traced prefill has extend_prefix_lens 3 and its first rows exist nowhere in the trace."""
    model = new_model()
    eng = sc.SGLangRollout(model)
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p)
    eng.extend([("req-b", 3)])                                     # before tracing: the cached prefix
    with traced_engine(model, tmp_path / "sg", eng) as (t, _):
        rec = eng.extend([("req-a", 5), ("req-b", 5)])
        for j in range(DECODE):
            eng.decode({rid: RESPONSES[rid][j] for rid in PROMPTS})
    assert rec.extend_prefix_lens == [0, 3]
    vb = CanonicalView(str(tmp_path / "sg"))
    assert len(vb.trace.pass_indices(0)) == 1 + DECODE
    assert vb.trace.open_pass(0, 0).rows["positions"] == list(range(5)) + list(range(3, 8))
    rep = find_divergence(str(mg_trace), vb)
    assert rep.verdict == "consistent", _detail(rep)
    assert _counts(rep.rows) == {"a": MG_ROWS, "b": SG_ROWS - 3, "matched": SG_ROWS - 3,
                                 "unmatched_a": MG_ROWS - SG_ROWS + 3, "unmatched_b": 0}


def test_input_token_logprobs_when_asked(tmp_path, mg_trace, new_model):
    """Re-scoring (the RL recipe: prompt+response as the prompt, input logprobs from 0): with
    SGLangAdapter(input_logprobs=True) the logprobs point is SGLang's own input_token_logprobs."""
    with traced_engine(new_model(), tmp_path / "sg") as (_, eng):
        res = eng.generate(SEQS, 0, return_logprob=True, logprob_start_len=0, chunked_prefill_size=9)
    ext = [(r.rids, r.extend_seq_lens) for r in res.records]
    assert ext == [(["req-a"], [9]), (["req-a", "req-b"], [1, 8]), (["req-b"], [5])]
    vb = CanonicalView(str(tmp_path / "sg"), SGLangAdapter(input_logprobs=True))
    lp = vb.load("logprobs", None)
    assert "input_token_logprobs" in lp.sources[0]
    # every prompt row but the last one of each request in each pass (4 request-chunks end in a pass)
    ends = sum(len(rids) for rids, _ in ext)
    assert ends == 4 and len(lp.rows) == MG_ROWS - ends
    assert ("req-a", 8) not in lp.rows and ("req-a", 9) not in lp.rows and ("req-b", 7) not in lp.rows
    rep = find_divergence(str(mg_trace), vb)
    assert rep.verdict == "consistent", _detail(rep)
    p = next(p for p in rep.points if p.point == "logprobs")
    assert p.rows == MG_ROWS - ends and p.error < 1e-5
    # the default adapter derives logprobs from the (last-row) logits instead
    assert "log_softmax" in CanonicalView(str(tmp_path / "sg")).load("logprobs", None).sources[0]


# ------------------------------------------------------------------------------------------------
# --forward-hooks: the factory in an unmodified model, rollout selection, TP=2 through the hooks
# ------------------------------------------------------------------------------------------------

def test_forward_hooks_factory_traces_through_sglangs_registration(tmp_path, sg_trace, new_model):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    model = new_model()
    spec = forward_hooks_spec(str(tmp_path / "hooks"), None, mode="full")
    assert spec[0]["hook_factory"] == "tic_trace.adapters.sglang_server:forward_hook_factory"
    assert json.loads(json.dumps(spec)) == spec
    register_forward_hooks(model, spec)
    session = sgs._SESSIONS[-1]
    assert session.root is model and "forward" in vars(model)
    assert len(model.model.embed_tokens._forward_hooks) == 1
    sc.SGLangRollout(model).generate(PROMPTS, DECODE, forced_tokens=RESPONSES)
    assert session.passes_traced == 1 + DECODE and list(session.tracers) == [None]
    close_sessions()
    assert "forward" not in vars(model) and not model.model.embed_tokens._forward_hooks
    v = CanonicalView(str(tmp_path / "hooks"))
    assert v.trace.manifest["framework"] == "sglang" and v.trace.ranks == [0]
    assert {p for p, _ in v.points()} == _promised(v)
    rep = find_divergence(str(sg_trace[0]), v)
    assert rep.verdict == "consistent" and rep.not_comparable == []
    assert rep.rows["matched"] == SG_ROWS and max(p.error for p in rep.points) == 0.0


def test_hook_finds_the_model_when_the_factory_could_not(tmp_path, new_model):
    """A factory called outside register_forward_hooks: the hook (on embed_tokens) finds the model during
    the first forward; tracing starts at the next one."""
    m = new_model()
    hook = sgs.forward_hook_factory(forward_hooks_spec(str(tmp_path / "late"), None, mode="full")[0]["config"])
    session = hook.tic_trace_session
    assert session.root is None
    m.model.embed_tokens.register_forward_hook(hook)
    sc.SGLangRollout(m).generate(PROMPTS, DECODE, forced_tokens=RESPONSES)
    assert session.root is m
    close_sessions()
    v = CanonicalView(str(tmp_path / "late"))
    assert len(v.trace.pass_indices(0)) == DECODE          # the prefill ran before the model was found
    assert v.rows_total == DECODE * len(PROMPTS)


def test_forward_hooks_spec_traces_only_chosen_samples_per_rollout(tmp_path, sg_trace, new_model):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    model = new_model()
    out = tmp_path / "slime"
    register_forward_hooks(model, forward_hooks_spec(str(out), [3, 5], max_samples=2, mode="rows"))
    eng = sc.SGLangRollout(model)
    like = {"3-0": "req-a", "3-1": "req-b", "3-2": "req-a", "4-0": "req-b", "5-1": "req-a"}
    prompts = {rid: PROMPTS[src] for rid, src in like.items()}
    forced = {rid: RESPONSES[src] for rid, src in like.items()}
    eng.generate(prompts, DECODE, forced_tokens=forced)
    session = sgs._SESSIONS[-1]
    before = dict(session.tracers)
    eng.generate({"4-1": PROMPTS["req-a"], "3-7": PROMPTS["req-b"], "x": [1, 2]}, 2)   # nothing chosen
    assert session.tracers == before and session.passes_traced == 1 + DECODE
    close_sessions()
    assert sorted(os.listdir(out)) == ["rollout_00003", "rollout_00005"]
    assert os.listdir(out / "rollout_00003") == ["sglang"]
    ref = CanonicalView(str(sg_trace[0]))
    for rollout_id, rids in ((3, ["3-0", "3-1"]), (5, ["5-1"])):
        v = CanonicalView(str(out / f"rollout_{rollout_id:05d}" / "sglang"))
        assert len(v.trace.pass_indices(0)) == 1 + DECODE
        assert v.rows_total == sum(len(prompts[r]) + DECODE for r in rids)
        assert {k for k, _ in v.tokens} == set(rids)
        p0 = v.trace.open_pass(0, 0)
        keys = p0.rows["keys"]
        assert {k for k in keys if k is not None} == set(rids) and len(keys) == sum(map(len, prompts.values()))
        emb = p0.record("model.embed_tokens:out")
        assert emb.mode == "rows" and emb.row_index == [i for i, k in enumerate(keys) if k is not None]
        assert {p for p, _ in v.points()} == _promised(v)
        # values: the chosen samples' rows equal the same samples in the full trace of a 2-request batch
        for point, layer in v.points():
            got, want = v.load(point, layer), ref.load(point, layer)
            where = {r: i for i, r in enumerate(want.rows)}
            assert got.rows, (point, layer)
            idx = [where[(like[k], p)] for k, p in got.rows]
            np.testing.assert_allclose(got.values, want.values[idx], rtol=0, atol=1e-5,
                                       err_msg=f"{point} L{layer}")


def test_server_args_that_hide_operators_are_named(caplog, monkeypatch, new_model):
    gpu = types.SimpleNamespace(device="cuda", cuda_graph_config=None, disable_cuda_graph=False,
                                enable_torch_compile=True)
    problems = tracing_problems(gpu)
    text = " ".join(problems)
    assert len(problems) == 3
    for flag in ("--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled",
                 "--disable-cuda-graph", "--enable-torch-compile"):
        assert flag in text
    off = types.SimpleNamespace(device="cuda", cuda_graph_config={"decode": {"backend": "disabled"},
                                                                  "prefill": {"backend": "disabled"}})
    assert tracing_problems(off) == []
    # FlashInfer all-reduce fusion (resolved on by default for some MoE models at TP>1): named with its off flag
    fused = types.SimpleNamespace(device="cpu", enable_flashinfer_allreduce_fusion=True)
    assert len(tracing_problems(fused)) == 1
    assert "--enforce-disable-flashinfer-allreduce-fusion" in tracing_problems(fused)[0]
    fused.enforce_disable_flashinfer_allreduce_fusion = True
    assert tracing_problems(fused) == []
    assert tracing_problems() == []            # this process: CPU, graphs off, no compile
    # attaching to a server with such arguments logs them; a compiled forward is not traced
    monkeypatch.setattr(sgs, "tracing_problems", lambda server_args=None: problems)
    m = new_model()
    with caplog.at_level(logging.WARNING, logger="tic_trace.sglang"):
        session = sgs._HookSession({"out_dir": "unused", "mode": "full"})
        session.attach(m)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        sc.SGLangRollout(m).generate({"x": [1, 2, 3]}, 1)
    session.close()
    assert "--enable-torch-compile" in caplog.text and "--cuda-graph-backend-decode=disabled" in caplog.text
    assert session.passes_seen == 2 and session.passes_traced == 0 and not session.tracers
    # a bad configuration never takes a server down: the factory logs it and registers nothing
    with pytest.raises(ValueError):
        forward_hooks_spec("x", None, mode="everything")
    assert sgs.forward_hook_factory({"out_dir": "x", "mode": "everything"}) is None


def _tp2_worker(rank, world, port, out_dir, block_reduces=False):
    """One spawned TP rank: SGLang TP=2 over gloo, traced through SGLang's own register_forward_hooks.
    ``block_reduces``: the MoE blocks all-reduce their own output, as in SGLang 0.5.15.post1 (slime's pin)."""
    torch.set_num_threads(1)
    sc.disable_torch_compile()
    sc.init_sglang_distributed(tp_size=world, rank=rank, port=port)
    try:
        from sglang.srt.model_executor.hook_manager import register_forward_hooks

        cfg = moe_cfg()
        model = sc.build_sglang_model(cfg, build_hf_model(cfg, seed=0))
        if block_reduces:
            from tic_trace.testing.sglang_versions import reduce_moe_output_in_block
            assert reduce_moe_output_in_block(model) == cfg.num_hidden_layers
        register_forward_hooks(model, forward_hooks_spec(out_dir, None, mode="full"))
        sc.SGLangRollout(model).generate(PROMPTS, DECODE, forced_tokens=RESPONSES)
        close_sessions()
    finally:
        sc.destroy_sglang_distributed()


def test_tp2_traces_reassemble_to_tp1(tmp_path, sg_trace):
    sc.spawn_ranks(_tp2_worker, world=2, args=(str(tmp_path / "tp2"),))
    v = CanonicalView(str(tmp_path / "tp2"))
    assert v.trace.ranks == [0, 1]
    infos = {r: v.trace.rank_info(r) for r in v.trace.ranks}
    assert [infos[r]["coords"]["tp_rank"] for r in (0, 1)] == [0, 1]
    assert v.adapter.rank_groups([0, 1], infos) == [[0, 1]]
    assert v.config["tp_partial"] == {"attn.out": [0, 1], "moe.experts_out": [0, 1], "moe.shared_out": [],
                                      "mlp.out": [0, 1]}
    rep = find_divergence(str(sg_trace[0]), v)
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.not_comparable == [] and rep.rows["matched"] == SG_ROWS
    assert {p.point for p in rep.points} == _promised(v)
    assert max(p.error for p in rep.points) < 1e-5
    # the shards really were shards: per-rank [q_local | k_local | v_local] and heads; partial o_proj sums
    p0, p1 = v.trace.open_pass(0, 0), v.trace.open_pass(1, 0)
    assert p0.record("model.layers.0.self_attn.qkv_proj:out[0]").shape == (N_PROMPT, (2 + 1 + 1) * 16)
    assert p0.record("model.layers.0.self_attn.attn:out").shape == (N_PROMPT, 2 * 16)
    o0, o1 = (p.record("model.layers.0.self_attn.o_proj:out[0]").values() for p in (p0, p1))
    full = CanonicalView(str(sg_trace[0])).trace.open_pass(0, 0).record("model.layers.0.self_attn.o_proj:out[0]")
    assert np.abs(o0 - full.values()).max() > 1e-3
    np.testing.assert_allclose(o0 + o1, full.values(), rtol=0, atol=1e-5)
    if moe_block_reduces_itself():      # SGLang 0.5.15.post1: the merge notes it (test_tp2_moe_block_that_...)
        assert set(rep.sides["b"]["merge_notes"]) == {"L0.mlp.out", "L1.mlp.out"}
    else:
        assert rep.sides["b"]["merge_notes"] == {}      # every declared partial was a partial


def test_tp2_moe_block_that_reduces_itself(tmp_path, sg_trace):
    """SGLang 0.5.15.post1 (slime's pin) all-reduces each MoE block's output inside the block; the module still
    declares reduce_results=False. The merge goes by the records (bitwise-equal rank copies: taken once) and
    notes the disagreement; summing them as declared would make mlp.out tp x too large."""
    sc.spawn_ranks(_tp2_worker, world=2, args=(str(tmp_path / "tp2"), True))
    v = CanonicalView(str(tmp_path / "tp2"))
    assert v.config["tp_partial"]["mlp.out"] == [0, 1]                       # what the module declares
    p0, p1 = v.trace.open_pass(0, 0), v.trace.open_pass(1, 0)
    m0, m1 = (p.record("model.layers.0.mlp:out").values() for p in (p0, p1))
    assert m0.tobytes() == m1.tobytes()                                       # replicated, not partial
    e0, e1 = (p.record("model.layers.0.mlp.experts:out").values() for p in (p0, p1))
    assert e0.tobytes() != e1.tobytes()                                       # the experts' output still is
    rep = find_divergence(str(sg_trace[0]), v)
    assert rep.verdict == "consistent", _detail(rep)
    assert rep.rows["matched"] == SG_ROWS and {p.point for p in rep.points} == _promised(v)
    assert max(p.error for p in rep.points) < 1e-5
    notes = rep.sides["b"]["merge_notes"]
    assert set(notes) == {"L0.mlp.out", "L1.mlp.out"} and "declares a TP partial sum" in notes["L0.mlp.out"]
    # every renderer shows the notes, not only the JSON
    from io import StringIO

    from rich.console import Console

    from tic_trace.report.html import render_html
    from tic_trace.report.terminal import render_terminal
    buf = StringIO()
    render_terminal(rep.to_json(), Console(file=buf, width=200))
    assert "2 rank merge(s) disagree with what the model declares" in buf.getvalue()
    assert "rank merges against the declaration" in render_html(rep.to_json())


def test_sglang_merges_units():
    from tic_trace.graph.adapter import TransformContext, merge, transform

    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 3}
    rng = np.random.default_rng(0)
    n = 5
    q, k, v = rng.normal(size=(n, 12)), rng.normal(size=(n, 6)), rng.normal(size=(n, 6))
    glob = np.concatenate([q, k, v], -1)
    for tp in (2, 4):             # tp=4 > 2 KV heads: each KV head lives on two ranks
        ql, kvl = 12 // tp, max(1, 2 // tp) * 3
        shards = []
        for r in range(tp):
            kv_head = r * 2 // tp
            shards.append(np.concatenate([q[:, r * ql:(r + 1) * ql], k[:, kv_head * kvl:(kv_head + 1) * kvl],
                                          v[:, kv_head * kvl:(kv_head + 1) * kvl]], -1))
        np.testing.assert_array_equal(merge("sgl_qkv", shards, cfg), glob)
        np.testing.assert_array_equal(merge("sgl_heads_q", [s[:, :ql] for s in shards], cfg),
                                      q.reshape(n, 4, 3))
        np.testing.assert_array_equal(merge("sgl_heads_kv", [s[:, ql:ql + kvl] for s in shards], cfg),
                                      k.reshape(n, 2, 3))
    for part, want, h in (("q", q, 4), ("k", k, 2), ("v", v, 2)):
        got = transform("sgl_qkv")(glob, TransformContext(n, cfg, {"part": part}, 0, {}))
        np.testing.assert_array_equal(got, want.reshape(n, h, 3))
    # the q_norm module's [T*heads, hd] layout merges like [T, heads*hd]
    np.testing.assert_array_equal(merge("sgl_heads_q", [q[:, :6].reshape(-1, 3), q[:, 6:].reshape(-1, 3)], cfg),
                                  q.reshape(n, 4, 3))
    assert get_adapter("sglang").name == "sglang"


# ------------------------------------------------------------------------------------------------
# name tables: DeepSeek-V2/V3, GLM-4-MoE (and the Qwen families) on the meta device
# ------------------------------------------------------------------------------------------------

def _meta_models():
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=256)
    moe = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               first_k_dense_replace=1, n_group=1, topk_group=1)
    yarn = {"rope_type": "yarn", "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    out = {}
    for name, cls_name, lora in (("DeepseekV2ForCausalLM", transformers.DeepseekV2Config, None),
                                 ("DeepseekV3ForCausalLM", transformers.DeepseekV3Config, 24)):
        c = cls_name(**common, **moe, num_key_value_heads=4, q_lora_rank=lora, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, architectures=[name])
        # fields SGLang reads that the hub configs carry (trust_remote_code) and transformers' lack
        c.rope_scaling = yarn
        c.moe_layer_freq, c.routed_scaling_factor, c.norm_topk_prob, c.ep_size = 1, 1.0, True, 1
        c.scoring_func, c.topk_method = ("softmax", "greedy") if lora is None else ("sigmoid", "noaux_tc")
        out[name] = c
    out["Glm4MoeForCausalLM"] = transformers.Glm4MoeConfig(
        **common, **moe, num_key_value_heads=2, head_dim=16, use_qk_norm=True, architectures=["Glm4MoeForCausalLM"])
    out["Qwen3MoeForCausalLM"] = moe_cfg()
    out["Qwen3ForCausalLM"] = tiny_qwen3_config(moe=False)
    out["Qwen2ForCausalLM"] = transformers.Qwen2Config(**common, num_key_value_heads=2)
    gemma = dict(common, num_key_value_heads=2, head_dim=16, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
    out["Gemma2ForCausalLM"] = transformers.Gemma2Config(**gemma, architectures=["Gemma2ForCausalLM"])
    out["Gemma3ForCausalLM"] = transformers.Gemma3TextConfig(**gemma, architectures=["Gemma3ForCausalLM"])
    # swiglu_limit as a gpt-oss checkpoint's config.json has it: SGLang's gpt_oss.py reads it, and
    # transformers 5.12.1's GptOssConfig (slime's stack) has no default for it (5.24's: 7.0).
    oss = transformers.GptOssConfig(**common, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, architectures=["GptOssForCausalLM"], swiglu_limit=7.0)
    oss.dtype = torch.float32           # gpt_oss.py builds its router in config.dtype (a checkpoint's holds one)
    out["GptOssForCausalLM"] = oss
    out["OlmoeForCausalLM"] = transformers.OlmoeConfig(**common, num_key_value_heads=4, num_experts=4,
                                                       num_experts_per_tok=2, architectures=["OlmoeForCausalLM"])
    out["MixtralForCausalLM"] = transformers.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4,
                                                           num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    return out


def _build_on_meta(name, cfg):
    """The SGLang model class built on the meta device (module tree only, no weights)."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    if name.startswith("Deepseek"):
        from sglang.srt.models import deepseek_v2 as mod
        cls = getattr(mod, name)
    elif name.startswith("Glm4"):
        from sglang.srt.models import glm4_moe as mod
        cls = getattr(mod, name)
    else:
        cls = sc.sglang_model_class(cfg)
    with set_default_torch_dtype(torch.float32), torch.device("meta"):
        return cls(cfg)


def test_name_tables_on_meta_module_trees(sglang_env):
    ad = SGLangAdapter()
    seen = set()
    for name, cfg in _meta_models().items():
        model = _build_on_meta(name, cfg)
        assert type(model).__name__ == name
        names = [n for n, _ in model.named_modules()]
        arch = ARCH_OF_CLASS[name]
        seen.add(arch)
        for pat in ARCH_MODULES[arch]:
            rx = pat.replace(".", r"\.").replace("N", r"\d+")
            assert any(re.fullmatch(rx, n) for n in names), (name, pat)
        config = ad.describe([model])
        assert config["arch_table"] == arch
        assert config["attention"] == ("mla" if arch == "deepseek_mla" else "mha")
        promised = ad.promised_points(config)
        if arch == "deepseek_mla":      # MLA's own rows; a q latent only with q_lora_rank (V3 here, not V2)
            assert not set(promised) & {"attn.k", "attn.v", "attn.q_norm", "attn.k_norm"}
            assert {"attn.q", "attn.q_rope", "attn.k_rope", "attn.core", "attn.kv_a", "attn.kv_a_norm",
                    "attn.kv_b"} <= set(promised)
            assert ({"attn.q_a", "attn.q_a_norm"} <= set(promised)) == bool(cfg.q_lora_rank)
        if arch in ("deepseek_mla", "glm4_moe"):
            assert {"moe.router_logits", "moe.topk_ids", "moe.shared_out"} <= set(promised)
        # every table row the adapter applies to this model names a module the model has
        for pm in ad.points:
            if not ad.applies(pm, config):
                continue
            rx = record_module(pm).replace("(?P<layer>\\d+)", r"\d+")
            assert any(re.fullmatch(rx, n) for n in names), (name, pm.point, pm.record)
            if "/fn:apply_qk_norm" in pm.record:      # the tapped function is where the adapter taps it
                attn = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
                assert callable(getattr(__import__(type(attn).__module__, fromlist=["x"]), "apply_qk_norm"))
    assert seen == set(ARCH_MODULES)


def _counts(rows: dict) -> dict:
    """The report's row counts that these tests check (the identity counts beyond them are 0 here)."""
    assert not any(rows[k] for k in ("excluded", "different_tokens", "duplicates_a", "duplicates_b")), rows
    return {k: rows[k] for k in ("a", "b", "matched", "unmatched_a", "unmatched_b")}


def test_forward_hooks_spec_every_n_traces_periodic_rollouts_as_statistics(tmp_path, new_model):
    """slime's --tic-trace-every 2 with --tic-trace-rollout-ids 3: rollouts 2 and 4 are traced in the periodic
    mode (stats), 3 in rows, 5 not at all."""
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    model = new_model()
    out = tmp_path / "slime"
    register_forward_hooks(model, forward_hooks_spec(str(out), [3], max_samples=2, mode="rows", every=2,
                                                     periodic_mode="stats"))
    like = {"2-0": "req-a", "3-0": "req-b", "4-1": "req-a", "5-0": "req-b"}
    sc.SGLangRollout(model).generate({rid: PROMPTS[src] for rid, src in like.items()}, 1,
                                     forced_tokens={rid: RESPONSES[src] for rid, src in like.items()})
    close_sessions()
    assert sorted(os.listdir(out)) == ["rollout_00002", "rollout_00003", "rollout_00004"]
    for rid, mode in ((2, "stats"), (3, "rows"), (4, "stats")):
        v = CanonicalView(str(out / f"rollout_{rid:05d}" / "sglang"))
        assert v.trace.open_pass(0, 0).record("model.embed_tokens:out").mode == mode, rid
    with pytest.raises(ValueError, match="mode"):
        forward_hooks_spec("x", None, periodic_mode="sometimes")


def test_mixtral_expert_count_is_read_under_its_own_config_name(sglang_env):
    """Mixtral's config names its routed experts `num_local_experts`: the adapter reads it as the expert count
    (as the HF adapter does), never as 0 experts; its MoE points are promised (read under `block_sparse_moe`)."""
    import transformers
    from sglang.srt.models import mixtral

    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, num_local_experts=4,
                                     num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    with set_default_torch_dtype(torch.float32), torch.device("meta"):
        model = mixtral.MixtralForCausalLM(cfg)
    ad = SGLangAdapter()
    config = ad.describe([model])
    assert config["num_experts"] == 4 and config["num_experts_per_tok"] == 2
    assert ad.check_architecture(config).verified and config["norm_topk_prob"] is True
    assert {"moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.experts_out"} <= \
        set(ad.promised_points(config))


SUBSET_LIKE = {"2-0": "req-a", "2-1": "req-b"}
SUBSET_STEPS = 3


def _subset_seq(src: str) -> list[int]:
    """A sample as the trainer scores it: the prompt, the tokens fed back in the decode steps, the last one."""
    return PROMPTS[src] + RESPONSES[src][:SUBSET_STEPS + 1]


def _subset_rollout(m, out, steps=SUBSET_STEPS, late=False):
    """Rollout 2 of two samples (req-a's and req-b's tokens as "2-0", "2-1") traced by the hook as a periodic
    rollout in the default `subset` mode. `late`: the hook is registered by hand, so it finds the model only
    during the prefill and traces from the first decode step on (a forward genuinely lost to the trace; the
    engine model is `m`, not `model`, so the factory does not find it in this caller's frame)."""
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    spec = forward_hooks_spec(str(out), [3], max_samples=2, mode="rows", every=2)
    if late:
        m.model.embed_tokens.register_forward_hook(sgs.forward_hook_factory(spec[0]["config"]))
    else:
        register_forward_hooks(m, spec)
    session = sgs._SESSIONS[-1]
    sc.SGLangRollout(m).generate({rid: PROMPTS[src] for rid, src in SUBSET_LIKE.items()}, steps,
                                     forced_tokens={rid: RESPONSES[src] for rid, src in SUBSET_LIKE.items()})
    close_sessions()
    return session, out / "rollout_00002" / "sglang"


def _hf_subset_trace(hf, out, subset=True):
    """The HF model (the SGLang model's weights) over the same samples' prompt + response, one forward each,
    in the same `subset` mode (what Megatron's side of a periodic rollout is), or in `full`."""
    from tic_trace.graph.row_subset import RowSubset
    kw = dict(points_mode="rows", sample_rows=list(range(64)), row_subset=RowSubset()) if subset else \
        dict(points_mode="full")
    with tic_trace.trace(hf, out, adapter="hf", **kw) as t, torch.no_grad():
        for rid, src in SUBSET_LIKE.items():
            t.sample_keys = [rid]
            hf(torch.tensor([_subset_seq(src)]))
            t.step()
    assert t.failed is None, t.failed
    return str(out)


def test_forward_hooks_spec_periodic_default_keeps_the_identity_row_subset(tmp_path, new_model, hf):
    """The periodic default (`subset`): a periodic rollout stores the values of exactly the rows that
    tic_trace.graph.row_subset keeps by (rid, position), in the prefill and in the decode steps alike; a decode
    step holding no kept row runs untraced and writes its row table only (no record, an empty blob); and the
    trace compares consistent against the HF trace of the same samples in the same mode."""
    from tic_trace.graph.row_subset import RowSubset
    session, path = _subset_rollout(new_model(), tmp_path / "slime")
    tr = CanonicalView(str(path)).trace
    subset, stored, named, rows_only = RowSubset(), [], [], []
    for i in tr.pass_indices(0):
        p = tr.open_pass(0, i)
        rows = [(k, pos) for k, pos in zip(p.rows["keys"], p.rows["positions"]) if k is not None]
        named += rows
        if not any(subset.keeps(*r) for r in rows):
            rows_only.append(i)
            assert p.meta.get("rows_only") is True and p.records == [] and p.blob_size == 0, i
            assert p.meta["pass_number"] == i and p.rows["tokens"] is not None
            continue
        assert not p.meta.get("rows_only")
        rec = p.record("model.embed_tokens:out")
        assert rec.mode == "rows"
        stored += [(p.rows["keys"][j], p.rows["positions"][j]) for j in rec.row_index]
    # the prefill and the step at req-b's position 8 keep rows; the other two decode steps keep none
    assert len(tr.pass_indices(0)) == 1 + SUBSET_STEPS and 0 not in rows_only and len(rows_only) >= 1
    assert session.passes_rows_only == len(rows_only) and session.passes_traced == 1 + SUBSET_STEPS - len(rows_only)
    assert sorted(stored) == sorted(r for r in named if subset.keeps(*r))
    assert 0 < len(stored) < len(named) and len(named) == N_PROMPT + SUBSET_STEPS * len(PROMPTS)
    assert tr.manifest["tracer"]["row_subset"] == subset.describe()
    # against HF in full: every SGLang row is named (the row-table-only passes too), the kept ones compared
    rep = find_divergence(_hf_subset_trace(hf, tmp_path / "hf_full", subset=False), str(path))
    assert rep.verdict == "consistent", _detail(rep)
    # HF also names each sample's last response token, never fed back to SGLang: outside its rows, as always
    assert _counts(rep.rows) == {"a": MG_ROWS - 2, "b": len(named), "matched": len(stored),
                                 "unmatched_a": len(PROMPTS), "unmatched_b": 0}, rep.rows
    mid = [p for p in rep.points if p.point == "mid" and p.layer == 1][0]
    assert mid.rows == len(stored) and max(p.error for p in rep.points if p.error is not None) < 1e-5
    # against HF in the same mode (the pairing of slime's periodic rollouts): the rows meet the same way. (HF
    # taps apply_rotary_pos_emb as [batch, heads, T, dim], which `rows` mode keeps as statistics only: those
    # two points are not comparable there, in any `rows` trace of HF). Of the last tokens, only those the rule
    # keeps are said: both traces recorded the rule, and a row it drops is no row one side lost
    rep = find_divergence(_hf_subset_trace(hf, tmp_path / "hf"), str(path))
    last = [(rid, len(_subset_seq(src)) - 1) for rid, src in SUBSET_LIKE.items()]
    assert _counts(rep.rows) == {"a": MG_ROWS - 2, "b": len(named), "matched": len(stored),
                                 "unmatched_a": sum(subset.keeps(*r) for r in last), "unmatched_b": 0}, rep.rows
    assert {p.point for p in rep.points if p.status != "ok"} <= {"attn.q_rope", "attn.k_rope"}, _detail(rep)
    mid = [p for p in rep.points if p.point == "mid" and p.layer == 1][0]
    assert mid.status == "ok" and mid.rows == len(stored)


def test_periodic_subset_trace_that_lost_its_prefill_says_the_kept_rows_it_lacks(tmp_path, new_model, hf):
    """The hook finds the model during the prefill: that forward is not in the SGLang trace. Of the prompt
    rows the HF side names, those the subset keeps are said as rows SGLang lacks; those it drops are not."""
    from tic_trace.graph.row_subset import RowSubset
    _, path = _subset_rollout(new_model(), tmp_path / "slime", late=True)
    tr = CanonicalView(str(path)).trace
    assert len(tr.pass_indices(0)) == SUBSET_STEPS         # the decode steps only
    rep = find_divergence(_hf_subset_trace(hf, tmp_path / "hf"), str(path))
    subset = RowSubset()
    prompt_rows = [(rid, p) for rid, src in SUBSET_LIKE.items() for p in range(len(PROMPTS[src]))]
    kept_prompt = [r for r in prompt_rows if subset.keeps(*r)]
    last = [(rid, len(_subset_seq(src)) - 1) for rid, src in SUBSET_LIKE.items()]    # never fed back
    assert 0 < len(kept_prompt) < len(prompt_rows)
    assert rep.rows["unmatched_a"] == len(kept_prompt) + sum(subset.keeps(*r) for r in last), rep.rows
    said = [n for n in rep.notes if n.kind == "unmatched_rows" and n.detail.get("side") == "a"]
    assert len(said) == 1 and said[0].detail["count"] == rep.rows["unmatched_a"], rep.notes
    assert said[0].detail["first"][0] == f"2-0@{min(p for k, p in kept_prompt if k == '2-0')}"
