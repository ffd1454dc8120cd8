"""Headlines that say no more than the evidence (issue 34, item 5) and saved attributions checked by their
schema (item 4). Real transformers Qwen3 models, faults planted in one side's computation, never in a trace.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from tic_trace import find_divergence
from tic_trace.testing.faults import plant
from tic_trace.testing.hf_models import sample_tokens
from tic_trace.tools.cli import main as cli

from conftest import changed_pair

IDS = sample_tokens(2, 16)


def _pair(tmp, dtype, moe, change):
    return changed_pair(tmp, dtype, moe, change, IDS)


@pytest.fixture(scope="module")
def attributed(tmp_path_factory) -> dict:
    """An fp32 pair with a planted softmax-scale fault, attributed: its saved JSON report."""
    a, b, ck = _pair(tmp_path_factory.mktemp("att"), torch.float32, True,
                     lambda m: plant(m, "hf", "softmax_scale", 1))
    doc = find_divergence(a, b, reference=ck, attribution=True).to_json()
    assert "unavailable" not in doc["attribution"], doc["attribution"]
    return json.loads(json.dumps(doc))


# ------------------------------------------------------------------------------------------ saved attribution

def _edit_share_null(att):
    att["by_point"][0]["share"] = None


def _edit_share_text(att):
    att["by_point"][0]["share"] = "a lot"


def _edit_gap_negative(att):
    att["gap"] = -1


def _edit_not_attributed_text(att):
    att["not_attributed"] = "abc"


@pytest.mark.parametrize("edit,field", [(_edit_share_null, "attribution.by_point[0].share"),
                                        (_edit_share_text, "attribution.by_point[0].share"),
                                        (_edit_gap_negative, "attribution.gap"),
                                        (_edit_not_attributed_text, "attribution.not_attributed")])
def test_a_malformed_saved_attribution_is_refused_naming_the_file_and_field(attributed, tmp_path, capsys, edit,
                                                                             field):
    doc = copy.deepcopy(attributed)
    edit(doc["attribution"])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    code = cli(["report", "x", "--from-json", str(path)])
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert code == 2, out
    assert str(path) in out and repr(field) in out, out
    assert "Traceback" not in out and "TypeError" not in out and "AttributeError" not in out, out


def test_a_well_formed_saved_attribution_is_read_back(attributed, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(attributed))
    assert cli(["report", "x", "--from-json", str(path)]) == 1
    assert "L1.attn.core" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ bf16 without a reference

def test_bf16_consistent_without_a_reference_says_what_the_rule_cannot_see(tmp_path):
    """RMSNorm without its fp32 upcast planted in bf16: the A-B rule alone calls the pair consistent (its error
    is within clean op-order noise). The headline, the JSON and the page say that is all it can say; with the
    checkpoint the same pair names the fault, and the caveat is gone."""
    from tic_trace.report.html import render_html
    from tic_trace.report.terminal import headline
    from tic_trace.testing.precision_faults import PRECISION_FAULTS
    a, b, ck = _pair(tmp_path, torch.bfloat16, True, lambda m: PRECISION_FAULTS["rmsnorm_no_upcast"].plant(m, 1))
    doc = find_divergence(a, b).to_json()
    said = "within bf16 noise by the A−B rule; precision faults need `--reference CKPT`"
    assert doc["verdict"] == "consistent", headline(doc)
    assert headline(doc).startswith("CONSISTENT") and said in headline(doc), headline(doc)
    note = next(n for n in doc["notes"] if n["kind"] == "precision_unchecked")
    assert note["summary"] == said and note["detail"]["dtypes"] == ["bfloat16"]
    assert said.replace("`", "") in render_html(doc).replace("<strong>", "").replace("`", "")
    with_ref = find_divergence(a, b, reference=ck).to_json()
    assert with_ref["verdict"] == "divergent" and said not in headline(with_ref)
    assert not [n for n in with_ref["notes"] if n["kind"] == "precision_unchecked"]
    _colours_and_words_agree_with_the_verdict(with_ref)


def _colours_and_words_agree_with_the_verdict(doc: dict) -> None:
    """The page of a divergent report whose first point is within tolerance over all rows (the replay's
    finding): its ratio to the tolerance is not printed in red as if it were over it, and no token says "no
    divergence" beside the DIVERGENT banner."""
    import re
    from tic_trace.report.html import render_html
    fd = doc["first_divergence"]
    assert doc["verdict"] == "divergent" and fd["cause"] == "intrinsic" and fd["error"] < fd["tol"], fd
    page = render_html(doc)
    assert not re.search(r'class="over-x">[0-9.]+× the tolerance', page)
    assert "× the tolerance: within it over all rows; divergent by the replay (intrinsic)" in page
    assert "no divergence in this token" not in page
    assert f"no A−B jump on this token alone; the divergence at {fd['key']} is the replay" in page


