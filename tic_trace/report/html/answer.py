"""Sections 0 and 1: the contract (what both sides claim to compute, diffed before any tensor) and the answer
(the verdict, the named causes, the first divergence and its facts)."""
from __future__ import annotations

import math
from collections import Counter

from ..coverage import coverage_line
from ..lines import blocking_line, contract_line, identity_sentence, precision_caveat, side_hint
from ..schema import architecture_refusal, unverified_sides
from .cells import _anchor, _d, _e, _gen, _growth, _is_ids, _l, _layer_of, _meaning, _num, _pill, _point_of, _sci
from .context import Ctx, _only_ops
from .style import STATUS_LABEL, STATUSES


def contract_section(c: Ctx) -> str:
    """The contract (versions, config, numerics settings, point dtypes, weights), diffed before any tensor."""
    diffs = [d for d in _l(c.r.get("contract")) if isinstance(d, dict)]
    if "contract" not in c.r or (not diffs and architecture_refusal(c.r)):
        return ""       # a pair refused for its architecture: its points' dtypes and weights were not read
    if not diffs:
        return ('<section id="contract"><p class="note">Contract: versions, model config, numerics settings, '
                "point dtypes and weight hashes agree.</p></section>")
    items = "".join(f'<li class="mono">{_e(contract_line(d))}</li>' for d in diffs[:200])
    return (f'<section id="contract"><h2>Contract: {len(diffs)} difference(s)</h2><p class="note">What the two '
            "sides claim to compute, read from manifests and record headers before any tensor.</p>"
            f'<ul>{items}</ul></section>')


def answer_section(c: Ctx) -> str:
    r, first = c.r, c.first
    verdict = r.get("verdict")
    vcls = verdict if verdict in ("divergent", "consistent", "not_comparable") else "unknown"
    counts = Counter(p.get("status") for p in c.points)
    n = len(c.points)
    out = ['<section id="answer">']
    if first:
        fk = first.get("key", "?")
        msg = (f"The first point where B stops computing what A computes is <code>{_e(fk)}</code>"
               f" — {_e(_meaning(first.get('point')) or first.get('point', ''))}.")
    elif verdict == "consistent":
        msg = (f"No point diverges: {counts.get('ok', 0)} of {n} points are within tolerance"
               + (f"; {counts['over']} over it only carry error they inherited" if counts.get("over") else "")
               + (f"; {counts['not_comparable']} could not be compared" if counts.get("not_comparable") else "")
               + ".")
        if precision_caveat(r):
            msg += f" <strong>{_e(precision_caveat(r))}</strong>."
    elif verdict == "divergent":
        msg = "The report says the sides diverge, but names no first point."
    elif architecture_refusal(r):
        msg = "Not compared: " + " ".join(_e(n.get("summary")) for n in architecture_refusal(r))
    else:
        msg = "Nothing could be compared: see the list of points that are not comparable below."
    # the rows and the models' structure (the terminal headline's sentences): on the banner whatever the verdict;
    # when they make the pair not comparable, they are the answer
    block, ident = blocking_line(r), identity_sentence(r)
    if block and not first:
        msg = _e(block)
    elif ident:
        msg += f' <span class="note">{_e(ident)}</span>'
    if unverified_sides(r):
        msg += (" <strong>Unverified mapping:</strong> "
                + " ".join(_e(n.get("summary")) for n in unverified_sides(r)))
    covered = coverage_line(r)        # what the verdict covered, on the banner (report/coverage.py)
    if covered:
        msg += f' <span class="coverage">{_e(covered)}</span>'
    out.append(f'<div class="banner v-{vcls}"><span class="verdict">{_e(STATUS_LABEL.get(verdict, verdict) or "?")}'
               f'</span><span class="msg">{msg}</span></div>')
    out.append('<div class="body">')
    out.append(_causes_html(c))
    if first:
        out.append(_first_facts(c, first))
    else:
        out.append(_summary_facts(c, counts))
    out.append("</div></section>")
    return "\n".join(out)


