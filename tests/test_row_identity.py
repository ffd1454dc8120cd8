"""Rows carry their identity (issue 22, item 3): a row is (sample, position, token), and the comparator says
so when the two sides' rows are not the same rows instead of blaming an operator.

Every fault here is in the computation the traced model ran (a batch fed in another order, positions shifted,
padding without its mask, a decode step at the wrong position, the same sample keys on two batches, a model
with one more layer); no test edits a trace. Verdicts are the finder's; nothing compares two different
computations bit for bit.
"""
from __future__ import annotations

import torch

import tic_trace
from tic_trace.view.align import CanonicalView
from tic_trace.compare.diverge import find_divergence, rejudge
from tic_trace.report.html import render_html
from tic_trace.report.terminal import headline
from tic_trace.testing.faults import plant
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config

PROMPT = 6
IDS = sample_tokens(2, PROMPT + 3, seed=1)        # two samples: a 6-token prompt and 3 more tokens each


def dense(**cfg):
    return build_hf_model(tiny_qwen3_config(moe=False, **cfg))


def traced(out, model, run, **kw) -> str:
    """`run(model, tracer)` under the tracer (canonical points in full); the trace directory."""
    kw.setdefault("points_mode", "full")
    with tic_trace.trace(model, out, adapter="hf", **kw) as t, torch.no_grad():
        run(model, t)
    assert t.failed is None, t.failed
    return str(out)


def decode_by_hand(model, t, ids, prompt=PROMPT, position_ids=None):
    """A prefill of `prompt` tokens, then one forward per further token through the KV cache, one pass each,
    the way an engine steps decode. `position_ids(j)` (None: the model's own, past length + 0) is what the
    decode step for token j is told."""
    out = model(ids[:, :prompt], use_cache=True)
    cache = out.cache
    for j in range(prompt, ids.shape[1]):
        t.step()
        kw = {} if position_ids is None else {"position_ids": position_ids(j)}
        cache = model(ids[:, j:j + 1], cache=cache, use_cache=True, **kw).cache


def same_rows_both_ways(rep) -> None:
    """The verdict is reproducible from the report alone (rejudge reads no tensor)."""
    doc = rep.to_json()
    assert rejudge(doc) == doc


# ------------------------------------------------------------------------------------------------ tokens

def test_swapped_batch_order_is_not_comparable(tmp_path):
    """Side B is fed the batch in the other order under the same sample keys: every row's token differs, so
    no row is comparable (exit 3), and nothing is blamed on the embedding."""
    ids = IDS[:, :PROMPT]
    assert ids[0, 0] != ids[1, 0]
    a = traced(tmp_path / "a", dense(), lambda m, t: m(ids))
    b = traced(tmp_path / "b", dense(), lambda m, t: m(ids.flip(0)))
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "not_comparable" and rep.exit_code == 3, line
    assert rep.first is None and not rep.findings, line
    assert line.startswith("NOT COMPARABLE") and "different tokens at s0@0" in line, line
    assert f"s0@0 (A {int(ids[0, 0])}, B {int(ids[1, 0])})" in line, line
    assert rep.rows["excluded"] == ids.numel() and rep.rows["matched"] == 0
    same_rows_both_ways(rep)


def test_positions_shifted_by_one_are_not_comparable(tmp_path):
    """Side B's model is told positions 1..S for tokens 0..S-1: its row at position p holds token p-1, so
    the rows both sides have at 1..S-1 hold different tokens."""
    ids = IDS[:, :PROMPT]
    a = traced(tmp_path / "a", dense(), lambda m, t: m(ids))
    shifted = torch.arange(1, PROMPT + 1).unsqueeze(0).expand(2, -1)
    b = traced(tmp_path / "b", dense(), lambda m, t: m(ids, position_ids=shifted))
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "not_comparable" and rep.exit_code == 3, line
    assert rep.first is None and not rep.findings, line
    assert f"s0@1 (A {int(ids[0, 1])}, B {int(ids[0, 0])})" in line, line
    assert rep.rows["matched"] == 0


