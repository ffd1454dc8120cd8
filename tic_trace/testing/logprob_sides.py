"""Both sides' used log-probs for the reconciliation tests (issue 37), from real code. TEST SUPPORT ONLY.

Engine (`python -m tic_trace.testing.logprob_sides engine SPEC OUT`, a process of its own): a tiny HF Qwen3-MoE
with random weights (`hf_models`) generates each sample token by token; every step's logits row goes through the
installed SGLang's real `Sampler.forward` (`sglang/srt/layers/sampler.py`: 0.5.23 in the default lane,
0.5.15.post1 in the slime-stack lane; on a CPU with the `pytorch` sampling backend, after SGLang's own distributed
start-up: `sglang_cpu.init_sglang_distributed`), which samples the token and returns its log-prob
(`next_token_logprobs`, what `meta_info.output_token_logprobs` carries). Each version gets its own
`SamplingBatchInfo` fields (:func:`_sampling_info`); `Sampler.forward`'s positional arguments are the same in
both. The kept top-p set of each step (what slime asks SGLang for with `return_top_p_token_ids`) comes from
SGLang's real `top_k_top_p_min_p_sampling_from_probs_torch`: 0.5.23 returns its filtered probabilities
(`return_filtered_probs=True`); 0.5.15.post1 has no such argument, and they are read as it hands them to
`torch.multinomial` (:func:`_filtered_in_flight`). `SGLANG_RETURN_ORIGINAL_LOGPROB` is SGLang's own switch (read
when the sampler module is imported). On this path (no `--rl-on-policy-target`, no deterministic inference) both
versions return the same semantics: `log(softmax(z / T))` over the full distribution, or `log_softmax(z)` with the
switch (docs/reconcile.md).

Trainer (`... trainer SPEC OUT`, a process of its own: it puts the vendored Megatron-LM first on the path): the
same model scores each sample's whole sequence; the packed logits go through slime's own
`get_log_probs_and_entropy` (`--rollout-temperature`, rollout top-p replay through `top_p_token_ids`), and
slime's metric is computed by slime's own `get_sum_of_sample_mean` and `reduce_train_step_metrics` with the
engine's log-probs as `rollout_log_probs`, on Megatron's parallel state over gloo.

Not SGLang's or slime's code: the generation loop (HF's KV cache, one request at a time, in place of SGLang's
scheduler and model runner), and :func:`_route_with_bias`, the planted routing fault (a selection bias on one
layer's router, as DeepSeek's `e_score_correction_bias` acts: it changes which experts are chosen, not their
weights), which stands in for a trainer that does not apply the rollout's expert ids in that layer.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

VOCAB = 128
LOGIT_SCALE = 10.0     # random weights give near-uniform next-token distributions; a trained model's are peaked


def _model(moe_bias: float = 0.0):
    import torch

    from .hf_models import build_hf_model, tiny_qwen3_config
    model = build_hf_model(tiny_qwen3_config(moe=True, vocab_size=VOCAB), seed=3)
    model.lm_head.weight.data.mul_(LOGIT_SCALE)
    ids: dict[int, list] = {}
    for L, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        if L == 0 and moe_bias:
            gate.forward = _route_with_bias(gate, moe_bias)
        gate.register_forward_hook(lambda m, i, o, L=L: ids.setdefault(L, []).append(o[2].detach().clone()))
    torch.set_grad_enabled(False)
    return model, ids


def _route_with_bias(gate, bias: float):
    """Qwen3MoeTopKRouter.forward (transformers 5.x, modeling_qwen3_moe.py) with `bias` added to expert 0's
    logit for the choice only: `router_logits = F.linear(h, W)`; ids = top-k of softmax(logits + b); the
    weights are the unbiased probabilities of the chosen experts, renormalised (`norm_topk_prob`)."""
    import torch
    import torch.nn.functional as F

    def forward(hidden_states):
        h = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(h, gate.weight)
        b = torch.zeros(gate.num_experts, dtype=logits.dtype)
        b[0] = bias
        _, idx = torch.topk(torch.softmax((logits + b).float(), dim=-1), gate.top_k, dim=-1)
        w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
        w = (w / w.sum(dim=-1, keepdim=True)).to(logits.dtype)
        return logits, w, idx
    return forward


def _sampling_info(n: int, t: float, top_p: float, top_k: int = 0, min_p: float = 0.0):
    """SGLang's `SamplingBatchInfo` for `n` requests on a CPU batch, its flags set as its own
    `from_schedule_batch` sets them; the optional fields (grammars, penalties, custom processors, seeds, 0.5.23's
    sampling masks, watermarks and `max_top_k`) keep their defaults. `is_any_greedy` is a field of 0.5.23's
    dataclass only (0.5.15.post1's has none): it is passed where the installed version declares it; any other
    field a version requires fails the construction here rather than being guessed."""
    import dataclasses

    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    k = top_k or VOCAB
    since_0523 = {"is_any_greedy": k <= 1}
    have = {f.name for f in dataclasses.fields(SamplingBatchInfo)}
    return SamplingBatchInfo(
        temperatures=torch.full((n, 1), t), top_ps=torch.full((n,), top_p),
        top_ks=torch.full((n,), k, dtype=torch.int32), min_ps=torch.full((n,), min_p),
        is_all_greedy=k <= 1, need_top_p_sampling=top_p < 1.0, need_top_k_sampling=bool(top_k),
        need_min_p_sampling=min_p > 0.0, vocab_size=VOCAB, device="cpu",
        **{name: v for name, v in since_0523.items() if name in have})


def _filtered(row, t: float, top_p: float, top_k: int = 0, min_p: float = 0.0):
    """SGLang's filtered probabilities of one logits row (its real torch sampler,
    `top_k_top_p_min_p_sampling_from_probs_torch`), in vocabulary order: the kept tokens' probabilities after
    temperature, top-k, top-p and min-p (0: dropped), not renormalised (what the function samples from)."""
    import inspect

    import torch
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch as f
    probs = torch.softmax(row[None].float() / t, dim=-1)
    args = (probs, torch.full((1,), top_k or VOCAB, dtype=torch.int32), torch.full((1,), top_p),
            torch.full((1,), min_p), min_p > 0.0, None, torch.zeros(1, dtype=torch.long))
    if "return_filtered_probs" in inspect.signature(f).parameters:      # 0.5.23: it returns them
        _, filtered, idx, _ = f(*args, return_filtered_probs=True)
    else:                                                               # 0.5.15.post1: read on the way
        filtered, idx = _filtered_in_flight(f, args)
    out = torch.zeros(VOCAB, dtype=filtered.dtype)
    out[idx[0].long()] = filtered[0]
    return out


def _filtered_in_flight(f, args):
    """SGLang 0.5.15.post1's function returns only the sampled ids. Its filtered, sorted probabilities are the
    tensor it hands to `torch.multinomial` (sampler.py: `sampled_index = torch.multinomial(probs_sort,
    num_samples=1)`), and their token ids the permutation it gathers the sampled id from (`torch.gather(probs_idx,
    dim=1, index=sampled_index)`): both read as they go in, the real torch functions still doing the work (the
    unseeded path: `args` carry no sampling seed)."""
    import torch
    seen: dict = {}
    real = {"multinomial": torch.multinomial, "gather": torch.gather}

    def reading(name):
        def call(x, *a, **kw):
            seen.setdefault(name, x.clone())
            return real[name](x, *a, **kw)
        return call
    for name in real:
        setattr(torch, name, reading(name))
    try:
        f(*args)
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)
    whole = set(seen) == set(real) and seen["multinomial"].shape == seen["gather"].shape == args[0].shape
    if not whole or not torch.equal(seen["gather"][0].long().sort()[0], torch.arange(VOCAB)):
        raise RuntimeError(f"{f.__module__}.{f.__name__} no longer samples one sorted row through "
                           "torch.multinomial and torch.gather: read its filtered probabilities another way")
    return seen["multinomial"], seen["gather"]


def _generate(run: dict, sampler, out: dict) -> None:
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    model, ids = _model(run.get("moe_bias", 0.0))
    t, name = run["temperature"], run["name"]
    filt = {"top_p": run.get("top_p", 1.0), "top_k": run.get("top_k", 0), "min_p": run.get("min_p", 0.0)}
    for s in range(run["samples"]):
        g = torch.Generator().manual_seed(100 + s)
        prompt = torch.randint(0, VOCAB, (run["prompt"],), generator=g)
        seq, kept, lps, rows, past, filtered = prompt.tolist(), [], [], [], None, []
        x = prompt[None]
        for _ in range(run["response"]):
            o = model(input_ids=x, past_key_values=past, use_cache=True)
            past, row = o.past_key_values, o.logits[0, -1].float()
            rows.append(row.clone().numpy())           # the traced logits row: what the sampler is given
            filtered.append(_filtered(row, t, **filt).numpy())
            kept.append(np.nonzero(filtered[-1] > 0)[0].tolist())
            lo = LogitsProcessorOutput(next_token_logits=row[None].clone())
            tok = sampler.forward(lo, _sampling_info(1, t, **filt), True, [0], [None], torch.tensor([len(seq)]))
            lps.append(float(lo.next_token_logprobs[0]))
            seq.append(int(tok[0]))
            x = tok.view(1, 1).long()
        k = f"{name}/{s}"
        out[f"{k}/tokens"], out[f"{k}/logprobs"], out[f"{k}/logits"] = np.array(seq), np.array(lps), np.stack(rows)
        out[f"{k}/filtered"] = np.stack(filtered)
        out[f"{k}/kept_ids"] = np.array([i for ks in kept for i in ks], dtype=np.int64)
        out[f"{k}/kept_offsets"] = np.cumsum([0] + [len(ks) for ks in kept]).astype(np.int64)
        out[f"{k}/experts"] = np.stack([torch.cat(ids[L])[:len(seq) - 1].numpy() for L in sorted(ids)], 1)
        ids.clear()


def engine(spec: dict, out_path: str) -> None:
    import torch

    from . import sglang_cpu
    sglang_cpu.init_sglang_distributed(tp_size=1)
    from sglang.srt.layers.sampler import Sampler
    torch.manual_seed(spec.get("seed", 0))
    sampler, out = Sampler(), {}
    for run in spec["runs"]:
        _generate(run, sampler, out)
    np.savez(out_path, **out)


def _score(run: dict, eng: dict) -> tuple[list, list, list, list]:
    """The trainer's sequences (the engine's, or with a template token inserted) and its packed logits."""
    import torch
    model, ids = _model(run.get("moe_bias", 0.0))
    seqs, logits, experts, resp = [], [], [], []
    for s in range(run["samples"]):
        k = f"{run['engine']}/{s}"
        seq = eng[f"{k}/tokens"].tolist()
        r = len(eng[f"{k}/logprobs"])
        if run.get("template_shift") == s:          # one more template token before the response: same length
            p = len(seq) - r
            seq = seq[:p] + [run.get("template_token", 7)] + seq[p:-1]
        o = model(input_ids=torch.tensor([seq]))
        seqs.append(seq)
        resp.append(r)
        logits.append(o.logits[0].float())
        experts.append(np.stack([ids[L][-1][:len(seq) - 1].numpy() for L in sorted(ids)], 1))
        ids.clear()
    return seqs, logits, experts, resp


def _slime_metric(run: dict, trainer_lp: list, engine_lp: list, masks: list, seqs: list, resp: list,
                  groups: list) -> float:
    """slime's train_rollout_logprob_abs_diff: loss.py's sum_of_sample_mean(|log_probs - rollout_log_probs|)
    with ray/rollout.py's rollout_mask_sums, then train_metric_utils.reduce_train_step_metrics."""
    import torch
    from megatron.core import parallel_state as mpu
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    from slime.observability.train_metric_utils import reduce_train_step_metrics
    total_mask: dict = {}
    for g, m in zip(groups, masks):
        total_mask[g] = total_mask.get(g, 0) + int(sum(m))
    denoms = [torch.tensor(float(total_mask[g])) for g in groups]
    per_token = bool(run.get("per_token", False))
    f = get_sum_of_sample_mean([len(x) for x in seqs], resp, [torch.tensor(m, dtype=torch.float32) for m in masks],
                               denoms, per_token)
    x = (torch.cat(trainer_lp) - torch.cat(engine_lp)).abs()
    v = f(x)
    n_tokens = sum(max(int(sum(m)), 1) for m in masks)
    out = reduce_train_step_metrics([{"keys": ["train_rollout_logprob_abs_diff"],
                                      "values": torch.tensor([float(n_tokens if per_token else 0), float(v)])}],
                                    calculate_per_token_loss=per_token, step_global_batch_size=len(total_mask),
                                    cp_size=1, dp_with_cp_group=mpu.get_data_parallel_group(with_context_parallel=True))
    return float(out["train_rollout_logprob_abs_diff"])


