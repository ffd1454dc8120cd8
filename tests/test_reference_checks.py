"""The exact reference says only what the traces show (issue 22): a checkpoint is checked before it is used,
and blame needs a difference.

Real components throughout: tiny HF Qwen3(-MoE) models with random weights, traced by the real tracer, saved
as real HF checkpoints. Faults go into the computation (a patched module) or into the checkpoint file (a
tensor edited, a config value changed, a FIFO in place of a file), never into a trace.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tic_trace
from tic_trace.testing import child
from tic_trace.view.align import CanonicalView
from tic_trace.replay.checkpoint import CheckpointError, HFCheckpoint
from tic_trace.replay.intrinsic import IntrinsicError, NotReplayed, replay_side
from tic_trace.replay.intrinsic_verdict import abnormal, intrinsic_verdict
from tic_trace.replay.reference import ExactReference
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
from tic_trace.testing.precision_faults import PRECISION_FAULTS
from tic_trace.tools.cli import main as cli

from conftest import bf16_model, checkpointed_trace, trace_hf

IDS = sample_tokens(2, 16)


def _trace_without_hashes(model, path, ids=IDS):
    """A real trace that recorded no parameter hashes (as traces of adapters whose parameter names are not the
    checkpoint's are, for the checkpoint's purposes): nothing confirms or contradicts the checkpoint's weights."""
    t = tic_trace.trace(model, path, adapter="hf", points_mode="full")
    t.hash_weights = False
    with t, torch.no_grad():
        model(ids)
    assert t.failed is None, t.failed