def test_left_padding_without_the_mask(tmp_path):
    """A left-padded batch: side A passes the mask and position ids from it (rows of s0 at positions 0..3),
    side B loses the mask, so its model reads the two pad tokens as s0's first tokens. s0's rows hold
    different tokens and are left out (the count is said); s1, unpadded, is compared."""
    s0, s1 = IDS[0, :4], IDS[1, :PROMPT]
    pad = 0
    assert int(s0[0]) != pad
    batch = torch.stack([torch.cat([torch.full((2,), pad), s0]), s1])
    mask = torch.ones_like(batch)
    mask[0, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    a = traced(tmp_path / "a", dense(), lambda m, t: m(batch, attention_mask=mask, position_ids=pos))
    b = traced(tmp_path / "b", dense(), lambda m, t: m(batch))
    assert CanonicalView(a).trace.open_pass(0, 0).rows["positions"][2:6] == [0, 1, 2, 3]
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert not any(f.key == "embed" for f in rep.findings), line
    assert rep.rows["excluded"] == 4 and rep.rows["matched"] == PROMPT, rep.rows
    assert rep.identity["different_tokens"][0] == {"sample": "s0", "position": 0, "token_a": int(s0[0]),
                                                   "token_b": pad}
    # the other rows agree: a verdict on them, with the rows left out said on the verdict line
    assert rep.verdict == "consistent", line
    assert "4 rows left out: different tokens at s0@0" in line, line
    same_rows_both_ways(rep)


# ------------------------------------------------------------------------------------------------ duplicates

def test_duplicate_row_keys_are_an_error(tmp_path):
    """Side B traces two batches of two samples without naming them: both passes' rows are s0, s1. The second
    batch's rows are not dropped in favour of the first: the duplicates are named and nothing is judged."""
    four = sample_tokens(4, PROMPT, seed=3)
    a = traced(tmp_path / "a", dense(), lambda m, t: m(four))

    def two_batches(m, t):
        m(four[:2])
        t.step()
        m(four[2:])
    b = traced(tmp_path / "b", dense(), two_batches)
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "not_comparable" and rep.exit_code == 3, line
    assert "side B holds 12 (sample, position) rows more than once" in line, line
    assert "s0@0 (2 times)" in line, line
    assert rep.identity["duplicates"]["b"][0] == {"sample": "s0", "position": 0, "times": 2}
    assert (rep.rows["duplicates_a"], rep.rows["duplicates_b"]) == (0, 12)
    same_rows_both_ways(rep)


# ------------------------------------------------------------------------------------------------ positions

def test_hand_stepped_decode_rows_are_keyed_by_the_past_length(tmp_path):
    """Decode stepped by hand through the cache, without position ids: the model runs token j at position
    past length + 0 = j, so its row is s@j (not s@0). Against one forward over the whole sequence every row
    matches."""
    a = traced(tmp_path / "a", dense(), lambda m, t: m(IDS))
    b = traced(tmp_path / "b", dense(), lambda m, t: decode_by_hand(m, t, IDS))
    vb = CanonicalView(b)
    assert [vb.trace.open_pass(0, i).rows["positions"] for i in (1, 2, 3)] == [[6, 6], [7, 7], [8, 8]]
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "consistent", line
    n = IDS.numel()
    assert (rep.rows["a"], rep.rows["b"], rep.rows["matched"]) == (n, n, n)
    assert (rep.rows["unmatched_a"], rep.rows["unmatched_b"]) == (0, 0)


def test_decode_at_the_wrong_position_is_not_consistent(tmp_path):
    """Side B's decode steps run at position j+3 instead of j (prefill right, decode wrong): its decode rows
    are where its model put them, and match no row of A. The answer says how many and is not CONSISTENT."""
    wrong = lambda j: torch.full((2, 1), j + 3)            # noqa: E731
    a = traced(tmp_path / "a", dense(), lambda m, t: decode_by_hand(m, t, IDS))
    b = traced(tmp_path / "b", dense(), lambda m, t: decode_by_hand(m, t, IDS, position_ids=wrong))
    rep = find_divergence(a, b)
    doc = rep.to_json()
    line = headline(doc)
    assert rep.verdict == "not_comparable" and rep.exit_code == 3, line
    assert "6 of 18 rows of side B match no row of A" in line, line
    assert (rep.rows["unmatched_a"], rep.rows["unmatched_b"]) == (6, 6)
    assert "6 of 18 rows of side B match no row of A" in render_html(doc)
    same_rows_both_ways(rep)


def test_unmatched_rows_are_shown_in_every_verdict_line(tmp_path):
    """Side B traced only sample s0: a verdict on s0's rows, and the rows of A it could not compare are
    counted on the verdict line, in the JSON rows and in the HTML page, consistent or divergent."""
    ids = IDS[:, :PROMPT]
    a = traced(tmp_path / "a", dense(), lambda m, t: m(ids))
    b = traced(tmp_path / "b", dense(), lambda m, t: m(ids[:1]))
    rep = find_divergence(a, b)
    doc = rep.to_json()
    line = headline(doc)
    assert rep.verdict == "consistent", line
    assert "6 of 12 rows of side A match no row of B" in line, line
    assert (doc["rows"]["unmatched_a"], doc["rows"]["unmatched_b"]) == (6, 0)
    assert "6 of 12 rows of side A match no row of B" in render_html(doc)
    model = dense()
    plant(model, "hf", "o_proj_weight", 0)
    c = traced(tmp_path / "c", model, lambda m, t: m(ids[:1]))
    rep = find_divergence(a, c)
    line = headline(rep.to_json())
    assert rep.verdict == "divergent" and line.startswith("FIRST DIVERGENCE at L0.attn.out"), line
    assert "6 of 12 rows of side A match no row of B" in line, line


# ------------------------------------------------------------------------------------------------ kept rows

def test_generate_traces_compare_the_kept_rows(tmp_path):
    """`generate()` (one pass per forward) computes the logits of the last position only
    (`logits_to_keep=1`): those records are the last row of each sample, compared against the same rows of a
    forward over the whole sequence, and a fault in lm_head is found there."""
    prompt = IDS[:, :PROMPT]
    out = {}

    def gen(m, t):
        out["seq"] = m.generate(input_ids=prompt, max_new_tokens=3, do_sample=False)
    a = traced(tmp_path / "a", dense(), gen, auto_step=True)
    fed = out["seq"][:, :-1]                  # the last token is sampled, never fed back
    b = traced(tmp_path / "b", dense(), lambda m, t: m(fed))
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "consistent", line
    logits = next(p for p in rep.points if p.key == "logits")
    assert (logits.rows, logits.only_a, logits.only_b) == (6, 0, fed.numel() - 6)
    assert {r for r in CanonicalView(a).load("logits", None).rows} == {
        (s, p) for s in ("s0", "s1") for p in (5, 6, 7)}
    model = dense()
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)
    c = traced(tmp_path / "c", model, lambda m, t: m(fed))
    rep = find_divergence(a, c)
    assert rep.verdict == "divergent" and rep.first.key == "logits" and rep.first.rows == 6, headline(rep.to_json())


