"""``python -m tic_trace.integrations.slime.train <slime train arguments> --tic-trace ...``

slime's own entry point (``train.py``) with the ``--tic-trace`` flag family added: it calls
``slime.utils.arguments.parse_args(add_custom_arguments=add_arguments)``, then
:func:`tic_trace.integrations.slime.configure`, then ``train(args)`` of slime's ``train.py``. Without
``--tic-trace`` the run is exactly ``python train.py <arguments>``.

``train.py`` is a script at the root of the slime checkout, not part of the ``slime`` package. It is
found next to the installed ``slime`` package (an editable install or a checkout on ``PYTHONPATH``), or in
the current directory; ``TIC_TRACE_SLIME_ENTRY`` names another script (e.g. ``train_async.py``, or a path).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

INSTALL_HINT = ("slime is not importable. Install it from its repository (pip's 'slime' package is unrelated): "
                "git clone https://github.com/THUDM/slime && pip install -e ./slime, or put the checkout on "
                "PYTHONPATH (slime also needs megatron-core / Megatron-LM, sglang and ray).")


def _entry_script(slime_pkg_file: str | None) -> Path:
    name = os.environ.get("TIC_TRACE_SLIME_ENTRY", "train.py")
    cand = [Path(name)]
    if not Path(name).is_absolute():
        if slime_pkg_file:
            cand.insert(0, Path(slime_pkg_file).resolve().parent.parent / name)
        cand.append(Path.cwd() / name)
    for p in cand:
        if p.is_file():
            return p
    raise FileNotFoundError(f"slime entry script {name!r} not found (looked at {', '.join(str(c) for c in cand)}); "
                            "run from the slime checkout or set TIC_TRACE_SLIME_ENTRY=/path/to/slime/train.py")


def _load_train(path: Path):
    spec = importlib.util.spec_from_file_location("_tic_trace_slime_entry", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)       # its `if __name__ == "__main__":` block does not run
    fn = getattr(mod, "train", None)
    if not callable(fn):
        raise AttributeError(f"{path} defines no train(args)")
    return fn


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]   # slime parses sys.argv itself
    try:
        import slime
        from slime.utils.arguments import parse_args
    except ImportError as e:
        print(f"tic-trace: {INSTALL_HINT} ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    try:
        entry = _entry_script(getattr(slime, "__file__", None))
        train = _load_train(entry)
    except (FileNotFoundError, AttributeError) as e:
        print(f"tic-trace: {e}", file=sys.stderr)
        return 2
    from tic_trace.integrations.slime import add_arguments, configure, enabled
    from tic_trace.integrations.slime.config import ENTRY_ATTR
    args = parse_args(add_custom_arguments=add_arguments)
    if enabled(args):
        setattr(args, ENTRY_ATTR, entry.name)      # _warn_about_setup names what train_async.py changes
    args = configure(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
