"""What the SGLang adapter relies on, checked statically in SGLang 0.5.15.post1 (slime's pin; its model code
cannot be imported beside our pins) and, as the control that proves the checker finds things, in the
installed 0.5.23: module paths of every architecture in the adapter's tables, the ForwardBatch fields and
ForwardMode methods the row builder reads, the server arguments the server hook judges and slime's
integration sets (with their command-line flags), the forward-hooks spec, the parallel coordinates; and
whether each MoE block all-reduces its own output (0.5.15.post1: yes; 0.5.23: no). The 0.5.15.post1 source
is read out of its release wheel (scripts/setup.sh fetches it; a missing wheel is fetched here, and a failed
download fails the test). docs/sglang.md, "Checked against SGLang 0.5.15.post1", says what this covers.
"""
from __future__ import annotations

import ast
import zipfile

import pytest

from tic_trace.adapters import sglang_rows, sglang_server
from tic_trace.adapters.sglang import NUMERICS_SERVER_ARGS
from tic_trace.adapters.sglang_names import ARCH_MODULES, ARCH_OF_CLASS
from tic_trace.adapters.sglang_server import forward_hooks_spec
from tic_trace.integrations.slime.config import SERVER_ARGS as SLIME_SERVER_ARGS
from tic_trace.testing import sglang_source as S

INSTALLED = "0.5.23"
FB = "srt/model_executor/forward_batch_info.py"
#: The phases sglang_server._graph_backend is called with (its f-string argument names are per phase).
PHASES = ("decode", "prefill")
#: Server arguments whose type or default differs between the two versions, and why the adapter's reading of
#: them is the same in both (it only tests ``backend != "disabled"`` and truthiness).
MEANING_DIFFERS_HARMLESSLY = {
    "cuda_graph_backend_decode": "0.5.15 also offers 'tc_piecewise'; the hook only tests for 'disabled'",
    "cuda_graph_backend_prefill": "0.5.15 also offers 'tc_piecewise'; the hook only tests for 'disabled'",
    "enable_fused_qk_norm_rope": "0.5.23: Optional[bool], None = auto (on only on XPU); the hook tests truthiness",
}
#: Module paths describe() reads beyond the point table (reduce_results of the row-parallel layers, QK-norm).
DESCRIBE_PATHS = {
    "qwen_dense": ("model.layers.N.mlp.down_proj",),
    "qwen_moe": ("model.layers.N.mlp.experts",),
    "glm4_moe": ("model.layers.N.mlp.experts", "model.layers.N.mlp.shared_experts.down_proj"),
    "deepseek_mla": ("model.layers.N.mlp.experts", "model.layers.N.mlp.shared_experts.down_proj"),
    "gemma2": ("model.layers.N.mlp.down_proj",),
    "gemma3": ("model.layers.N.mlp.down_proj",),
    "gpt_oss": ("model.layers.N.mlp.experts",),
    "olmoe": ("model.layers.N.mlp.experts",),
    "mixtral": (),          # describe() reads `mlp`; Mixtral's block is block_sparse_moe (its rows read it)
}


@pytest.fixture(scope="module")
def old() -> S.SourceTree:
    wheel = S.fetch_slime_sglang_wheel()          # raises (fails the test) with pip's message if it cannot
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"sglang-{S.SLIME_SGLANG}.dist-info/METADATA").decode()
    assert f"\nVersion: {S.SLIME_SGLANG}\n" in meta
    return S.SourceTree(wheel)


@pytest.fixture(scope="module")
def new() -> S.SourceTree:
    assert S.installed_sglang_version() == INSTALLED, "the control is the pinned SGLang; run scripts/setup.sh"
    return S.installed_sglang_tree()


@pytest.fixture(params=["old", "new"])
def tree(request) -> S.SourceTree:
    return request.getfixturevalue(request.param)


def _root(tree: S.SourceTree, cls: str) -> S.ClassRef:
    ref, registered = S.model_class(tree, cls)
    assert ref is not None, f"{tree}: no class {cls} in srt/models/"
    assert registered, f"{tree}: {ref.rel} does not list {cls} in EntryClass"
    return ref


def test_module_paths_of_every_architecture(tree):
    """Every module path the point table and describe() rely on is assigned along the __init__ chain."""
    for cls, arch in ARCH_OF_CLASS.items():
        root = _root(tree, cls)
        for path in ARCH_MODULES[arch] + DESCRIBE_PATHS[arch]:
            objs, why = S.follow_path(tree, root, path)
            assert why is None, f"{tree}: {cls}: {why}"
            assert objs


def test_the_path_checker_rejects_what_is_not_there(old, new):
    """Controls: a made-up attribute, and MHA's fused qkv_proj on DeepSeek's MLA attention, are not found."""
    for tree in (old, new):
        root = _root(tree, "DeepseekV3ForCausalLM")
        objs, why = S.follow_path(tree, root, "model.layers.N.self_attn.qkv_proj")
        assert not objs and "DeepseekV2AttentionMLA" in why and "qkv_proj" in why
        objs, why = S.follow_path(tree, _root(tree, "Qwen3MoeForCausalLM"), "model.layers.N.mlp.no_such_module")
        assert not objs and "never assigns self.no_such_module" in why


