"""Run slime's own code (the vendored source snapshot) in a test process. TEST SUPPORT ONLY.

slime and Megatron-LM's ``megatron/training`` are not installable from the package registry, so the tests
run the snapshots in ``../shared/vendor`` (see its README): :func:`activate` puts the vendored Megatron-LM
first on ``sys.path`` (its ``megatron`` namespace package then shadows the ``megatron-core`` wheel: call it
only in a process of its own, before anything imports ``megatron``), then slime, then installs the stubs
below. Everything else slime imports is the real package of this environment (torch, transformers,
SGLang 0.5.23's ``ServerArgs``, httpx, ...).

Each stub replaces one heavy runtime package slime imports at module level and that is not installed here
(or, :class:`NoWeightUpdater`, one slime object that needs GPUs and engines); each defines only what the code
paths under test reach, and says which slime line needs it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

#: Environment variable naming the vendor directory (default: ``../shared/vendor`` next to the repository).
VENDOR_ENV = "TIC_TRACE_VENDOR_DIR"
#: Variables naming one snapshot each (e.g. a newer slime checkout), overriding its folder in the vendor directory.
SLIME_ENV = "TIC_TRACE_SLIME_DIR"
MEGATRON_ENV = "TIC_TRACE_MEGATRON_LM_DIR"
SLIME_SNAPSHOT = "slime-624b824a8"
MEGATRON_SNAPSHOT = "megatron-lm-1dcf0daf"
UPSTREAM = {"slime": "THUDM/slime", "Megatron-LM": "NVIDIA/Megatron-LM"}


def vendor_dir() -> Path:
    """The vendored-sources folder: ``$TIC_TRACE_VENDOR_DIR``, else the first ``shared/vendor`` holding the
    snapshots in the repository or one of the folders above it (``<repo>/../shared/vendor`` on the project's
    machines; a clone elsewhere below the same folder finds it too)."""
    env = os.environ.get(VENDOR_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for base in (repo, *repo.parents):
        v = base / "shared" / "vendor"
        if (v / SLIME_SNAPSHOT).is_dir() and (v / MEGATRON_SNAPSHOT).is_dir():
            return v
    return repo.parent / "shared" / "vendor"


@dataclass(frozen=True)
class Source:
    """One upstream source tree the slime tests run: where it is and which commit it holds."""
    name: str             # "Megatron-LM" or "slime"
    path: Path
    variable: str         # the variable that names this folder directly
    pinned: str           # the snapshot's folder name in the vendor directory (its commit after the dash)

    @property
    def present(self) -> bool:
        return self.path.is_dir()

    @property
    def commit(self) -> str:
        """The tree's commit: ``git rev-parse HEAD`` of a checkout, else the hex suffix of a snapshot's folder
        name (``slime-624b824a8``), else "unknown"."""
        if (self.path / ".git").exists():
            try:
                r = subprocess.run(["git", "-C", str(self.path), "rev-parse", "--short=12", "HEAD"],
                                   capture_output=True, text=True, timeout=10)
                if r.returncode == 0 and r.stdout.strip():
                    return r.stdout.strip()
            except (OSError, subprocess.SubprocessError):
                pass
        m = re.search(r"-([0-9a-f]{7,40})$", self.path.name)
        return m.group(1) if m else "unknown"


def sources() -> list[Source]:
    """``[Megatron-LM, slime]``, Megatron-LM first (it must shadow the wheel on ``sys.path``)."""
    v = vendor_dir()
    out = []
    for name, var, snap in (("Megatron-LM", MEGATRON_ENV, MEGATRON_SNAPSHOT), ("slime", SLIME_ENV, SLIME_SNAPSHOT)):
        own = os.environ.get(var)
        out.append(Source(name, Path(own) if own else v / snap, var, snap))
    return out


def missing_reason() -> str | None:
    """One line saying which vendored source is absent, its pinned commit and how to provide it; None when
    every source is there."""
    missing = [s for s in sources() if not s.present]
    if not missing:
        return None
    what = "; ".join(f"{s.name} (github.com/{UPSTREAM[s.name]} at {s.pinned.rsplit('-', 1)[1]}) not at {s.path}"
                     for s in missing)
    return (f"vendored sources missing: {what}. Check out those commits and name each tree with "
            f"{MEGATRON_ENV} / {SLIME_ENV}, or put them as {MEGATRON_SNAPSHOT}/ and {SLIME_SNAPSHOT}/ in one "
            f"folder named by {VENDOR_ENV}")


def describe() -> str:
    """Which trees the slime tests run against, for the test session's header."""
    return "; ".join(f"{s.name} {s.commit} at {s.path}" if s.present else f"{s.name}: absent ({s.path})"
                     for s in sources())


