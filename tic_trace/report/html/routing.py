"""Section 5: routing, the top-k expert choice per MoE layer: flipped tokens, near ties, unexplained flips and
their margins."""
from __future__ import annotations

from .cells import _d, _e, _fmt_f, _gen, _int, _is_ids, _l, _layer_of, _num, _pct, _point_of
from .context import Ctx


def routing_section(c: Ctx) -> str:
    head = ('<section id="routing"><h2>Routing</h2><p class="sub">Top-k expert choice per MoE layer. A flip is '
            'a token whose selected expert set differs; a flip is <i>explained</i> (a near tie) when its margin '
            'is within twice the error its router-logit error makes of the scores the router chooses on: the '
            'logits of a softmax router, sigmoid + selection bias inside the kept groups of a DeepSeek-style '
            'one (the space is named per layer).</p>')
    rt = _d(c.r.get("routing"))
    layers = _d(rt.get("layers"))
    if not layers:
        return head + '<p class="empty">No routing in this report (a dense model, or the router was not traced).' \
                      '</p></section>'
    share = _num(rt.get("share_tokens_with_flip"))
    o = [head, f'<p><b class="num">{_gen(rt.get("tokens_with_flip"))}</b> tokens '
               f'(<b class="num">{_pct(share)}</b> of the matched tokens) have a routing flip in at least one '
               'layer.</p>']
    margins = {}
    for p in c.points:
        if _is_ids(_point_of(p)) and isinstance(p.get("routing"), dict):
            space = p["routing"].get("margin_space")
            margins[str(_layer_of(p))] = ([f"[{_e(space)}]"] if isinstance(space, str) else []) + [
                f"{_fmt_f(x.get('margin'))} (err {_fmt_f(x.get('logit_error'))})"
                for x in _l(p["routing"].get("flips")) if isinstance(x, dict)]

    def lk(k):
        v = _int(k)
        return (0, v) if v is not None else (1, str(k))

    o.append('<table><thead><tr><th>Layer</th><th>Flipped tokens</th><th class="r">Share</th>'
             '<th class="r">Near tie</th><th class="r">Unexplained</th><th class="r">Near tie to output</th>'
             '<th class="r">Share of |Δ log-prob|</th><th class="r">Set agreement</th>'
             '<th>Flip margins [space] (error)</th></tr></thead><tbody>')
    for k in sorted(layers, key=lk):
        v = _d(layers[k])
        fl, rows = _num(v.get("flipped")), _num(v.get("rows"))
        sh = (fl / rows) if fl is not None and rows else None
        w = 0 if sh is None else min(max(sh, 0), 1) * 100
        un = _int(v.get("unexplained"))
        mg = ", ".join(margins.get(str(k), [])[:12])
        o.append(f'<tr><td class="num">{_e(k)}</td><td><span class="bar2bg"><span class="bar2" '
                 f'style="width:{w:.0f}%"></span></span><span class="num">{_gen(fl)} / {_gen(rows)}</span></td>'
                 f'<td class="r num">{_pct(sh)}</td>'
                 f'<td class="r num">{_gen(v.get("near_tie"))}</td>'
                 f'<td class="r num"{" style=color:#cf222e;font-weight:700" if un else ""}>{_gen(un)}</td>'
                 f'<td class="r num">{_gen(v.get("near_tie_to_output"))}</td>'
                 f'<td class="r num">{_pct(v.get("dlogprob_share"))}</td>'
                 f'<td class="r num">{_pct(v.get("set_agreement"))}</td><td class="num note">{mg or "—"}</td></tr>')
    o.append("</tbody></table></section>")
    return "".join(o)
