"""The tracer on real HF models and small modules: capture, non-perturbation, failure isolation, filters."""
import logging

import numpy as np
import pytest
import torch
from torch import nn

import tic_trace
from tic_trace import Filters, open_trace
from tic_trace.graph.canonical import BY_NAME
from tic_trace.record.stats import numpy_hash, numpy_stats
from tic_trace.testing.hf_models import build_hf_model, sample_tokens

from conftest import trace_hf


def _records(path):
    tr = open_trace(path)
    return [r for p in tr.passes() for r in p.records]


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
@pytest.mark.parametrize("mode", ["stats", "full", "rows"])
def test_traced_forward_is_bitwise_equal(tmp_path, hf_moe_config, hf_dense_config, moe, mode):
    cfg = hf_moe_config if moe else hf_dense_config
    model = build_hf_model(cfg)
    ids = sample_tokens(2, 9)
    with torch.no_grad():
        ref = model(ids).logits
    kw = {"sample_rows": [0, 3, 17]} if mode == "rows" else {}
    out, t = trace_hf(model, tmp_path / "t", ids, mode=mode, points_mode=mode, **kw)
    assert torch.equal(ref, out)
    assert len(_records(tmp_path / "t")) > 100
    # hooks and taps are gone afterwards
    assert "forward" not in vars(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_stats_equal_numpy_recomputation_of_full_records(tmp_path, hf_moe_config):
    model = build_hf_model(hf_moe_config)
    trace_hf(model, tmp_path / "t", sample_tokens(2, 7), mode="full", points_mode="full")
    recs = _records(tmp_path / "t")
    checked = 0
    for r in recs:
        assert r.has_data, r.name
        raw = r.raw()
        want = numpy_stats(raw, r.dtype)
        assert r.stats["count"] == want["count"] and r.stats["nan"] == want["nan"] and r.stats["inf"] == want["inf"]
        for k in ("sum", "sumsq", "absmax", "min", "max"):
            assert np.isclose(r.stats[k], want[k], rtol=1e-9, atol=1e-12), (r.name, k, r.stats[k], want[k])
        assert r.hash == numpy_hash(raw), r.name
        checked += 1
    assert checked > 200


class _Produce(nn.Module):
    """Outputs one tensor per dtype: round trips must be bit exact."""

    def forward(self, x):
        outs = {
            "f32": x * 1.5,
            "f64": x.double() / 3,
            "f16": (x * 7).half(),
            "bf16": (x / 3).bfloat16(),
            "i64": (x * 100).long(),
            "i32": (x * 100).int(),
            "i8": (x * 10).clamp(-100, 100).to(torch.int8),
            "u8": (x.abs() * 10).clamp(0, 255).to(torch.uint8),
            "bool": x > 0,
            "e4m3": (x * 3).to(torch.float8_e4m3fn),
            "e5m2": (x * 3).to(torch.float8_e5m2),
            "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 65504.0]),
        }
        return outs


class _Wrap(nn.Module):
    def __init__(self):
        super().__init__()
        self.produce = _Produce()

    def forward(self, x):
        return self.produce(x)


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(5, 7)
    m = _Wrap()
    with tic_trace.trace(m, tmp_path / "t", points_mode="full") as t:
        outs = m(x)
    assert t.failed is None
    p = next(open_trace(tmp_path / "t").passes())
    for key, ten in outs.items():
        rec = p.record(f"produce:out['{key}']")
        raw = rec.raw()
        bits = ten.view({1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[ten.element_size()]) \
            if ten.dtype != torch.bool else ten
        assert np.array_equal(raw.view(bits.numpy().dtype) if ten.dtype != torch.bool else raw, bits.numpy()), key
        assert rec.dtype == str(ten.dtype).removeprefix("torch.")
        if ten.dtype.is_floating_point:
            got = rec.values()
            want = ten.double().numpy()
            assert np.array_equal(np.isnan(got), np.isnan(want))
            assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)]), key