@pytest.mark.parametrize("cls", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                                 "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_moe_block_reduces_its_own_output_in_0515_not_in_0523(old, new, cls):
    """0.5.15.post1: the MoE block's forward path calls a TP all-reduce on its output (so ``mlp.out`` is the
    same on every rank); 0.5.23: it does not (the sum is deferred to the layer boundary). The TP merge goes
    by the records for this reason (tests/test_sglang_adapter.py::test_tp2_moe_block_that_reduces_itself)."""
    old_blocks = S.moe_blocks(old, _root(old, cls))
    new_blocks = S.moe_blocks(new, _root(new, cls))
    assert old_blocks and new_blocks
    for block in old_blocks:
        found = S.self_reductions(old, block)
        assert found, f"0.5.15.post1 {block.name}: no TP all-reduce on the forward path"
        assert all(r.guards and "tp_size > 1" in r.guards[0] for r in found), found
    for block in new_blocks:
        assert S.self_reductions(new, block) == [], f"0.5.23 {block.name} reduces its own output"
    if cls == "Qwen3MoeForCausalLM":     # the lines the issue quotes (qwen3_moe.py 329-344)
        (r,) = S.self_reductions(old, old_blocks[0])
        assert (r.method, r.callee) == ("forward_normal", "moe_tensor_model_parallel_all_reduce")
        assert 329 <= r.line <= 344


def test_the_reduction_checker_sees_guarded_calls(new):
    """Control: 0.5.23's DeepSeek block does contain an all-reduce, under ``if self.reduce_results:``, and its
    layer builds it with reduce_results=False. Built without that argument the checker finds the call; built
    as the layer builds it, the branch is ruled out."""
    (block,) = S.moe_blocks(new, _root(new, "DeepseekV3ForCausalLM"))
    assert block.arg("reduce_results") is False
    unbound = S.ClassRef(block.rel, block.node)
    found = S.self_reductions(new, unbound)
    assert found and {r.callee for r in found} == {"post_experts_all_reduce"}
    assert all("self.reduce_results" in r.guards for r in found)


def test_forward_batch_fields_and_modes(old, new):
    """Every ForwardBatch field the row builder reads exists in both with the same type and default; the
    ForwardMode predicates it calls directly exist and have the same body."""
    fields = S.attribute_reads(sglang_rows.__file__, "fb")
    assert {"rids", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "seq_lens_cpu"} <= set(fields)
    fo, fn = S.class_fields(old, FB, "ForwardBatch"), S.class_fields(new, FB, "ForwardBatch")
    for name in fields:
        assert name in fo, f"0.5.15.post1 ForwardBatch has no field {name}"
        assert fo[name] == fn.get(name), (name, fo[name], fn.get(name))
    modes = S.attribute_reads(sglang_rows.__file__, "m", "_mode")
    direct = {n for n, fallback in modes.items() if not fallback}
    assert direct == {"is_idle", "is_decode", "is_extend"}
    bodies = [_method_dumps(t) for t in (old, new)]
    for name in direct | {"is_target_verify"}:
        assert name in bodies[0] and bodies[0][name] == bodies[1][name], name
    # read with a fallback: is_draft_extend exists in neither (DRAFT_EXTEND_V2 is outside is_extend() anyway)
    assert "is_draft_extend" not in bodies[0] and "is_draft_extend" not in bodies[1]


def _method_dumps(tree: S.SourceTree) -> dict[str, str]:
    ref = S.find_class(tree, FB, "ForwardMode")
    return {m.name: ast.dump(m) for m in ref.node.body if isinstance(m, ast.FunctionDef)}


def _server_arg_names() -> tuple[set[str], set[str]]:
    """(arguments whose value the hook judges or slime's integration sets, arguments only recorded)."""
    judged = {n.replace("{}", p) for n in S.attribute_reads(sglang_server.__file__, "sa") for p in PHASES}
    judged |= {k.removeprefix("sglang_") for k in SLIME_SERVER_ARGS} | {"forward_hooks"}
    return judged, set(NUMERICS_SERVER_ARGS) - judged


def test_server_arguments(old, new):
    """Every server argument the adapter reads or slime's integration sets is a ServerArgs field of both;
    the judged ones have the same type and default (or differ harmlessly, said why); slime's flags exist
    on the command line of both, --enforce-disable-flashinfer-allreduce-fusion included."""
    judged, recorded = _server_arg_names()
    assert "enforce_disable_flashinfer_allreduce_fusion" in judged
    fo, fn = S.server_arg_fields(old), S.server_arg_fields(new)
    for name in sorted(judged | recorded):
        assert name in fo, f"0.5.15.post1 ServerArgs has no field {name}"
        assert name in fn, f"0.5.23 ServerArgs has no field {name}"
    differ = {n for n in judged if (_type(fo[n]), fo[n].default) != (_type(fn[n]), fn[n].default)}
    assert differ == set(MEANING_DIFFERS_HARMLESSLY), {n: (fo[n], fn[n]) for n in differ}
    for tree in (old, new):
        flags = S.server_cli_flags(tree)
        for name in ("enforce_disable_flashinfer_allreduce_fusion", "disable_cuda_graph", "disable_radix_cache",
                     "forward_hooks", "disable_overlap_schedule"):
            assert "--" + name.replace("_", "-") in flags, (tree, name)
    # control: a field that is not on the command line is not taken for a flag
    assert "no_cli=True" in fo["enable_flashinfer_allreduce_fusion"].annotation
    assert "--no-such-flag" not in S.server_cli_flags(old)


def _type(f: S.Field) -> str:
    """The value type of a field annotation (``A[bool, "help"]`` -> ``bool``)."""
    node = ast.parse(f.annotation, mode="eval").body
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "A":
        node = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
    return ast.unparse(node)


def test_forward_hooks_and_runtime_context(old, new):
    """The forward-hooks spec keys our spec carries are the ones SGLang's register_forward_hooks reads, and
    the model executor registers the server's ``forward_hooks``; the result types keep the fields read."""
    spec = forward_hooks_spec("/tmp/x")[0]
    for tree in (old, new):
        fn = _function(tree, "srt/model_executor/hook_manager.py", "register_forward_hooks")
        keys = {n.args[0].value for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get" and isinstance(n.func.value, ast.Name) and n.func.value.id == "spec"}
        assert keys == set(spec), (tree, keys)
        assert _hook_registrations(tree), f"{tree}: nothing registers the server's forward_hooks"
        assert {"get_parallel", "get_server_args"} <= S.module_functions(tree, "srt/runtime_context.py")
        for rel, cls, names in (("srt/layers/logits_processor.py", "LogitsProcessorOutput",
                                 {"next_token_logits", "input_token_logprobs"}),
                                ("srt/layers/moe/topk.py", "StandardTopKOutput", {"topk_weights", "topk_ids"})):
            assert names <= set(S.class_fields(tree, rel, cls)), (tree, cls)
        for model in ("qwen3", "qwen3_moe", "glm4_moe"):       # the QK-norm function the adapter taps
            assert "apply_qk_norm" in S.module_functions(tree, f"srt/models/{model}.py"), (tree, model)


def test_parallel_coordinates_in_0515(old):
    """0.5.15.post1's get_parallel() declares every coordinate the adapter reads as a property (0.5.23 resolves
    them dynamically through ``__getattr__``; the TP=2 tests of tests/test_sglang_adapter.py read them there)."""
    props = S.class_methods(old, "srt/runtime_context.py", "ParallelContext")
    for k in ("tp", "pp", "attn_tp", "moe_ep", "moe_tp"):
        assert {f"{k}_rank", f"{k}_size"} <= props, k


def test_residual_convention_in_0515(old):
    """The ``input`` / ``mid`` / ``output`` rows read the 2nd output of the norms: 0.5.15.post1's layer
    communicator calls them as ``hidden_states, residual = <norm>(hidden_states, residual)`` (the
    post-attention norm is handed on as ``layernorm=``; 0.5.23 moved both into layer boundaries, its
    convention is tested on the running model code)."""
    text = old.text("srt/layers/communicator.py")
    mod = ast.parse(text)
    calls = {ast.unparse(n) for n in ast.walk(mod) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
             and ast.unparse(n.targets[0]) == "(hidden_states, residual)"}
    assert "hidden_states, residual = self.input_layernorm(hidden_states, residual)" in calls
    assert "hidden_states, residual = layernorm(hidden_states, residual)" in calls
    assert "layernorm=self.post_attention_layernorm" in text


def _function(tree: S.SourceTree, rel: str, name: str) -> ast.FunctionDef:
    return next(n for n in tree.module(rel).body if isinstance(n, ast.FunctionDef) and n.name == name)


def _hook_registrations(tree: S.SourceTree) -> list[str]:
    """Calls ``register_forward_hooks(<model>, <...>.forward_hooks)`` in the model executor (0.5.15: the model
    runner; 0.5.23: its CUDA-graph setup, after capture)."""
    out = []
    for folder in ("srt/model_executor/", "srt/model_executor/model_runner_components/"):
        for rel in tree.files(folder):
            if "register_forward_hooks(" not in tree.text(rel):
                continue
            out += [f"{rel}:{n.lineno}" for n in ast.walk(tree.module(rel)) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name) and n.func.id == "register_forward_hooks"
                    and len(n.args) == 2 and ast.unparse(n.args[1]).endswith(".forward_hooks")]
    return out
