"""A reference is the whole checkpoint (issue 34, item 3): the shard index is read and checked, the reference
device is checked before any work, and the lm_head is the one transformers would load.

Real components: tiny HF Qwen3 models with random weights, saved by transformers' own `save_pretrained` (sharded
with `max_shard_size`), traced by the real tracer. Faults go into the checkpoint directory (a shard removed,
a shard renamed, a tensor copied into a second shard, an lm_head added), never into a trace.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tic_trace.replay.checkpoint import CheckpointError, HFCheckpoint
from tic_trace.testing.hf_models import sample_tokens
from tic_trace.tools.cli import main as cli

from conftest import bf16_model, checkpointed_trace

IDS = sample_tokens(2, 16)
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(checkpoint dir saved in several shards with its index, trace dir of the same model)."""
    d = tmp_path_factory.mktemp("sharded")
    model = bf16_model(moe=False)
    model.save_pretrained(d / "ck", max_shard_size="40KB")
    ck, a = checkpointed_trace(d / "one", model, IDS)
    return d / "ck", a, ck


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _index(ck: Path) -> dict:
    return json.loads((ck / INDEX).read_text())


def test_a_sharded_checkpoint_is_read_whole_through_its_index(sharded):
    ck, _, whole = sharded
    shards = sorted(p.name for p in ck.glob("*.safetensors"))
    assert len(shards) >= 3 and (ck / INDEX).is_file()
    got = HFCheckpoint(ck)
    assert set(got.info) == set(_index(ck)["weight_map"]) == set(HFCheckpoint(whole).info)
    assert got.notes == []


def test_a_missing_shard_is_an_error_naming_it_never_a_verdict(sharded, tmp_path, capsys):
    ck, a, _ = sharded
    bad = _copy(ck, tmp_path / "ck")
    gone = sorted(set(_index(bad)["weight_map"].values()))[1]
    (bad / gone).unlink()
    with pytest.raises(CheckpointError, match=f"{gone}: shard missing"):
        HFCheckpoint(bad)
    code = cli(["first-divergence", str(a), str(a), "--reference", str(bad)])
    out = capsys.readouterr()
    assert code not in (0, 1), code
    assert gone in out.out + out.err and "CONSISTENT" not in out.out
    # without the index too: the numbered shards say one is missing
    (bad / INDEX).unlink()
    with pytest.raises(CheckpointError, match=f"shard\\(s\\) missing: {gone}"):
        HFCheckpoint(bad)


def test_shards_outside_the_directory_are_refused(sharded, tmp_path):
    ck, _, _ = sharded
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    bad = _copy(ck, tmp_path / "escape")
    idx = _index(bad)
    first = sorted(set(idx["weight_map"].values()))[0]
    shutil.move(bad / first, outside / first)
    idx["weight_map"] = {k: (f"../elsewhere/{first}" if v == first else v) for k, v in idx["weight_map"].items()}
    (bad / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="not a \\*.safetensors file name inside the checkpoint"):
        HFCheckpoint(bad)
    # the index's own name, but a symlink that leads out of the directory
    idx["weight_map"] = {k: (first if v.endswith(first) else v) for k, v in idx["weight_map"].items()}
    (bad / INDEX).write_text(json.dumps(idx))
    os.symlink(outside / first, bad / first)
    with pytest.raises(CheckpointError, match="symlink out of the checkpoint directory"):
        HFCheckpoint(bad)
    # a symlink inside the directory is the checkpoint's own file
    (bad / first).unlink()
    (bad / "store").mkdir()
    shutil.move(outside / first, bad / "store" / first)
    os.symlink(bad / "store" / first, bad / first)
    assert set(HFCheckpoint(bad).info) == set(idx["weight_map"])