def vendored_paths() -> list[str]:
    """``[megatron-lm, slime]`` source folders, Megatron-LM first (it must shadow the wheel)."""
    reason = missing_reason()
    if reason:
        raise FileNotFoundError(reason)
    return [str(s.path) for s in sources()]


def activate() -> None:
    """Vendored Megatron-LM and slime first on ``sys.path``, then the stubs. Call before importing megatron."""
    if any(m == "megatron" or m.startswith("megatron.") for m in sys.modules):
        raise RuntimeError("megatron is already imported (the megatron-core wheel): activate() must run first, "
                           "in a process of its own")
    sys.path[:0] = vendored_paths()
    install_stubs()


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__tic_trace_stub__ = True
    sys.modules[name] = m
    return m


class _RayRemote:
    """``@ray.remote`` / ``@ray.remote(num_cpus=0)`` as a no-op decorator."""

    def __call__(self, *a, **kw):
        if len(a) == 1 and not kw and callable(a[0]):
            return a[0]
        return lambda obj: obj


class NoWeightUpdater:
    """Stands in for the train actor's weight updater (``slime/backends/megatron_utils/update_weight/``: pushes
    weights to the SGLang engines over NCCL or CUDA IPC; created by ``MegatronTrainRayActor.init``).
    ``train_actor`` only calls its ``pop_metrics()`` (actor.py, the ``log_perf_data`` call at its end); the
    tests load the same HF weights into both sides instead of pushing them."""

    def pop_metrics(self) -> dict:
        return {}


def install_stubs() -> None:
    """Install the stub modules (each once)."""
    if "ray" not in sys.modules:
        # ray: the cluster runtime. slime/backends/megatron_utils/actor.py:8, slime/ray/train_actor.py:7,
        # slime/ray/rollout.py:10-12 and update_weight/*.py import it at module level (`ray.remote` as a
        # decorator, `ray.ObjectRef` / `ray.actor.ActorHandle` in annotations); the code under test calls
        # none of it (no actor is created through Ray: the tests call the actor's methods directly).
        ray = _module("ray", remote=_RayRemote(), ObjectRef=object, get=lambda ref: ref, put=lambda value, **kw: value,
                      get_gpu_ids=lambda: [0], is_initialized=lambda: False)
        ray.actor = _module("ray.actor", ActorHandle=object)
        ray.util = _module("ray.util")
        ray.util.scheduling_strategies = _module("ray.util.scheduling_strategies",
                                                 PlacementGroupSchedulingStrategy=object,
                                                 NodeAffinitySchedulingStrategy=object)
        ray.util.placement_group = _module("ray.util.placement_group", placement_group=None)
        ray._private = types.SimpleNamespace(services=types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"))
    if "wandb" not in sys.modules:
        # wandb: experiment tracking. slime/observability/logging_utils.py:3 and wandb_utils.py:5 import it;
        # only called when --use-wandb is set (never in these tests).
        _module("wandb")
    if "sglang_router" not in sys.modules:
        # sglang_router: the Rust router package. slime/backends/sglang_utils/arguments.py:5 imports
        # RouterArgs and :34 calls RouterArgs.add_cli_args(parser, use_router_prefix=True,
        # exclude_host_port=True); :46 sets defaults for two of its arguments. This adds those two only.
        class RouterArgs:
            @staticmethod
            def add_cli_args(parser, use_router_prefix=False, exclude_host_port=False):
                parser.add_argument("--router-balance-abs-threshold", type=int, default=64)
                parser.add_argument("--router-balance-rel-threshold", type=float, default=1.5)
                parser.add_argument("--router-log-level", type=str, default="info")
                return parser
        _module("sglang_router")
        _module("sglang_router.launch_router", RouterArgs=RouterArgs)
    if "torch_memory_saver" not in sys.modules:
        # torch_memory_saver: CUDA memory pausing for --offload-train. slime/backends/megatron_utils/actor.py:12
        # imports `torch_memory_saver`; only sleep()/wake_up() (offload) call it.
        _module("torch_memory_saver", torch_memory_saver=types.SimpleNamespace(_impl=None))
    if "pylatexenc" not in sys.modules:
        # pylatexenc: LaTeX-to-text for the math reward. slime/rollout/rm_hub/math_utils.py:10
        # (`from pylatexenc import latex2text`), reached from sglang_rollout via rm_hub; no reward is computed.
        p = _module("pylatexenc")
        p.latex2text = _module("pylatexenc.latex2text", LatexNodes2Text=object)