def _edited_checkpoint(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of checkpoint `src` with `tensors(state_dict)` and `config(dict)` applied (in place)."""
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    if tensors:
        tensors(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def _err(excess=1.4, rel=None, floor=1.6e-3, dtype="bfloat16", nonfinite=0, point="attn_norm"):
    return IntrinsicError(point, 1, dtype, 32, 2048, mean_ulp=0.3, max_ulp=1.3, share_rounded=0.7,
                          rel_l2=rel if rel is not None else excess * floor, rel_floor=floor, nonfinite=nonfinite)


# ================================================================================================ 1. blame needs a difference

@pytest.mark.parametrize("a,b", [
    # the exact value is representable (no rounding floor): both excesses are infinite, the same evidence
    (_err(rel=2e-2, floor=0.0), _err(rel=2e-2, floor=0.0)),
    (_err(rel=2e-2, floor=0.0, point="embed"), _err(rel=3e-2, floor=0.0, point="embed")),
    # both sides hold NaN/Inf where the exact op has none: alike, whatever their finite elements say
    (_err(excess=1.4, nonfinite=5), _err(excess=1.9, nonfinite=5)),
    # another dtype on each side, both exactly on the exact value: equally exact
    (_err(rel=0.0, point="logits"), _err(rel=0.0, dtype="float32", point="logits")),
], ids=["both-inf", "both-inf-other-size", "both-nonfinite", "both-exact-other-dtypes"])
def test_equal_or_nonfinite_evidence_blames_no_side(a, b):
    for x, y in ((a, b), (b, a)):
        v = intrinsic_verdict(x, y)
        assert v.side is None, v.reason
        assert "alike" in v.reason, v.reason


def test_a_real_difference_still_blames():
    """The guard against a rule that never blames: one side off where exact is representable, the other on it."""
    v = intrinsic_verdict(_err(rel=0.0, floor=0.0, point="embed"), _err(rel=2e-2, floor=0.0, point="embed"))
    assert (v.side, v.kind) == ("B", "intrinsic"), v.reason


def test_a_trace_against_itself_is_never_blamed_with_an_unconfirmed_checkpoint(tmp_path, capsys):
    """A trace compared with itself, replayed against another seed's checkpoint (no parameter hash to say it is
    the wrong one): both sides are equally far from exact at every point, infinitely so at the embedding (whose
    exact value is representable), and no side is less exact. The contract says no hash was compared."""
    bf16_model(moe=False, seed=1).save_pretrained(tmp_path / "other")
    _trace_without_hashes(bf16_model(moe=False), tmp_path / "a")
    a = str(tmp_path / "a")
    assert cli(["first-divergence", a, a, "--reference", str(tmp_path / "other")]) == 0
    out = capsys.readouterr().out
    assert "less exact" not in out and "CONSISTENT" in out.splitlines()[0]
    assert "hashes agree" not in out and "no parameter hash" in out


# ================================================================================================ 2. checked before use

def test_a_checkpoint_of_another_model_is_not_comparable(tmp_path, capsys):
    """Another layer count, or another MLP width under the same parameter names: exit 3 naming what differs,
    for the pair and for one trace, never a divergence at the embedding."""
    ck, a = checkpointed_trace(tmp_path, bf16_model(moe=False), IDS)
    bf16_model(moe=False, num_hidden_layers=3).save_pretrained(tmp_path / "deeper")
    assert cli(["first-divergence", str(a), str(a), "--reference", str(tmp_path / "deeper")]) == 3
    out = capsys.readouterr().out
    assert "NOT COMPARABLE" in out.upper() and "num_layers" in out and "side A 2" in out and "checkpoint 3" in out
    assert "FIRST DIVERGENCE" not in out
    assert cli(["replay", str(a), "--reference", str(tmp_path / "deeper")]) == 3
    assert "num_layers" in capsys.readouterr().out
    bf16_model(moe=False, intermediate_size=192).save_pretrained(tmp_path / "wider")
    assert cli(["first-divergence", str(a), str(a), "--reference", str(tmp_path / "wider")]) == 3
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.gate_proj.weight" in out and "[128, 64]" in out and "[192, 64]" in out


@pytest.mark.parametrize("how", ["other-seed", "int8"])
def test_a_checkpoint_that_is_not_the_weights_the_run_used_is_not_comparable(tmp_path, capsys, how):
    """The traces recorded parameter hashes: a checkpoint that no side's hashes agree with (another seed), or
    one holding integer (quantized) weights where the run held floats, is exit 3 naming the parameters."""
    ck, a = checkpointed_trace(tmp_path, bf16_model(moe=False), IDS)
    if how == "other-seed":
        bf16_model(moe=False, seed=1).save_pretrained(tmp_path / "ref")
        name = "model.embed_tokens.weight"
    else:
        name = "model.layers.1.self_attn.q_proj.weight"
        _edited_checkpoint(ck, tmp_path / "ref", tensors=lambda sd: sd.update(
            {name: (sd[name].float() * 100).round().to(torch.int8)}))
    assert cli(["first-divergence", str(a), str(a), "--reference", str(tmp_path / "ref")]) == 3
    out = capsys.readouterr().out
    assert name in out and "FIRST DIVERGENCE" not in out
    if how == "int8":
        assert "int8" in out


def test_an_fp32_checkpoint_of_a_bf16_run_is_rounded_to_each_sides_dtype(tmp_path, capsys):
    """The common case: the HF checkpoint in fp32, the run in bf16. Each side's exact replay uses the
    checkpoint's weights rounded to the dtype that side held them in (bf16 for a bf16 side, fp32 for an fp32
    side): a clean bf16 trace replays clean, a planted bf16 fault is found, and the contract says which dtype
    each side's weights were rounded to (never that hashes agree when they were compared after rounding)."""
    cfg = tiny_qwen3_config(moe=False)
    build_hf_model_stable(cfg, seed=0, dtype=torch.float32).save_pretrained(tmp_path / "ck32")
    ck = str(tmp_path / "ck32")
    trace_hf(bf16_model(moe=False), tmp_path / "a", IDS)                       # clean bf16
    bad = bf16_model(moe=False)
    PRECISION_FAULTS["rmsnorm_no_upcast"].plant(bad, 1)
    trace_hf(bad, tmp_path / "b", IDS)                                         # bf16, fault at L1.attn_norm
    trace_hf(build_hf_model_stable(cfg, seed=0, dtype=torch.float32), tmp_path / "c", IDS)   # clean fp32
    assert cli(["replay", str(tmp_path / "a"), "--reference", ck]) == 0
    assert "ABNORMAL" not in capsys.readouterr().out
    assert cli(["replay", str(tmp_path / "c"), "--reference", ck]) == 0
    capsys.readouterr()
    from tic_trace import find_divergence
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=ck)
    assert (rep.first["key"], rep.first["cause"], rep.first["replay"]["side"]) == ("L1.attn_norm", "intrinsic", "B")
    rounding = {d["side"]: d for d in rep.contract if d["section"] == "reference" and d["key"] == "weights"}
    assert set(rounding) == {"A", "B"} and all(d["a"] == "bfloat16" and d["b"] == "float32" for d in rounding.values())
    assert "rounded to bfloat16" in rounding["A"]["note"]
    # per side: the fp32 side runs the checkpoint's own dtype, so its contract says nothing about rounding
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "c"), reference=ck)
    assert {d["side"] for d in rep.contract if d["section"] == "reference" and d["key"] == "weights"} == {"A"}
    assert all(p.replay["side"] in (None, "A") for p in rep.points if p.replay)