def test_every_tensor_is_named_once(sharded, tmp_path):
    from safetensors.torch import load_file, save_file
    ck, _, _ = sharded
    bad = _copy(ck, tmp_path / "dup")
    wm = _index(bad)["weight_map"]
    s1, s2 = sorted(set(wm.values()))[:2]
    t2 = load_file(str(bad / s2))
    name = next(k for k, v in wm.items() if v == s1)
    t2[name] = load_file(str(bad / s1))[name]        # the tensor in a second shard as well
    save_file(t2, str(bad / s2), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {name} is in two files"):
        HFCheckpoint(bad)
    t2.pop(name)
    t2["model.extra.weight"] = torch.zeros(2)        # a tensor the index does not list
    save_file(t2, str(bad / s2), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"model.extra.weight is not listed in {INDEX}"):
        HFCheckpoint(bad)
    t2.pop("model.extra.weight")
    t2.pop(next(k for k, v in wm.items() if v == s2))   # a listed tensor gone from its shard
    save_file(t2, str(bad / s2), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="1 tensor\\(s\\) it lists are in no shard"):
        HFCheckpoint(bad)
    # an unsharded directory: one tensor in two files
    dup = tmp_path / "flat"
    dup.mkdir()
    shutil.copy(sharded[2] / "config.json", dup / "config.json")
    sd = load_file(str(sharded[2] / "model.safetensors"))
    save_file(sd, str(dup / "a.safetensors"), metadata={"format": "pt"})
    save_file({"model.norm.weight": sd["model.norm.weight"]}, str(dup / "b.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight is in two files"):
        HFCheckpoint(dup)


@pytest.mark.parametrize("device", ["meta", "cuda", "cuda:7", "nosuchdevice"])
def test_the_reference_device_is_checked_before_any_work(device, sharded, tmp_path, capsys):
    """Refused when the arguments are read (exit 2, argparse's), before a trace is opened: the traces named here
    do not exist, so any work at all would end on another message."""
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the device")
    try:
        code = cli(["first-divergence", str(tmp_path / "no-a"), str(tmp_path / "no-b"), "--reference",
                    str(sharded[0]), "--reference-device", device])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "--reference-device" in err and "no-a" not in err
    if device == "meta":
        assert "meta holds shapes, not values" in err
    elif device == "cuda" and not torch.cuda.is_available():
        assert "this machine has no cuda device" in err


def _tied_pair(tmp_path):
    model = bf16_model(moe=False, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return checkpointed_trace(tmp_path, model, IDS)


def _with_head(ck: Path, dst: Path, head) -> Path:
    from safetensors.torch import load_file, save_file
    dst = _copy(ck, dst)
    sd = load_file(str(dst / "model.safetensors"))
    assert "lm_head.weight" not in sd
    sd["lm_head.weight"] = head(sd["model.embed_tokens.weight"])
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_tied_trace_against_an_untied_checkpoint_is_not_comparable(tmp_path, capsys):
    """transformers 5 loads a tied config whose checkpoint holds a different lm_head.weight untied: the replay's
    logits would be another op than the traced model's, so the pair is refused naming why."""
    from transformers import AutoModelForCausalLM
    ck, a = _tied_pair(tmp_path)
    other = _with_head(ck, tmp_path / "untied", lambda e: (e.float() * 1.5).to(e.dtype))
    loaded = AutoModelForCausalLM.from_pretrained(other)
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)   # what transformers does
    got = HFCheckpoint(other)
    assert got.tie_word_embeddings is False and "loads them untied" in got.tie_note
    assert cli(["first-divergence", str(a), str(a), "--reference", str(other)]) == 3
    out = capsys.readouterr().out
    assert "tie_word_embeddings" in out and "loads them untied" in out and "ABNORMAL" not in out


def test_a_tied_checkpoint_with_an_equal_lm_head_stays_tied(tmp_path, capsys):
    ck, a = _tied_pair(tmp_path)
    same = _with_head(ck, tmp_path / "same", lambda e: e.clone())
    loaded = __import__("transformers").AutoModelForCausalLM.from_pretrained(same)
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    assert HFCheckpoint(same).tie_word_embeddings is True
    assert cli(["first-divergence", str(a), str(a), "--reference", str(same)]) == 0
    assert "CONSISTENT" in capsys.readouterr().out


def test_a_tied_checkpoint_saved_under_the_heads_name_gives_the_embedding(tmp_path, capsys):
    """transformers loads a tied model whose checkpoint holds only lm_head.weight with the embedding from it;
    the reference does the same (every point replayed, the weights confirmed by the hashes)."""
    from safetensors.torch import load_file, save_file
    ck, a = _tied_pair(tmp_path)
    head_only = _copy(ck, tmp_path / "head_only")
    sd = load_file(str(head_only / "model.safetensors"))
    sd["lm_head.weight"] = sd.pop("model.embed_tokens.weight")
    save_file(sd, str(head_only / "model.safetensors"), metadata={"format": "pt"})
    loaded = __import__("transformers").AutoModelForCausalLM.from_pretrained(head_only)
    assert torch.equal(loaded.model.embed_tokens.weight, sd["lm_head.weight"])
    got = HFCheckpoint(head_only)
    assert got.tie_word_embeddings is True and torch.equal(got.raw("model.embed_tokens.weight"), sd["lm_head.weight"])
    assert cli(["first-divergence", str(a), str(a), "--reference", str(head_only)]) == 0
    out = capsys.readouterr().out
    assert "CONSISTENT" in out and "not replayed" not in out and "not confirmed" not in out


def test_a_hub_snapshot_links_into_its_blob_store(sharded, tmp_path):
    """The hub cache's layout (snapshots/<rev>/* -> ../../blobs/<hash>) is a checkpoint's own files."""
    _, _, whole = sharded
    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for name, blob in (("config.json", "c0ffee"), ("model.safetensors", "beef01")):
        shutil.copy(whole / name, repo / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snap / name)
    assert set(HFCheckpoint(snap).info) == set(HFCheckpoint(whole).info)
