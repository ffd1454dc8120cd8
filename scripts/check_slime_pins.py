#!/usr/bin/env python3
"""Check that installing tic-trace into a slime image moves none of the image's pins (CI: .ci/run).

pip resolves each target with the image's pins as constraints (`pip install --dry-run --ignore-installed
--report`, in a throw-away environment): a target whose requirements exclude a pinned version ends in
ResolutionImpossible, which here is a failure naming the pins pip could not keep. A resolution that succeeds
is read back from pip's report: every pinned package in it must be at its pin, and the packages it would add
are listed (additions, not moves).

Usage:  python3 scripts/check_slime_pins.py [--pins requirements/slime-image.txt] [--pip-arg ARG]... TARGET...
        TARGET is what `pip install` takes: `.`, `.[hf]`, a wheel, `name==version`.
Exit 0: every target keeps every pin; 1: a target would move one (or pip cannot resolve it); 2: bad usage.
Standard library only: it runs before any environment of the project exists.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")
# pip's own lines that name the conflict (pip 23: "The conflict is caused by:", then one line per requirement).
_CONFLICT = re.compile(r"conflict is caused by|requested|depends on|ResolutionImpossible|No matching distribution"
                       r"|Could not find a version", re.I)


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line; anything else but comments is an error."""
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        m = _PIN.match(text)
        if m is None:
            raise SystemExit(f"{path}:{n}: '{text}' is no exact pin (name==version); a constraints file of "
                             "the image's pins holds only those")
        pins[canonical(m.group(1))] = m.group(2)
    if not pins:
        raise SystemExit(f"{path}: no pins in it")
    return pins


def resolve(python: Path, pins_file: Path, target: str, pip_args: list[str], report: Path) -> subprocess.CompletedProcess:
    # Not --quiet: pip says which requirements conflict only at its normal verbosity.
    cmd = [str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--disable-pip-version-check", "--report", str(report), "-c", str(pins_file), *pip_args, target]
    return subprocess.run(cmd, capture_output=True, text=True)


def resolved(report: dict) -> dict[str, str]:
    """{canonical name: version} of everything pip's report would install."""
    return {canonical(i.get("metadata", {}).get("name", "?")): i.get("metadata", {}).get("version", "?")
            for i in report.get("install", [])}


def moved_pins(got: dict[str, str], pins: dict[str, str]) -> list[str]:
    """The pins a resolution would move, as `name pin -> version`."""
    return [f"{name} {pins[name]} -> {v}" for name, v in sorted(got.items()) if name in pins and pins[name] != v]


def check(python: Path, pins_file: Path, pins: dict[str, str], target: str, pip_args: list[str]) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        proc = resolve(python, pins_file, target, pip_args, report_path)
        if proc.returncode != 0:
            said = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if _CONFLICT.search(ln)]
            print(f"FAIL {target}: pip cannot install it without moving a pin of {pins_file}:", file=sys.stderr)
            for ln in said or (proc.stderr or proc.stdout).strip().splitlines()[-15:]:
                print(f"    {ln}", file=sys.stderr)
            return False
        got = resolved(json.loads(report_path.read_text()))
    moved = moved_pins(got, pins)
    if moved:
        print(f"FAIL {target}: would move {', '.join(moved)} (pinned in {pins_file})", file=sys.stderr)
        return False
    kept = [f"{p}=={pins[p]}" for p in sorted(pins) if p in got]
    # The others are packages the image does not pin (in a fresh environment: torch's own dependencies too).
    print(f"ok   {target}: keeps every pin it meets ({', '.join(kept) or 'none'}); "
          f"{len(got) - len(kept)} other packages resolve freely")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+", metavar="TARGET")
    ap.add_argument("--pins", type=Path, default=Path("requirements/slime-image.txt"))
    ap.add_argument("--pip-arg", action="append", default=[], help="passed to pip (e.g. --pip-arg=--no-index)")
    ap.add_argument("--python", type=Path, help="an interpreter with pip (default: a new throw-away venv)")
    args = ap.parse_args(argv)
    if not args.pins.is_file():
        print(f"check_slime_pins: {args.pins}: no such file", file=sys.stderr)
        return 2
    pins = read_pins(args.pins)
    with tempfile.TemporaryDirectory() as env_dir:
        python = args.python
        if python is None:
            venv.create(env_dir, with_pip=True)
            python = Path(env_dir) / "bin" / "python"
        ok = [check(python, args.pins.resolve(), pins, t, args.pip_arg) for t in args.targets]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