def _causes_html(c: Ctx) -> str:
    """The report's named causes (findings) and notes, first thing under the verdict."""
    items = []
    for f in _l(c.r.get("findings")):
        if not isinstance(f, dict):
            continue
        counted = "" if f.get("divergent") else ' <span class="note">(shown, not counted)</span>'
        remedy = f'<div class="note">what removes it: {_e(f.get("remedy"))}</div>' if f.get("remedy") else ""
        items.append(f'<li><span class="cause">{_e(f.get("cause"))}</span>{counted} at '
                     f'<a class="k mono" href="#{_e(_anchor(f.get("key")))}">{_e(f.get("key"))}</a>: '
                     f'{_e(f.get("summary"))}{remedy}</li>')
    for n in _l(c.r.get("notes")):
        if isinstance(n, dict):
            items.append(f'<li><span class="cause">note: {_e(str(n.get("kind")).replace("_", " "))}</span> '
                         f'{_e(n.get("summary"))}</li>')
    if not items:
        return ""
    return '<ul class="causes" style="margin:0 0 12px;padding-left:18px">' + "".join(items) + "</ul>"


def _summary_facts(c: Ctx, counts: Counter) -> str:
    rows = []
    rows.append(("Points", " ".join(f'{_pill(s)} <span class="num">{counts.get(s, 0)}</span>&nbsp;'
                                    for s in STATUSES)))
    worst = None
    for p in c.points:
        v = _num(p.get("error"))
        if v is not None and not _is_ids(_point_of(p)) and (worst is None or v > _num(worst.get("error"))):
            worst = p
    if worst is not None and _num(worst.get("error")) == 0:
        rows.append(("Largest error", "0 — every compared point is bit-identical"))
    elif worst is not None:
        rows.append(("Largest error", f'<a class="k mono" href="#{_e(_anchor(worst.get("key")))}">'
                                      f'{_e(worst.get("key"))}</a> <span class="num">{_sci(worst.get("error"))}</span>'
                                      f' (tolerance <span class="num">{_sci(worst.get("tol"))}</span>)'))
    rows.append(("Rows", _rows_text(c.r)))
    return _facts(rows)


def _rows_text(r: dict) -> str:
    rows = _d(r.get("rows"))
    extra = "".join(f', {label} <span class="num">{_gen(rows.get(k))}</span>' for k, label in
                    (("unmatched_a", "A-only"), ("unmatched_b", "B-only"), ("excluded", "left out")) if rows.get(k))
    return (f'<span class="num">{_gen(rows.get("matched"))}</span> tokens matched '
            f'(A has <span class="num">{_gen(rows.get("a"))}</span>, '
            f'B has <span class="num">{_gen(rows.get("b"))}</span>{extra})')


def _facts(rows) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"


def _why_within(f: dict) -> str:
    """Why a first divergence whose all-rows error is within tolerance is divergent all the same."""
    cause = f.get("cause")
    if f.get("decided_by_row"):
        return f"divergent on token {f.get('decided_by_row')}'s own error (worst rows below)"
    if cause in ("intrinsic", "precision"):
        return f"divergent by the replay ({cause}): a side against the exact op, not the A−B error"
    if cause == "routing":
        return "divergent by routing: tokens chose other experts"
    return f"divergent by its {cause or 'finding'} (cause below)"


