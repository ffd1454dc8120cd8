"""Check that SGLang's model code imports with only the light packages (run by scripts/setup.sh).

SGLang is installed ``--no-deps`` on purpose: its declared dependencies are many GB of CUDA wheels that its
model code, run on the CPU, never uses. pip therefore cannot tell whether requirements/sglang-light.txt is
enough; this does, by importing every SGLang module that tic-trace's CPU harness (sglang_cpu.py), the SGLang
adapter's tests and the demo pairs reach. The first module that fails prints its full traceback; the check exits 1.

Usage: ``python -m tic_trace.testing.sglang_light_check``
"""
from __future__ import annotations

import importlib
import logging
import sys
import traceback
import warnings

# The import roots; each pulls in a wide part of SGLang (layers, quantization, distributed, mem_cache).
MODEL_CODE_MODULES = (
    "sglang",
    "sglang.srt.models.qwen3",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen2_moe",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.glm4_moe",
    "sglang.srt.model_loader.loader",
    "sglang.srt.model_loader.weight_utils",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.model_executor.forward_context",
    "sglang.srt.model_executor.hook_manager",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.server_args",
)
#: Modules that moved between the two releases the project runs (0.5.23: the default lane; 0.5.15.post1:
#: slime's, the slime-stack lane), keyed by the installed release; any other release gets 0.5.23's.
VERSION_MODULES = {
    "0.5.23": ("sglang.srt.distributed.bootstrap", "sglang.kernels.ops.attention.clamp_position"),
    "0.5.15.post1": ("sglang.srt.distributed.parallel_state", "sglang.srt.layers.dp_attention"),
}


def modules_for(version: str) -> tuple[str, ...]:
    """The import roots to check for this SGLang release."""
    return MODEL_CODE_MODULES + VERSION_MODULES.get(version, VERSION_MODULES["0.5.23"])


def first_failing_import(modules: tuple[str, ...] | None = None) -> str | None:
    """Import the modules in order; print the traceback of the first that fails and return its name.

    Stops there: the modules share most of SGLang, so one missing package fails all that follow, each with a
    less telling traceback than the first.
    """
    # On the CPU, SGLang warns at import that AWQ/GGUF kernels need a GPU and logs that it cannot detect a CUDA
    # architecture: true, and not what this check is about.
    logging.getLogger("sglang").setLevel(logging.ERROR)
    if modules is None:
        from importlib.metadata import version
        modules = modules_for(version("sglang"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - any import failure is what this check reports
                traceback.print_exc()
                return name
    return None


def main() -> int:
    failed = first_failing_import()
    if failed:
        print(f"SGLang's model code does not import: {failed} fails (traceback above). A package it needs is "
              "missing from requirements/sglang-light.txt: add it there with an exact pin, and its own "
              "dependencies to requirements/constraints.txt.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