def test_logits_to_keep_rows_are_the_last_positions_of_each_sample(tmp_path):
    ids = IDS[:, :PROMPT]
    a = traced(tmp_path / "a", dense(), lambda m, t: m(ids))
    b = traced(tmp_path / "b", dense(), lambda m, t: m(ids, logits_to_keep=2))
    assert CanonicalView(b).load("logits", None).rows == [("s0", 4), ("s0", 5), ("s1", 4), ("s1", 5)]
    rep = find_divergence(a, b)
    assert rep.verdict == "consistent", headline(rep.to_json())
    assert next(p for p in rep.points if p.key == "logits").rows == 4


# ------------------------------------------------------------------------------------------------ structure

def test_extra_decoder_layer_is_a_structural_difference(tmp_path):
    """Side B has the same weights plus a third decoder layer: its final norm reads another layer's output.
    That is a structural difference, named as such (not comparable), never an operator finding at final_norm."""
    ids = IDS[:, :PROMPT]
    small = dense()
    big = dense(num_hidden_layers=3)
    missing, _ = big.load_state_dict(small.state_dict(), strict=False)
    assert missing and all(k.startswith("model.layers.2.") for k in missing)
    a = traced(tmp_path / "a", small, lambda m, t: m(ids))
    b = traced(tmp_path / "b", big.eval(), lambda m, t: m(ids))
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "not_comparable" and rep.exit_code == 3, line
    assert "side B has 3 layers, side A 2" in line, line
    assert not any(f.key == "final_norm" for f in rep.findings), line
    assert {x["key"] for x in rep.not_comparable} >= {"final_norm", "logits"}
    # the layers both have are compared (and agree)
    assert all(p.status == "ok" for p in rep.points if p.layer is not None and p.layer < 2)
    same_rows_both_ways(rep)