def _first_facts(c: Ctx, f: dict) -> str:
    rows = []
    key = f.get("key", "?")
    point = f.get("point")
    rows.append(("First divergence", f'<a class="k" href="#{_e(_anchor(key))}"><span class="big">{_e(key)}</span></a>'
                                     f'<span class="meaning">{_e(point)} · {_e(_meaning(point))}</span>'))
    lay = _layer_of(f)
    rows.append(("Layer", f'<span class="num">{lay}</span>' if lay is not None else "— (outside the layers)"))
    err, tol = _num(f.get("error")), _num(f.get("tol"))
    et = f'<span class="num">{_sci(err)}</span> vs tolerance <span class="num">{_sci(tol)}</span>'
    if err is not None and tol is not None:
        if tol > 0 and not math.isinf(err):
            ratio = err / tol
            rt = f"{ratio:,.0f}" if 10 <= ratio < 1e9 else f"{ratio:.3g}"
            if ratio > 1:
                et += f' &nbsp;<span class="over-x">{rt}× the tolerance</span>'
            else:       # within it over all rows: in the verdict's words why it is divergent anyway, not in red
                et += f' &nbsp;<span class="note">{rt}× the tolerance: within it over all rows; {_e(_why_within(f))}</span>'
        elif tol == 0 and err > 0:
            et += ' &nbsp;<span class="over-x">(any difference counts)</span>'
    if f.get("dtype"):
        et += f' &nbsp;<span class="note">judged as {_e(f.get("dtype"))}</span>'
    if _is_ids(point) and isinstance(f.get("routing"), dict):
        rt = f["routing"]
        et += (f' &nbsp;<span class="note">{_gen(rt.get("flipped_rows"))} of {_gen(rt.get("rows"))} tokens '
               f'route differently, {_gen(rt.get("unexplained_flips"))} beyond router-logit noise</span>')
    rows.append(("Error vs tolerance", et))
    g, ie = _num(f.get("growth")), _num(f.get("input_error"))
    inputs = [str(k) for k in _l(f.get("inputs"))]
    gf = f" (a point diverges above ×{c.growth_factor:g})" if c.growth_factor else ""
    if ie == 0 and (err or 0) > 0:
        gt = (f'<span class="num over-x">×∞</span> — its inputs are bit-identical '
              f'(input error 0): the error is born here')
    elif g is not None:
        jump = "over-x" if c.growth_factor and g > c.growth_factor else ""     # red only for a jump
        gt = (f'<span class="num {jump}">{_growth(g)}</span> over its inputs\' error '
              f'<span class="num">{_sci(ie)}</span><span class="note">{_e(gf)}</span>')
    else:
        gt = f'<span class="num">—</span> (input error <span class="num">{_sci(ie)}</span>)'
    rows.append(("Growth over inputs", gt))
    worst = [r for r in _l(f.get("worst_rows")) if isinstance(r, dict)][:8]
    if worst:      # each judged on its own: its error, its growth over the same row's input error, its status
        by = f' <span class="note">(the point is judged on token {_e(f.get("decided_by_row"))})</span>' \
            if f.get("decided_by_row") else ""
        rows.append(("Worst rows", '<div class="chips">' + "".join(
            f'<span class="chip"><span class="mono">{_e(r.get("row"))}</span> <span class="num">'
            f'{_sci(_num(r.get("error")))}</span> {_growth(_num(r.get("growth")))} {_pill(r.get("status"))}</span>'
            for r in worst) + "</div>" + by))
    cause = f.get("cause") or "—"
    rows.append(("Cause", f'<span class="cause">{_e(cause)}</span> {_e(f.get("summary") or "")}'))
    if cause == "operator":
        hint = side_hint(f) or ("neither is blamed by the replay" if _d(c.r.get("settings")).get("reference")
                                else "not known without --reference CKPT (it measures each side against the exact op)")
        rows.append(("Which side", _e(hint)))
    if f.get("reason") and f.get("cause") and f.get("reason") != f.get("cause"):
        rows.append(("Note", _e(f.get("reason"))))
    chips = []
    for k in inputs:
        p = c.by_key.get(k, {})
        chips.append(f'<span class="chip"><a class="k mono" href="#{_e(_anchor(k))}">{_e(k)}</a> '
                     f'<span class="num">{_sci(p.get("error"))}</span> {_pill(p.get("status")) if p else ""}</span>')
    rows.append(("Inputs", f'<div class="chips">{"".join(chips)}</div>' if chips else
                 '<span class="note">none (a first point of the graph)</span>'))
    src = _d(f.get("sources"))
    st = []
    for side in ("a", "b"):
        names = ", ".join(_e(s) for s in _l(src.get(side)))
        if names:
            st.append(f'<div><b>{side.upper()}</b> <span class="mono">{names}</span></div>')
    if st:
        rows.append(("Records", "".join(st)))
    if c.first_op:
        i, oa, j, ob = c.first_op
        rows.append(("First differing op",
                     f'<a class="k" href="#ops"><span class="mono"><b>{_e(oa.get("op"))}</b></span></a> '
                     f'(A op #{i}, B op #{j} of the region: the same op on both sides, a different output) '
                     f'<span class="note mono">{_e(oa.get("name"))}</span>'))
    only = _only_ops(_d(f.get("ops")))
    txt = []
    for side in ("a", "b"):
        if only[side]:
            ops_txt = ", ".join(f'<b class="mono">{_e(op)}</b>' + (f" ×{n}" if n > 1 else "")
                                for op, n in only[side].most_common(6))
            txt.append(f"<div>only {side.upper()} runs {ops_txt}</div>")
    if txt:
        rows.append(("Ops one side only", "".join(txt)))
    wt = [w for w in _l(c.r.get("worst_tokens")) if isinstance(w, dict)]
    if wt:
        starts = Counter(str(w.get("divergence_starts")) for w in wt if w.get("divergence_starts"))
        if starts:
            txt = ", ".join(f'<a class="k mono" href="#{_e(_anchor(k))}">{_e(k)}</a> ({n})'
                            for k, n in starts.most_common(4))
            rows.append(("Worst tokens start at", f"{txt} <span class=\"note\">of the {len(wt)} tokens with the "
                                                  "largest |Δ log-prob|</span>"))
    rows.append(("Rows", _rows_text(c.r)))
    return _facts(rows)
