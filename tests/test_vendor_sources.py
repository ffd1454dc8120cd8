"""The tests on slime's own code need sources a public checkout lacks: outside CI they skip with one line saying
what is missing and how to provide it; with CI=true the same absence fails the run. A newer tree named by a
variable is used, and the session says which commit it ran against."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tic_trace.testing import child, slime_vendor

ROOT = Path(__file__).resolve().parents[1]


def _pytest(env_extra: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    dropped = ("CI", "TIC_TRACE_TEST_RUNNING_FILE", slime_vendor.SLIME_ENV, slime_vendor.MEGATRON_ENV)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(env_extra)
    return child.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                      "tests/test_slime_real.py"], cwd=ROOT, env=env, capture_output=True, text=True)


def test_absent_sources_skip_outside_ci_and_fail_inside(tmp_path):
    absent = {slime_vendor.VENDOR_ENV: str(tmp_path / "no-vendor")}
    r = _pytest(absent, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    # every test of the file skips (none runs, none fails): the slime-code tests are all of it
    assert re.search(r"\d+ skipped", r.stdout) and " passed" not in r.stdout, r.stdout[-3000:]
    assert "failed" not in r.stdout and "error" not in r.stdout.lower()
    assert "slime (github.com/THUDM/slime at 624b824a8) not at" in r.stdout
    assert slime_vendor.SLIME_ENV in r.stdout                     # says how to provide them
    r = _pytest({**absent, "CI": "true"}, tmp_path)
    assert r.returncode != 0 and not re.search(r"\d+ skipped", r.stdout), r.stdout[-3000:]
    assert "CI=true and vendored sources missing" in r.stdout


def test_a_tree_named_by_its_variable_is_used_and_its_commit_reported(tmp_path, monkeypatch):
    tree = tmp_path / "my-slime"
    tree.mkdir()
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tree / "README").write_text("a newer slime\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setenv(slime_vendor.SLIME_ENV, str(tree))
    slime = next(s for s in slime_vendor.sources() if s.name == "slime")
    assert slime.path == tree and slime.present and slime.commit == head
    assert f"slime {head} at {tree}" in slime_vendor.describe()
    monkeypatch.setenv(slime_vendor.SLIME_ENV, str(tmp_path / "absent"))
    assert "slime (github.com/THUDM/slime at 624b824a8) not at" in slime_vendor.missing_reason()