def test_a_nonfinite_reference_value_is_not_replayed(tmp_path, capsys):
    """A NaN in the checkpoint's layer-1 input norm makes the exact op non-finite there: that point is not
    replayed (the reason names the tensor), never "0 ULP, 100% correctly rounded"; the fault planted at that
    point is then judged by the A-B rule alone, and the report says so."""
    bf16_model(moe=False).save_pretrained(tmp_path / "ck")
    ck = tmp_path / "ck"
    name = "model.layers.1.input_layernorm.weight"

    def nan(sd):
        sd[name] = sd[name].clone()
        sd[name][3] = float("nan")
    nck = _edited_checkpoint(ck, tmp_path / "nan", tensors=nan)
    _trace_without_hashes(bf16_model(moe=False), tmp_path / "a")
    bad = bf16_model(moe=False)
    PRECISION_FAULTS["rmsnorm_no_upcast"].plant(bad, 1)
    _trace_without_hashes(bad, tmp_path / "b")
    res = {r.key: r for r in replay_side(CanonicalView(str(tmp_path / "b")), ExactReference(str(nck)))}
    r = res["L1.attn_norm"]
    assert isinstance(r, NotReplayed) and "non-finite" in r.reason and name in r.reason, r
    assert isinstance(res["L0.attn_norm"], IntrinsicError)                  # the rest is replayed as before
    from tic_trace import find_divergence
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(nck))
    p = next(p for p in rep.points if p.key == "L1.attn_norm")
    assert all("non-finite" in p.intrinsic[s]["not_replayed"] for s in ("a", "b"))
    assert "L1.attn_norm" in next(n for n in rep.notes if n.kind == "not_replayed").detail["points"]
    assert cli(["replay", str(tmp_path / "b"), "--reference", str(nck), "--layers", "1"]) in (0, 1)
    out = capsys.readouterr().out
    assert "not replayed" in out and "100.0%" not in [ln for ln in out.splitlines() if "L1.attn_norm" in ln][0]


def test_a_missing_q_norm_weight_is_not_replayed_and_changes_no_op(tmp_path):
    """Without layer 0's q_norm in the checkpoint, L0.attn.q_norm is not replayed (naming the tensor); RoPE
    still reads the side's own q_norm output (the op the side ran), so every RoPE point stays clean."""
    ck, a = checkpointed_trace(tmp_path, bf16_model(moe=False), IDS)
    name = "model.layers.0.self_attn.q_norm.weight"
    nck = _edited_checkpoint(ck, tmp_path / "noqn", tensors=lambda sd: sd.pop(name))
    res = {r.key: r for r in replay_side(CanonicalView(str(a)), ExactReference(str(nck)))}
    assert isinstance(res["L0.attn.q_norm"], NotReplayed) and name in res["L0.attn.q_norm"].reason
    ropes = [res[f"L{i}.attn.{w}_rope"] for i in (0, 1) for w in "qk"]
    assert all(isinstance(r, IntrinsicError) and not abnormal(r) for r in ropes), ropes


