"""scripts/check_slime_pins.py, the CI check that installing tic-trace into slime's image moves none of its pins,
run on small local wheels with pip's real resolver (offline): it fails when a requirement would move a pin,
passes when every requirement admits it, and refuses a pins file holding anything but exact pins. CI runs it
on tic-trace itself against requirements/slime-image.txt (.ci/run)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "scripts" / "check_slime_pins.py"


def _wheel(where: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel holding only its metadata: all pip's resolver reads."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = where / f"{dist}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    files = {f"{dist}.dist-info/METADATA": meta,
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wheels")
    for v in ("1.0", "2.0"):
        _wheel(d, "pinned-pkg", v)
    _wheel(d, "free-pkg", "3.0")
    _wheel(d, "moves-it", "1.0", ("pinned-pkg>=2", "free-pkg"))
    _wheel(d, "keeps-it", "1.0", ("pinned-pkg>=1,<3", "free-pkg"))
    (d / "pins.txt").write_text("# the image's pins\npinned-pkg==1.0   # why it is pinned\n")
    return d


def _check(index: Path, *targets: str, pins: str = "pins.txt") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), "--python", sys.executable, "--pins", str(index / pins),
                           "--pip-arg=--no-index", f"--pip-arg=--find-links={index}", *targets],
                          capture_output=True, text=True, timeout=300)


def test_a_requirement_that_moves_a_pin_fails_naming_it(index):
    r = _check(index, "keeps-it", "moves-it")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ok   keeps-it: keeps every pin it meets (pinned-pkg==1.0)" in r.stdout
    assert "FAIL moves-it" in r.stderr
    assert "pinned-pkg>=2" in r.stderr and "pinned-pkg==1.0" in r.stderr   # pip's two sides of the conflict


def test_requirements_that_admit_every_pin_pass(index):
    r = _check(index, "keeps-it", "free-pkg")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   free-pkg: keeps every pin it meets (none)" in r.stdout


def test_a_pins_file_with_a_range_is_refused(index):
    (index / "ranges.txt").write_text("pinned-pkg>=1.0\n")
    r = _check(index, "keeps-it", pins="ranges.txt")
    assert r.returncode != 0
    assert "ranges.txt:1: 'pinned-pkg>=1.0' is no exact pin" in r.stderr


def test_the_slime_image_pins_are_exact_and_include_slimes_stack():
    sys.path.insert(0, str(CHECKER.parent))
    try:
        from check_slime_pins import read_pins
    finally:
        sys.path.remove(str(CHECKER.parent))
    pins = read_pins(REPO / "requirements" / "slime-image.txt")
    assert {k: pins[k] for k in ("torch", "transformers", "sglang", "megatron-core")} == {
        "torch": "2.11.0", "transformers": "5.12.1", "sglang": "0.5.15.post1", "megatron-core": "0.16.0rc0"}


def test_every_extra_admits_every_slime_pin_it_names():
    """The cheap static half of the CI check: each extra's requirement on a package slime's image pins admits
    that pin (pip's resolution, with transitive requirements, is scripts/check_slime_pins.py in .ci/run)."""
    import tomllib

    from packaging.requirements import Requirement

    sys.path.insert(0, str(CHECKER.parent))
    try:
        from check_slime_pins import canonical, read_pins
    finally:
        sys.path.remove(str(CHECKER.parent))
    pins = read_pins(REPO / "requirements" / "slime-image.txt")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]["optional-dependencies"]
    base = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    named, moved = 0, []
    for extra, spec in {"(no extra)": {"file": []}, **extras}.items():
        lines = list(base) if extra == "(no extra)" else []
        for f in spec["file"]:
            lines += [ln.split("#", 1)[0].strip() for ln in (REPO / f).read_text().splitlines()]
        for req in (Requirement(ln) for ln in lines if ln):
            pin = pins.get(canonical(req.name))
            if pin is not None:
                named += 1
                if not req.specifier.contains(pin, prereleases=True):
                    moved.append(f"{extra}: {req} excludes slime's {req.name}=={pin}")
    assert named >= 5 and moved == [], moved
