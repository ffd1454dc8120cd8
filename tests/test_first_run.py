"""A new user's first run: the demo leaves a checkout clean, and the set-up's SGLang import check can fail.

The set-up itself (a fresh environment, no "ERROR" line, no traceback) is checked by .ci/run on a clean clone.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from tic_trace.testing import child
from tic_trace.testing.sglang_light_check import first_failing_import
from tic_trace.tools.demo import demo_out_dir

REPO = Path(__file__).resolve().parents[1]


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout


def test_demo_writes_under_a_directory_it_names_and_leaves_the_checkout_clean(tmp_path):
    before = _git_status()
    env = dict(os.environ, TMPDIR=str(tmp_path))
    run = child.run([sys.executable, "-m", "tic_trace.tools.cli", "demo"], cwd=REPO, env=env,
                    capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr  # the planted router_bf16 fault was found
    assert _git_status() == before
    made = list(tmp_path.glob("tic-trace-demo-*"))
    assert len(made) == 1, made
    out = made[0]
    assert f"the demo writes its traces and reports under {out}" in run.stdout
    assert {p.name for p in out.iterdir()} == {"A", "B", "report.json", "report.html", ".tic-trace-demo"}


def test_demo_out_is_used_as_given_and_named(tmp_path):
    console = Console(record=True, width=300)
    assert demo_out_dir(str(tmp_path / "mine"), console) == tmp_path / "mine"
    assert f"under {tmp_path / 'mine'}" in console.export_text()


def test_sglang_light_check_imports_the_model_code():
    assert first_failing_import() is None


def test_sglang_light_check_names_a_module_that_does_not_import(capsys):
    assert first_failing_import(("json", "tic_trace_no_such_module", "csv")) == "tic_trace_no_such_module"
    assert "ModuleNotFoundError: No module named 'tic_trace_no_such_module'" in capsys.readouterr().err