# ------------------------------------------------------------------------------------------ ULP at exact zeros

def test_ulp_is_not_applicable_at_exact_zeros(attributed):
    """ReLU-like outputs: where A is exactly 0 and B is not, there is no ULP "at |a|" (dividing by the ULP
    of zero read 1e36-1e38). Those elements are counted, left out of max/mean ULP, and shown as n/a."""
    import numpy as np
    from tic_trace.compare.metrics import compare_values
    from tic_trace.report.html import render_html
    from tic_trace.report.terminal import render_terminal
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    a = np.maximum(x, 0)
    b = a + np.float32(1e-3) * rng.standard_normal(x.shape).astype(np.float32)     # B's activation leaks
    m = compare_values(a, b, "float32")
    assert m.ulp_na == int(((a == 0) & (b != 0)).sum()) > 0
    assert m.max_ulp < 1e20, m.max_ulp               # the nonzero elements' ULPs, no division by zero's ULP
    only_zeros = compare_values(np.zeros((2, 4), np.float32), np.full((2, 4), 1e-7, np.float32), "float32")
    assert (only_zeros.max_ulp, only_zeros.mean_ulp, only_zeros.ulp_na) == (0.0, 0.0, 8)
    doc = copy.deepcopy(attributed)
    doc["points"][0]["metrics"] = only_zeros.to_json()
    doc["first_divergence"]["metrics"] = only_zeros.to_json()
    import io
    from rich.console import Console
    buf = io.StringIO()
    render_terminal(doc, Console(file=buf, width=250), all_points=True)
    text = buf.getvalue()
    assert "max_ulp n/a (8 element(s) at an exact zero of A: ULP n/a)" in text, text
    row = next(ln for ln in text.splitlines() if ln.strip().startswith(doc["points"][0]["key"] + " ") and "│" in ln)
    assert " n/a " in row, row                         # the points table's max ulp column
    page = render_html(doc)
    assert ">n/a<" in page


# ------------------------------------------------------------------------------------------ fp32: which side

@pytest.mark.parametrize("fault,side", [("router_bf16", "side B: its aten.mm computes in bfloat16, the other "
                                                        "side's in float32"),
                                        ("softmax_scale", "which side: not known without --reference CKPT")])
def test_the_fp32_headline_names_the_side_when_it_is_known(tmp_path, fault, side):
    """fp32, no reference: the A-B rule finds the point; the side is named where the report knows it (the
    first differing op runs in a coarser dtype on one side), and said to be unknown where it does not."""
    from tic_trace.report.html import render_html
    from tic_trace.report.terminal import headline
    a, b, _ck = _pair(tmp_path, torch.float32, True, lambda m: plant(m, "hf", fault, 1))
    doc = find_divergence(a, b).to_json()
    line = headline(doc)
    assert line.startswith("FIRST DIVERGENCE") and "[operator]" in line and line.endswith(side), line
    import html
    assert html.escape(side.split(": ", 1)[1]) in render_html(doc)


# ------------------------------------------------------------------------------------------ attribution's words