class _InPlaceAfter(nn.Module):
    """Like Megatron's bias-dropout-add under no_grad: the child's output is modified in place afterwards."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        y.add_(100.0)   # in place, after `proj` returned
        return y


def test_outputs_are_captured_as_produced(tmp_path):
    torch.manual_seed(0)
    m = _InPlaceAfter()
    x = torch.randn(3, 4)
    with tic_trace.trace(m, tmp_path / "t", mode="full", points_mode="full"), torch.no_grad():
        y = m(x)
    p = next(open_trace(tmp_path / "t").passes())
    produced = p.record("proj:out").values()
    with torch.no_grad():
        np.testing.assert_array_equal(produced, m.proj(x).numpy())
    assert np.abs(produced).max() < 50 and y.min() > 50   # the value before the in-place add


@torch.library.custom_op("tictest::scale_into", mutates_args=("out",))
def _scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 3.0)


class _Mutator(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        torch.ops.tictest.scale_into(x, out)
        return out + 1


def test_ops_that_return_nothing_record_the_mutated_argument(tmp_path):
    m = _Mutator()
    x = torch.arange(6.0).reshape(2, 3)
    with tic_trace.trace(m, tmp_path / "t", mode="full"):
        m(x)
    recs = _records(tmp_path / "t")
    mutated = [r for r in recs if r.op == "tictest.scale_into"]
    assert [r.name for r in mutated] == ["<root>/op0:tictest.scale_into:arg.out"]
    np.testing.assert_array_equal(mutated[0].values(), (x * 3).numpy())


def test_unwritable_directory_never_breaks_the_forward(tmp_path, hf_moe_config, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = build_hf_model(hf_moe_config)
    ids = sample_tokens(1, 5)
    with torch.no_grad():
        ref = model(ids).logits
    with caplog.at_level(logging.WARNING, logger="tic_trace"):
        with tic_trace.trace(model, blocker / "trace", adapter="hf") as t, torch.no_grad():
            out = model(ids).logits
    assert torch.equal(out, ref)
    assert t.failed is not None
    assert sum("tracing disabled" in r.message for r in caplog.records) == 1
    assert "forward" not in vars(model)


def test_failure_mid_forward_disables_tracing_once(tmp_path, hf_moe_config, caplog, monkeypatch):
    model = build_hf_model(hf_moe_config)
    ids = sample_tokens(1, 5)
    with torch.no_grad():
        ref = model(ids).logits
    calls = {"n": 0}
    from tic_trace.record.stat_slots import StatSlots
    real = StatSlots.add

    def flaky(self, x):
        calls["n"] += 1
        if calls["n"] == 40:
            raise RuntimeError("planted tracer failure")
        return real(self, x)
    monkeypatch.setattr(StatSlots, "add", flaky)
    with caplog.at_level(logging.WARNING, logger="tic_trace"):
        with tic_trace.trace(model, tmp_path / "t", adapter="hf") as t, torch.no_grad():
            out = model(ids).logits
    assert torch.equal(out, ref)
    assert isinstance(t.failed, RuntimeError)
    assert sum("tracing disabled" in r.message for r in caplog.records) == 1
    assert calls["n"] == 40   # nothing more was recorded after the failure


def test_root_forward_called_directly_is_traced(tmp_path, hf_moe_config):
    """SGLang calls `model.forward(...)`, bypassing module hooks on the root."""
    model = build_hf_model(hf_moe_config)
    ids = sample_tokens(1, 4)
    with tic_trace.trace(model, tmp_path / "t", adapter="hf", points_mode="full"), torch.no_grad():
        model.forward(input_ids=ids)
    p = next(open_trace(tmp_path / "t").passes())
    assert p.get("<root>:out['logits']") is not None
    assert p.rows["positions"] == [0, 1, 2, 3]    # the adapter saw the root's inputs


class _KeylessOutput(dict):
    """An output mapping registered as a pytree node without key paths, as transformers 5.12 registers every
    `ModelOutput` (no `flatten_with_keys_fn`: `tree_flatten_with_path` raises on it)."""


torch.utils._pytree.register_pytree_node(_KeylessOutput, lambda d: (list(d.values()), list(d)),
                                         lambda values, keys: _KeylessOutput(zip(keys, values)))


class _KeylessHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 6)

    def forward(self, x):
        return _KeylessOutput(logits=self.lm_head(x) * 2, hidden=x)


def test_an_output_mapping_without_pytree_key_paths_is_recorded_by_its_keys(tmp_path):
    """transformers 5.12.1 (slime's stack) would lose the model's output, `<root>:out['logits']`."""
    m, x = _KeylessHead(), torch.randn(3, 4)
    with pytest.raises(ValueError):
        torch.utils._pytree.tree_flatten_with_path(_KeylessOutput(a=x))
    with tic_trace.trace(m, tmp_path / "t", points_mode="full"), torch.no_grad():
        want = m(x)["logits"]
    p = next(open_trace(tmp_path / "t").passes())
    assert torch.equal(torch.from_numpy(np.array(p.get("<root>:out['logits']").values())), want)
    assert p.get("<root>:out['hidden']") is not None


def test_step_makes_passes_and_filters_select(tmp_path, hf_moe_config):
    model = build_hf_model(hf_moe_config)
    f = Filters(modules=["model.layers.1*"], ops=["aten.mm", "aten.bmm"], passes="1-2")
    t = tic_trace.trace(model, tmp_path / "t", adapter="hf", filters=f)
    t.start()
    with torch.no_grad():
        for i in range(4):
            model(sample_tokens(1, 3 + i, seed=i))
            t.step(tag=f"step{i + 1}")
    t.stop()
    tr = open_trace(tmp_path / "t")
    passes = list(tr.passes())
    assert [p.meta["pass_number"] for p in passes] == [1, 2]
    for p in passes:
        assert p.records
        assert all(r.module.startswith("model.layers.1") for r in p.records)
        assert all(r.op in ("aten.mm", "aten.bmm") for r in p.records if r.kind == "op")
    assert passes[0].rows["positions"] == [0, 1, 2, 3]


def test_layer_filter_and_auto_step(tmp_path, hf_moe_config):
    model = build_hf_model(hf_moe_config)
    with tic_trace.trace(model, tmp_path / "t", adapter="hf", filters=Filters(layers="0"), auto_step=True), \
            torch.no_grad():
        model(sample_tokens(1, 3))
        model(sample_tokens(1, 4))
    tr = open_trace(tmp_path / "t")
    passes = list(tr.passes())
    assert len(passes) == 2
    layers = {r.module.split(".")[2] for p in passes for r in p.records if r.module.startswith("model.layers.")}
    assert layers == {"0"}


def test_rank_filter_records_nothing_on_other_ranks(tmp_path, hf_moe_config):
    model = build_hf_model(hf_moe_config)
    with tic_trace.trace(model, tmp_path / "t", adapter="hf", rank=3, filters=Filters(ranks="0-1")), torch.no_grad():
        model(sample_tokens(1, 3))
    assert not (tmp_path / "t").exists()


def test_rows_mode_keeps_chosen_rows(tmp_path, hf_moe_config):
    model = build_hf_model(hf_moe_config)
    trace_hf(model, tmp_path / "r", sample_tokens(2, 6), mode="stats", points_mode="rows", sample_rows=[1, 7, 11])
    trace_hf(model, tmp_path / "f", sample_tokens(2, 6), mode="stats", points_mode="full")
    pr, pf = next(open_trace(tmp_path / "r").passes()), next(open_trace(tmp_path / "f").passes())
    r, f = pr.record("model.layers.0.post_attention_layernorm:out"), pf.record("model.layers.0.post_attention_layernorm:out")
    assert r.row_index == [1, 7, 11]
    np.testing.assert_array_equal(r.values(), f.values().reshape(12, -1)[[1, 7, 11]])
    # a tensor that is not per token falls back to statistics
    assert pr.record("model.layers.0.self_attn/fn:apply_rotary_pos_emb:out[0]").mode == "stats"


class _Blind(nn.Module):
    def __init__(self):
        super().__init__()
        self.ident = nn.Identity()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(self.ident(x))


def test_module_regions_without_visible_ops_are_reported(tmp_path):
    m = _Blind()
    with tic_trace.trace(m, tmp_path / "t"), torch.no_grad():
        m(torch.randn(2, 3))
    p = next(open_trace(tmp_path / "t").passes())
    assert p.meta["blind_regions"] == ["ident"]
    assert p.record("ident:out").ops_in_region == 0
    assert p.record("lin:out").ops_in_region >= 1


class _Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False).sum()


def test_activation_recompute_is_skipped_by_default(tmp_path):
    torch.manual_seed(0)
    m = _Ckpt()
    x = torch.randn(2, 4, requires_grad=True)
    with tic_trace.trace(m, tmp_path / "skip"):
        m(x).backward()
    with tic_trace.trace(m, tmp_path / "keep", skip_recompute=False):
        m(x).backward()
    skip = [r for r in _records(tmp_path / "skip") if r.module.startswith("inner")]
    keep = [r for r in _records(tmp_path / "keep") if r.module.startswith("inner")]
    assert skip and all(r.phase == "forward" for r in skip)
    assert any(r.phase == "recompute" for r in keep)


def test_hf_adapter_finds_every_promised_point(tmp_path, hf_moe_config, hf_dense_config):
    from tic_trace.view.align import CanonicalView
    for name, cfg in (("moe", hf_moe_config), ("dense", hf_dense_config)):
        trace_hf(build_hf_model(cfg), tmp_path / name, sample_tokens(2, 5))
        v = CanonicalView(tmp_path / name)
        have = {p for p, _ in v.points()}
        promised = set(v.adapter.promised_points(v.config))
        assert promised <= have, promised - have
        # Qwen3(-MoE) has every canonical point but the shared expert and those of other architectures only:
        # Gemma's sandwich norms, MLA's latent projections, Qwen3-Next's attention gate and linear attention
        others = {"attn.post_norm", "mlp.post_norm", "attn.q_a", "attn.q_a_norm", "attn.kv_a", "attn.kv_a_norm",
                  "attn.kv_b", "attn.gate", "attn.linear_qkvz", "attn.linear_ba", "attn.linear_conv",
                  "attn.linear_core", "attn.linear_norm"}
        expected = {p.name for p in BY_NAME.values()} - {"moe.shared_out"} - others
        assert others <= set(BY_NAME)
        if name == "dense":
            expected -= {p for p in expected if p.startswith("moe.")}
        assert have == expected
        layers = {lay for _, lay in v.points() if lay is not None}
        assert layers == {0, 1}
        q = v.load("attn.q", 1)
        assert q.values.shape == (10, 4, 16)
        assert q.rows[:2] == [("s0", 0), ("s0", 1)]


class _Side(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _TwoThreads(torch.nn.Module):
    """`side` runs on a worker thread while the main thread's `main` is being recorded."""

    def __init__(self, entered, released):
        super().__init__()
        self.main, self.side = torch.nn.Linear(4, 4), _Side()
        self.entered, self.released = entered, released

    def forward(self, x):
        import threading
        got = {}

        def work():
            self.entered.wait(120)        # the main thread is inside the tracer now
            got["side"] = self.side(x)
            self.released.set()
        th = threading.Thread(target=work)
        th.start()
        y = self.main(x)
        th.join()
        return y + got["side"]


def test_module_calls_on_another_thread_while_the_tracer_is_busy_are_said(tmp_path):
    """One tracer records one thread at a time: a module the worker thread runs while the main thread is
    inside the tracer is not recorded, and the pass says so (before: lost without a word)."""
    import threading

    from tic_trace import Filters
    from tic_trace.record.guard import CONCURRENT_THREADS_NOTE
    entered, released = threading.Event(), threading.Event()

    class HoldInsideTheTracer(Filters):
        def want_module(self, path):
            if path == "main" and not released.is_set():   # asked by the tracer while it records `main`
                entered.set()
                released.wait(120)   # long: a loaded CI machine (the wait ends when released)
            return super().want_module(path)

    x = torch.randn(3, 4)
    model = _TwoThreads(entered, released)
    with torch.no_grad():
        ref = model.main(x) + model.side(x)
        with tic_trace.trace(model, tmp_path / "t", filters=HoldInsideTheTracer()) as t:
            out = model(x)
    assert t.failed is None and torch.equal(out, ref)
    p = next(tic_trace.open_trace(tmp_path / "t").passes())
    assert CONCURRENT_THREADS_NOTE in p.meta["notes"]
    names = {r.name for r in p.records}
    assert any(n.startswith("main") for n in names) and not any(n.startswith("side") for n in names)


def test_a_single_threaded_forward_has_no_concurrency_note(tmp_path):
    from tic_trace.record.guard import CONCURRENT_THREADS_NOTE
    model = _Side()
    with torch.no_grad(), tic_trace.trace(model, tmp_path / "t") as t:
        model(torch.randn(3, 4))
    assert t.failed is None
    assert CONCURRENT_THREADS_NOTE not in next(tic_trace.open_trace(tmp_path / "t").passes()).meta["notes"]