def _train(run: dict, eng: dict, out: dict) -> None:
    import torch
    from argparse import Namespace
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
    seqs, logits, experts, resp = _score(run, eng)
    args = Namespace(rollout_temperature=run.get("rollout_temperature", 1.0), log_probs_chunk_size=-1,
                     allgather_cp=False, entropy_coef=0.0)
    kw = {}
    if run.get("top_p_replay"):
        keys = [f"{run['engine']}/{s}" for s in range(run["samples"])]
        kw = {"top_p_token_ids": [eng[f"{k}/kept_ids"].tolist() for k in keys],
              "top_p_token_offsets": [eng[f"{k}/kept_offsets"].tolist() for k in keys]}
    _, res = get_log_probs_and_entropy(torch.cat(logits)[None], args=args,
                                       unconcat_tokens=[torch.tensor(x) for x in seqs],
                                       total_lengths=[len(x) for x in seqs], response_lengths=resp, **kw)
    masks = [[0 if (s, i) in {tuple(m) for m in run.get("masked", [])} else 1 for i in range(r)]
             for s, r in enumerate(resp)]
    groups = run.get("groups") or list(range(run["samples"]))
    eng_lp = [torch.tensor(eng[f"{run['engine']}/{s}/logprobs"], dtype=torch.float32) for s in range(run["samples"])]
    name = run["name"]
    out[f"{name}/metric"] = np.array(_slime_metric(run, res["log_probs"], eng_lp, masks, seqs, resp, groups))
    for s, seq in enumerate(seqs):
        k, p = f"{name}/{s}", len(seq) - resp[s]
        out[f"{k}/tokens"], out[f"{k}/logprobs"] = np.array(seq), res["log_probs"][s].numpy().astype(np.float64)
        out[f"{k}/logits"], out[f"{k}/experts"] = logits[s][p - 1:len(seq) - 1].numpy(), experts[s]
        out[f"{k}/mask"] = np.array(masks[s])


