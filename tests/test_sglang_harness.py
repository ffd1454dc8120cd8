"""The CPU SGLang harness runs real SGLang 0.5.23 Qwen3 / Qwen3-MoE code as a rollout.

Reference: the same weights in HF transformers, full-sequence forward. Every logit row
SGLang produces (last row of each finished prefill, every decode row) must equal HF's
logits at that (request, position). TP=2 (two gloo processes) must equal TP=1.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import sglang  # noqa: E402,F401 - a required test dependency: fail loudly if missing

from tic_trace.testing import sglang_cpu as sc  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config  # noqa: E402

PROMPTS = {"req-a": [3, 5, 7, 9, 11], "req-b": [2, 4, 6, 8, 10, 12, 14, 16]}
DECODE_STEPS = 4
ATOL = 1e-5  # fp32; observed max |diff| ~6e-7


@pytest.fixture(scope="module")
def sglang_tp1():
    sc.init_sglang_distributed(tp_size=1)
    yield
    sc.destroy_sglang_distributed()


@pytest.fixture(scope="module")
def models(sglang_tp1):
    """kind -> (hf_model, sglang_model), built once per module."""
    out = {}
    for kind in ("dense", "moe"):
        cfg = tiny_qwen3_config(moe=(kind == "moe"))
        hf = build_hf_model(cfg, seed=0)
        out[kind] = (hf, sc.build_sglang_model(cfg, hf))
    return out


def hf_logits(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0]


def check_rows(res):
    """Row identity: EXTEND rows are the prompt in request order, DECODE one row per request."""
    for rec in res.records:
        keys = rec.row_keys
        assert len(keys) == rec.input_ids.numel() == rec.positions.numel()
        for (rid, pos), tok in zip(keys, rec.input_ids.tolist()):
            assert res.sequence(rid)[pos] == tok, (rec.index, rid, pos)
        if rec.is_decode:
            assert [k[0] for k in keys] == rec.rids
            assert rec.extend_seq_lens is None
        else:
            for rid, pre, n in zip(rec.rids, rec.extend_prefix_lens, rec.extend_seq_lens):
                assert [p for r, p in keys if r == rid] == list(range(pre, pre + n))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_rollout_logits_equal_hf(models, kind):
    hf, model = models[kind]
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM")
    eng = sc.SGLangRollout(model)
    forced = {"req-b": [1, 2, 3]} if kind == "moe" else None  # part forced, rest greedy
    res = eng.generate(PROMPTS, DECODE_STEPS, forced_tokens=forced)

    modes = [rec.forward_mode.name for rec in res.records]
    assert modes == ["EXTEND"] + ["DECODE"] * DECODE_STEPS
    assert res.records[0].rids == list(PROMPTS)
    assert res.records[0].forward_batch.rids == list(PROMPTS)
    check_rows(res)
    for j, rec in enumerate(res.records[1:]):
        assert rec.row_keys == [(rid, len(p) + j) for rid, p in PROMPTS.items()]
        assert rec.seq_lens == [len(p) + j + 1 for p in PROMPTS.values()]
    if forced:
        assert res.outputs["req-b"][:3] == [1, 2, 3]

    got = res.next_token_logits_by_position()
    assert len(got) == len(PROMPTS) * (DECODE_STEPS + 1)
    worst = 0.0
    for rid in PROMPTS:
        seq = res.sequence(rid)
        assert len(seq) == len(PROMPTS[rid]) + DECODE_STEPS + 1
        ref = hf_logits(hf, seq)
        for (r, pos), logits in got.items():
            if r != rid:
                continue
            torch.testing.assert_close(logits, ref[pos], atol=ATOL, rtol=0, msg=f"{rid}@{pos}")
            worst = max(worst, (logits - ref[pos]).abs().max().item())
            if forced is None or rid not in forced:  # greedy rows: the fed token is the argmax
                if pos + 1 < len(seq):
                    assert seq[pos + 1] == int(logits.argmax())
    assert worst < ATOL
    # the KV pool slots and request rows were returned
    assert eng.req_to_token_pool.available_size() == eng.req_to_token_pool.size
    assert eng.token_to_kv_pool_allocator.available_size() == eng.token_to_kv_pool.size


def test_chunked_prefill_input_logprobs_and_prompt_logits(models):
    hf, model = models["moe"]
    eng = sc.SGLangRollout(model)
    res = eng.generate(
        PROMPTS,
        2,
        chunked_prefill_size=6,
        return_logprob=True,
        logprob_start_len=0,
        capture_prompt_logits=True,
    )
    ext = [r for r in res.records if r.is_extend]
    # budget 6: [a:0-5 + b:0-1], [b:1-7], [b:7-8]  (the chunked request continues first)
    assert [(r.rids, r.extend_prefix_lens, r.extend_seq_lens) for r in ext] == [
        (["req-a", "req-b"], [0, 0], [5, 1]),
        (["req-b"], [1], [6]),
        (["req-b"], [7], [1]),
    ]
    assert [r.sampling_rids for r in ext] == [["req-a"], [], ["req-b"]]
    check_rows(res)
    refs = {rid: hf_logits(hf, res.sequence(rid)) for rid in PROMPTS}

    seen = set()
    for rec in ext:
        # every prompt row's logits, through SGLang's lm-head path (capture_hidden FULL)
        assert rec.prompt_logits.shape == (len(rec.row_keys), model.config.vocab_size)
        for row, (rid, pos) in enumerate(rec.row_keys):
            torch.testing.assert_close(rec.prompt_logits[row], refs[rid][pos], atol=ATOL, rtol=0)
            seen.add((rid, pos))
        # SGLang's own input logprobs: entry for row (rid,pos) = log p(prompt[pos+1] | ...);
        # the prompt's last row is padded with token 0 (the scheduler drops it)
        lp = rec.logits_output.input_token_logprobs
        assert lp is not None and lp.numel() == len(rec.row_keys)
        for row, (rid, pos) in enumerate(rec.row_keys):
            prompt = PROMPTS[rid]
            if pos + 1 < len(prompt):
                want = torch.log_softmax(refs[rid][pos], -1)[prompt[pos + 1]]
                torch.testing.assert_close(lp[row], want, atol=ATOL, rtol=0)
    assert seen == {(rid, p) for rid, pr in PROMPTS.items() for p in range(len(pr))}

    # decode after a chunked prefill still matches the full-sequence forward
    for (rid, pos), logits in res.next_token_logits_by_position().items():
        torch.testing.assert_close(logits, refs[rid][pos], atol=ATOL, rtol=0)


def test_forward_is_called_like_model_runner(models):
    """model.forward(...) is called directly: root hooks never fire, submodule hooks do."""
    _, model = models["moe"]
    calls = {"root": 0, "norm": 0, "topk": 0}
    hs = [
        model.register_forward_hook(lambda *a: calls.__setitem__("root", calls["root"] + 1)),
        model.model.norm.register_forward_hook(lambda *a: calls.__setitem__("norm", calls["norm"] + 1)),
        model.model.layers[0].mlp.topk.register_forward_hook(
            lambda *a: calls.__setitem__("topk", calls["topk"] + 1)
        ),
    ]
    seen_batches = []
    try:
        eng = sc.SGLangRollout(model, before_forward=[seen_batches.append])
        res = eng.generate({"x": [5, 6, 7]}, 2)
    finally:
        for h in hs:
            h.remove()
    assert calls == {"root": 0, "norm": 3, "topk": 3}
    assert [fb.forward_mode.name for fb in seen_batches] == ["EXTEND", "DECODE", "DECODE"]
    assert all(rec.forward_batch is fb for rec, fb in zip(res.records, seen_batches))


# ---------------------------------------------------------------------------------------------
# TP=2 over gloo
# ---------------------------------------------------------------------------------------------


def _first_output_into(store):
    def hook(module, args, output):  # must return None, or it replaces the module output
        store.setdefault("out", output[0].clone())

    return hook


def _tp_rollout_worker(rank, world, port, out_dir):
    """Top-level (spawn-importable) TP rank: dense + MoE rollouts, results to out_dir."""
    torch.set_num_threads(1)
    sc.disable_torch_compile()  # VocabParallelEmbedding's compiled helper: 15-20 s cold, same result
    sc.init_sglang_distributed(tp_size=world, rank=rank, port=port)
    result = {}
    for kind in ("dense", "moe"):
        cfg = tiny_qwen3_config(moe=(kind == "moe"))
        model = sc.build_sglang_model(cfg, build_hf_model(cfg, seed=0))
        qkv = {}
        hook = model.model.layers[0].self_attn.qkv_proj.register_forward_hook(_first_output_into(qkv))
        res = sc.SGLangRollout(model).generate(PROMPTS, DECODE_STEPS)
        hook.remove()
        for i, rec in enumerate(res.records):
            result[f"{kind}/logits/{i}"] = rec.next_token_logits.numpy()
        result[f"{kind}/qkv0"] = qkv["out"].numpy()
        for rid, toks in res.outputs.items():
            result[f"{kind}/out/{rid}"] = np.asarray(toks)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
    sc.destroy_sglang_distributed()


def test_tp2_equals_tp1(models, tmp_path):
    sc.spawn_ranks(_tp_rollout_worker, world=2, args=(str(tmp_path),))
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for kind in ("dense", "moe"):
        hf, model = models[kind]
        cfg = model.config
        qkv = {}
        hook = model.model.layers[0].self_attn.qkv_proj.register_forward_hook(_first_output_into(qkv))
        res = sc.SGLangRollout(model).generate(PROMPTS, DECODE_STEPS)
        hook.remove()
        for rid, toks in res.outputs.items():
            for r in ranks:
                assert r[f"{kind}/out/{rid}"].tolist() == toks
        for i, rec in enumerate(res.records):
            for r in ranks:
                torch.testing.assert_close(
                    torch.from_numpy(r[f"{kind}/logits/{i}"]), rec.next_token_logits, atol=ATOL, rtol=0
                )
        # per-rank fused QKV = [q_local | k_local | v_local], not a plain shard of the TP1 tensor
        d = cfg.head_dim
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        full = qkv["out"]
        q, k, v = full.split([hq * d, hkv * d, hkv * d], dim=-1)
        for rank, r in enumerate(ranks):
            local = torch.from_numpy(r[f"{kind}/qkv0"])
            lq, lkv = hq // 2 * d, hkv // 2 * d
            assert local.shape == (full.shape[0], lq + 2 * lkv)
            want = torch.cat(
                [
                    q[:, rank * lq : (rank + 1) * lq],
                    k[:, rank * lkv : (rank + 1) * lkv],
                    v[:, rank * lkv : (rank + 1) * lkv],
                ],
                dim=-1,
            )
            torch.testing.assert_close(local, want, atol=ATOL, rtol=0)