# ================================================================================================ hostile checkpoints

def _run(args: list[str], fifo: Path, seconds: int = 120) -> subprocess.CompletedProcess:
    """`python args` in a child process (a thread would not do: a reader blocked opening a FIFO inside native
    code holds the GIL); fails if it is still running after `seconds`, releasing the FIFO first."""
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=seconds,
                              cwd=Path(__file__).parent.parent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still blocked on the FIFO {fifo} after {seconds} s")


_OPEN = r"""
import sys
from tic_trace.replay.checkpoint import CheckpointError, HFCheckpoint
try:
    HFCheckpoint(sys.argv[1])
    print("opened")
except CheckpointError as e:
    print("CheckpointError:", e)
"""


@pytest.mark.parametrize("file", ["model.safetensors", "config.json"])
def test_fifos_and_devices_in_a_checkpoint_are_refused_at_once(tmp_path, file):
    ck = tmp_path / "ck"
    bf16_model(moe=False, num_hidden_layers=1).save_pretrained(ck)
    p = ck / file
    p.unlink()
    os.mkfifo(p)
    out = _run(["-c", _OPEN, str(ck)], p, 60).stdout
    assert "CheckpointError" in out and str(p) in out and "not a regular file" in out, out
    p.unlink()
    os.symlink("/dev/zero", p)                          # a device behind a symlink: refused by what it is
    with pytest.raises(CheckpointError, match="not a regular file"):
        HFCheckpoint(ck)


def test_slime_report_with_a_fifo_in_the_recorded_checkpoint_does_not_hang(tmp_path):
    """slime-report takes the checkpoint path from the Megatron side's own manifest: a FIFO there turns the
    replay off with the reason, and the report runs."""
    from tic_trace.integrations.slime.config import rollout_dir
    ck = tmp_path / "ck"
    model = bf16_model(moe=False, num_hidden_layers=1)
    model.save_pretrained(ck)
    fifo = ck / "model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    rdir = rollout_dir(tmp_path / "run", 0)
    ids = sample_tokens(2, 6)
    trace_hf(model, rdir / "megatron", ids, manifest={"slime": {"rollout_id": 0, "hf_checkpoint": str(ck)}})
    trace_hf(model, rdir / "sglang", ids)
    p = _run(["-m", "tic_trace.tools.cli", "slime-report", str(tmp_path / "run"), "--rollout-id", "0"], fifo, 240)
    out = " ".join(p.stdout.split())               # rich wraps long lines
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "exact replay: off" in out and "not a regular file" in out and str(fifo) in out, out


_PEAK = r"""
import json, resource, sys
from tic_trace.replay.checkpoint import CheckpointError, HFCheckpoint
from tic_trace.replay.reference import ExactReference
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = peak_mb()
try:
    ref = ExactReference(sys.argv[1])
    ref.weights(None).get("model.embed_tokens.weight")       # what replaying the embedding reads
    msg = None
except CheckpointError as e:
    msg = str(e)
print(json.dumps({"error": msg, "grew_mb": peak_mb() - base}))
"""


def _peak(ck: Path) -> dict:
    p = child.run([sys.executable, "-c", _PEAK, str(ck)], capture_output=True, text=True,
                  cwd=Path(__file__).parent.parent)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_size_claims_in_a_checkpoint_are_checked_before_allocation(tmp_path):
    """A sparse 1 GiB config.json, and an embedding whose header claims 4M rows where config.json says 128
    (the data region sparse, so the file is valid): both refused from their size, naming the file, before
    anything of that size is read or allocated (peak memory grows by far less than the claims)."""
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "config.json", "wb") as f:
        f.truncate(1 << 30)
    got = _peak(big)
    assert got["error"] and "config.json" in got["error"] and "limit" in got["error"], got
    assert got["grew_mb"] < 200, got

    rows = tmp_path / "rows"
    rows.mkdir()
    cfg = tiny_qwen3_config(moe=False).to_dict()
    (rows / "config.json").write_text(json.dumps(cfg))
    n = 4 << 20
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [n, 64],
                                                       "data_offsets": [0, n * 64 * 2]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(rows / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + n * 64 * 2)
    got = _peak(rows)
    assert got["error"] and "model.embed_tokens.weight" in got["error"], got
    assert f"[{n}, 64]" in got["error"] and "[128, 64]" in got["error"], got
    assert got["grew_mb"] < 200, got