def _rope_position_offset(k: int):
    """Side B's layer-0 attention rotates q and k as if every position were k further (fp32): a large,
    non-linear change of q and k that attention, relative in positions, almost undoes."""
    def plant_it(model):
        attn = model.model.layers[0].self_attn
        inv = 1.0 / (10000.0 ** (torch.arange(0, attn.head_dim, 2, dtype=torch.float32) / attn.head_dim))

        def pre(mod, args, kwargs):
            cos, sin = kwargs["position_embeddings"]
            freqs = (torch.arange(cos.shape[-2], dtype=torch.float32)[None] + k)[..., None] * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            kwargs["position_embeddings"] = (emb.cos().to(cos.dtype), emb.sin().to(sin.dtype))
            return args, kwargs
        attn.register_forward_pre_hook(pre, with_kwargs=True)
    return plant_it


def test_attribution_far_outside_first_order_is_withheld(tmp_path):
    """A RoPE position offset: local errors ~1e5x a log-prob gap of ~3e-6. The finder still names the point;
    the attribution reports no share (it would be -1.9e5 and the like), and says why."""
    from tic_trace.compare.diverge import rejudge
    from tic_trace.report.attribution_lines import attribution_lines
    a, b, ck = _pair(tmp_path, torch.float32, False, _rope_position_offset(3))
    rep = find_divergence(a, b, reference=ck, attribution=True)
    att = rep.attribution
    assert rep.first["key"] in ("L0.attn.q_rope", "L0.attn.k_rope"), rep.first["key"]
    assert att["withheld"] and "far outside where first order holds" in att["withheld"], att
    assert att["first"] is None and att["top"] == []
    assert all(f.share is None for f in rep.findings)
    lines = attribution_lines(rep.to_json())
    assert "shares withheld" in lines[0] and "explains" not in lines[0], lines
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc


def test_attribution_separates_measured_from_credited(tmp_path):
    """bf16 RMSNorm without its upcast: the answer says what was measured at the point (its own term), what
    it is credited by the heuristic (the clean ops after it), and that its gap is within this model's measured
    clean-implementation noise (tests/test_clean_noise.py)."""
    from tic_trace.report.attribution_lines import attribution_lines
    from tic_trace.testing.precision_faults import PRECISION_FAULTS
    a, b, ck = _pair(tmp_path, torch.bfloat16, True, lambda m: PRECISION_FAULTS["rmsnorm_no_upcast"].plant(m, 1))
    doc = find_divergence(a, b, reference=ck, attribution=True).to_json()
    att = doc["attribution"]
    assert att["first"] == "L1.attn_norm" and not att["withheld"], att
    s = next(x for x in att["by_point"] if x["key"] == "L1.attn_norm")
    lines = attribution_lines(doc)
    assert lines[0].startswith(f"attribution of Σ|Δ logprob| = {att['gap']:.3g} over")
    assert ("L1.attn_norm explains" in lines[0] and f"measured: its own error {100 * s['share']:.0f}%" in lines[0]
            and f"credited by a heuristic: the clean ops after it {100 * s['share_downstream']:.0f}%" in lines[0])
    assert att["credit"].startswith("heuristic:") and any(ln.startswith("  credited: heuristic:") for ln in lines)
    assert att["clean_noise"]["measured"] is True and att["clean_noise"]["within"] is True
    assert any(ln.startswith("  clean-implementation noise of this model: a clean pair's") for ln in lines)
    if abs(s["share"]) < 0.5 * abs(s["share_total"]):
        assert any("own measured share is" in ln for ln in lines)


def test_a_finding_whose_own_term_is_next_to_nothing_is_credited_nothing(attributed):
    """The crediting heuristic does not hand the clean ops' noise to a finding whose own measured term is under
    2% of the gap (an attack: "explains 65% (its own error -0%, the clean ops after it 66%)")."""
    from tic_trace.replay.attribution import CREDIT_FLOOR, recredit
    att = copy.deepcopy(attributed["attribution"])
    first = att["first"]
    s = next(x for x in att["by_point"] if x["key"] == first)
    s["share"] = CREDIT_FLOOR / 4
    again = recredit(att, [first])
    mine = next(x for x in again["by_point"] if x["key"] == first)
    assert mine["share_downstream"] == 0 and again["first"] is None
    assert again["noise"] == pytest.approx(again["explained"] - mine["share"])