def trainer(spec: dict, engine_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from . import slime_vendor
    from .spawn import free_port
    slime_vendor.activate()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    mpu.initialize_model_parallel(1, 1)
    torch.set_grad_enabled(False)
    eng, out = dict(np.load(engine_path)), {}
    for run in spec["runs"]:
        _train(run, eng, out)
    np.savez(out_path, **out)


def produce(spec: dict, workdir: Path, roles: tuple[str, ...] = ("engine", "trainer")) -> tuple[dict, dict]:
    """Run both children for `spec` ({"engine": {"runs": [...]}, "trainer": {"runs": [...]}, "env": {...}})
    once per working folder; returns (engine arrays, trainer arrays)."""
    from .child import run as run_child
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {"engine": workdir / "engine.npz", "trainer": workdir / "trainer.npz"}
    (workdir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, **spec.get("env", {}), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for role, args in (("engine", [str(paths["engine"])]), ("trainer", [str(paths["engine"]), str(paths["trainer"])])):
        if role in roles and not paths[role].exists():
            done = run_child([sys.executable, "-m", "tic_trace.testing.logprob_sides", role, str(workdir / "spec.json"),
                              *args], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"the {role} child failed:\n{done.stderr[-4000:]}")
    return tuple(dict(np.load(paths[r])) if paths[r].exists() else {} for r in ("engine", "trainer"))


if __name__ == "__main__":
    role, spec_file = sys.argv[1], sys.argv[2]
    spec_all = json.loads(Path(spec_file).read_text())
    if role == "engine":
        engine(spec_all["engine"], sys.argv[3])
    else:
        trainer(spec_all["trainer"], sys.argv[3], sys.argv[4])


# The runs the tests share (tests/test_reconcile.py, tests/test_logprob_semantics.py): each trainer run scores
# one engine run's samples; its fault is in the parameters the code runs with, never in the numbers.
SAMPLES, PROMPT, RESPONSE = 3, 6, 8
SPEC = {
    "engine": {"runs": [
        {"name": "clean", "temperature": 1.0, "samples": SAMPLES, "prompt": PROMPT, "response": RESPONSE},
        {"name": "t07", "temperature": 0.7, "samples": SAMPLES, "prompt": PROMPT, "response": RESPONSE},
        {"name": "topp", "temperature": 1.0, "top_p": 0.9, "samples": SAMPLES, "prompt": PROMPT,
         "response": RESPONSE},
        {"name": "combo", "temperature": 0.8, "top_k": 5, "top_p": 0.8, "min_p": 0.1, "samples": 1,
         "prompt": PROMPT, "response": RESPONSE}]},
    "trainer": {"runs": [
        {"name": "clean", "engine": "clean", "samples": SAMPLES},
        {"name": "t07", "engine": "t07", "samples": SAMPLES},                       # --rollout-temperature 1
        {"name": "t07_scaled", "engine": "t07", "samples": SAMPLES, "rollout_temperature": 0.7},
        {"name": "topp", "engine": "topp", "samples": SAMPLES, "top_p_replay": True},
        {"name": "shift", "engine": "clean", "samples": SAMPLES, "template_shift": 1},
        {"name": "r3", "engine": "clean", "samples": SAMPLES, "moe_bias": 0.4},
        {"name": "masked", "engine": "t07", "samples": SAMPLES, "masked": [[1, 2], [2, 0]], "groups": [0, 0, 1]},
        {"name": "per_token", "engine": "t07", "samples": SAMPLES, "masked": [[0, 3]], "per_token": True}]},
}
# The engine with SGLang's own switch for log-probs of the original logits (before the temperature).
SPEC_ORIGINAL = {"engine": {"runs": [dict(SPEC["engine"]["runs"][1], name="original")]},
                 "trainer": {"runs": []}, "env": {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}}


def key(s: int) -> str:
    return f"0-{s}"


def used_side(name: str, arrays: dict, run: str, sampling, samples: int = SAMPLES, logits: bool = True):
    """A `reconcile.Side` from one run's arrays: sample keys "0-{s}", positions of the response tokens."""
    from ..compare.reconcile import Side
    from ..store.used_logprobs import UsedLogprobs
    used, rows = [], {}
    for s in range(samples):
        seq, lp = arrays[f"{run}/{s}/tokens"], arrays[f"{run}/{s}/logprobs"]
        pos = np.arange(len(seq) - len(lp), len(seq))
        used.append(UsedLogprobs(key(s), pos, seq[pos], lp, sampling))
        if logits:
            rows[key(s)] = (pos - 1, arrays[f"{run}/{s}/logits"])
    return Side(name, used, rows if logits else None)