@pytest.mark.parametrize("raw,key", [
    ("[1, 2, 3]", None),                                                       # not an object
    ("deep", None),                                                            # nested past the parser's depth
    (b'{"hidden_size": 64, "model_type": "\xff"}', None),                      # not UTF-8
    ({"num_attention_heads": 0}, "num_attention_heads"),                       # ZeroDivisionError before
    ({"hidden_size": "64"}, "hidden_size"),                                    # a string where a number belongs
    ({"rms_norm_eps": -1}, "rms_norm_eps"),                                    # a non-finite reference before
    ({"num_key_value_heads": 3}, "num_key_value_heads"),                       # 4 query heads in 3 groups
    ({"text_config": 5}, "text_config"),
    ({"rope_parameters": {"rope_theta": "x", "rope_type": "default"}}, "rope_parameters.rope_theta"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "64"}},
     "rope_parameters.original_max_position_embeddings"),
], ids=["list", "deep", "not-utf8", "heads-0", "string-number", "eps-negative", "kv-groups", "text-config",
        "rope-theta", "yarn-original-max"])
def test_config_values_are_checked_by_one_schema(tmp_path, raw, key):
    """Every value the reference reads from config.json is checked by type and range; an error names
    config.json, the key and what was expected, and is a CheckpointError (the CLI: one line, exit 2)."""
    ck = tmp_path / "ck"
    bf16_model(moe=False, num_hidden_layers=1).save_pretrained(ck)
    cfg = json.loads((ck / "config.json").read_text())
    if isinstance(raw, dict):
        cfg.update(raw)
        (ck / "config.json").write_text(json.dumps(cfg))
    elif raw == "deep":
        (ck / "config.json").write_text('{"rope_parameters": ' + "[" * 100000 + "]" * 100000 + "}")
    else:
        (ck / "config.json").write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    with pytest.raises(CheckpointError) as ei:
        ExactReference(str(ck))
    msg = str(ei.value)
    assert str(ck / "config.json") in msg, msg
    if key is not None:
        assert f"'{key}'" in msg and "must be" in msg, msg


def test_token_ids_outside_the_vocabulary_are_not_replayed_naming_the_row(tmp_path, capsys):
    """A run that fed token ids -1 and 130 to a 128-row embedding (its embedding clamps them: the fault is
    in the computation): the embedding point is not replayed, naming the row and the id, never an
    IndexError and never row -1 read as the last row. The finder runs to an answer."""
    model = bf16_model(moe=False)
    model.save_pretrained(tmp_path / "ck")
    emb = model.model.embed_tokens
    forward = emb.forward
    emb.forward = lambda ids: forward(ids.clamp(0, 127))
    ids = IDS.clone()
    ids[0, 2], ids[1, 3] = -1, 130
    trace_hf(model, tmp_path / "a", ids)
    res = {r.key: r for r in replay_side(CanonicalView(str(tmp_path / "a")), ExactReference(str(tmp_path / "ck")))}
    e = res["embed"]
    assert isinstance(e, NotReplayed) and "-1" in e.reason and "130" in e.reason and "s0@2" in e.reason, e
    assert isinstance(res["L0.attn_norm"], IntrinsicError)
    a = str(tmp_path / "a")
    assert cli(["first-divergence", a, a, "--reference", str(tmp_path / "ck")]) in (0, 3)
    out = capsys.readouterr().out
    assert "IndexError" not in out and "less exact" not in out
