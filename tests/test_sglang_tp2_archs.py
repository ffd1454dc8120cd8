"""SGLang 0.5.23's Llama, Qwen2 and Phi-3 classes at TP=2 over gloo (the layouts RL rollouts run): the per-rank
head shards of the fused qkv_proj, the attention and o_proj's partial sums merge back, and the pair with HF is
consistent at fp32 accuracy with every promised point. The classes' rows are then verified at TP 1 and 2
(sglang_names.ONE_RANK leaves them out)."""
from __future__ import annotations

import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch
import transformers as T

from tic_trace import find_divergence
from tic_trace.adapters import sglang as sga
from tic_trace.adapters import sglang_names
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.hf_models import build_hf_model
from tic_trace.view.align import CanonicalView

from arch_configs_gemma_phi3_gptoss import COMMON, GEMMA_PHI3_GPTOSS
from test_sglang_archs import DECODE, PROMPTS, RESPONSES, SG_ROWS, _hf_trace

CONFIGS = {"LlamaForCausalLM": lambda: T.LlamaConfig(**COMMON), "Qwen2ForCausalLM": lambda: T.Qwen2Config(**COMMON),
           "Phi3ForCausalLM": GEMMA_PHI3_GPTOSS["Phi3ForCausalLM"]}


def _worker(rank: int, world: int, port: int, ck: str, out: str) -> None:
    """One spawned TP rank: SGLang's class for the checkpoint `ck`, its rollout traced into `out`."""
    torch.set_num_threads(1)
    sc.disable_torch_compile()
    sc.init_sglang_distributed(tp_size=world, rank=rank, port=port)
    try:
        model = sc.build_sglang_model(T.AutoConfig.from_pretrained(ck), ck, dtype=torch.float32)
        with sga.trace_forwards(model, out, points_mode="full") as t:
            res = sc.SGLangRollout(model).generate(PROMPTS, DECODE, forced_tokens=RESPONSES)
        assert t.failed is None and res.outputs == RESPONSES, t.failed
    finally:
        sga.close_sessions()
        sc.destroy_sglang_distributed()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_shards_merge_to_the_hf_points(tmp_path, name):
    cfg = CONFIGS[name]()
    cfg._attn_implementation = "eager"
    model = build_hf_model(cfg)
    model.save_pretrained(tmp_path / "ck")
    _hf_trace(model, tmp_path / "hf")
    sc.spawn_ranks(_worker, world=2, args=(str(tmp_path / "ck"), str(tmp_path / "tp2")))
    v = CanonicalView(str(tmp_path / "tp2"))
    assert v.trace.ranks == [0, 1] and v.config["tensor_model_parallel_size"] == 2
    assert (v.config["architecture"], v.config["architecture_verified"]) == (name, True)
    assert name not in sglang_names.ONE_RANK
    assert {p for p, _ in v.points()} == set(v.adapter.promised_points(v.config)) | {"logprobs"}
    rep = find_divergence(str(tmp_path / "hf"), v)
    assert rep.verdict == "consistent", [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]
    assert rep.not_comparable == [] and rep.rows["matched"] == SG_ROWS
    assert max(p.error for p in rep.points) < 1e-5
    # every parameter compared with HF's across both ranks' shards (stacked qkv_proj / gate_up_proj, row- and
    # column-parallel, vocabulary shards; Phi-3's fused checkpoint tensors), and all agree (issue 34)
    assert [(d["section"], d["note"]) for d in rep.contract if d["section"] in ("weights", "hashes")] == []
