#!/usr/bin/env bash
# CI: build the sdist and the wheel with the pinned front end (requirements/build.txt), check that the wheel
# holds every file of the installed packages, install it (extra `hf`, pinned by requirements/constraints.txt)
# into a fresh environment and run `tic-trace --version` and `tic-trace demo` from it, outside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

echo "wheel: building the sdist and the wheel (build $(grep '^build==' requirements/build.txt | cut -d= -f3))"
python3 -m venv "$work/build-env"
quiet "$work/build-env/bin/python" -m pip install -q --disable-pip-version-check -r requirements/build.txt
quiet "$work/build-env/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" \
  || { cat "$work/build.log"; echo "wheel: the build failed (its log above)" >&2; exit 1; }
wheel=$(ls "$work"/dist/tic_trace-*.whl)
ls "$work"/dist/tic_trace-*.tar.gz >/dev/null

# Every tracked file under a folder pyproject.toml installs (code and any package data) is in the wheel.
python3 - "$wheel" <<'PY'
import subprocess, sys, tomllib, zipfile
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]   # package -> folder
have = set(zipfile.ZipFile(sys.argv[1]).namelist())
tracked = subprocess.run(["git", "ls-files", "--", *set(dirs.values())], capture_output=True, text=True,
                         check=True).stdout.split()
missing = []
for path in tracked:
    pkg, src = max(((p, d) for p, d in dirs.items() if path.startswith(d + "/")), key=lambda pd: len(pd[1]))
    name = pkg.replace(".", "/") + path[len(src):]      # the deepest mapped folder names its place in the wheel
    if name not in have:
        missing.append(f"{path} (as {name})")
if missing:
    sys.exit("wheel: files of the packages missing from the wheel: " + ", ".join(missing))
print(f"wheel: {sys.argv[1].rsplit('/', 1)[-1]} holds every tracked file of its packages ({len(tracked)})")
PY

echo "wheel: installing it with the extra hf into a fresh environment"
python3 -m venv "$work/env"
quiet "$work/env/bin/python" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt "$wheel[hf]"
cd "$work"   # nothing of the checkout on sys.path from here on
"$work/env/bin/tic-trace" --version
rc=0
"$work/env/bin/tic-trace" demo --out "$work/demo" >"$work/demo.log" 2>&1 || rc=$?
# The demo exits 0 when it found what it planted (the report's own exit codes are for first-divergence).
if [ "$rc" -ne 0 ] || ! grep -q "^FIRST DIVERGENCE at L1.moe.router_logits" "$work/demo.log"; then
  cat "$work/demo.log"
  echo "wheel: the installed demo did not find its planted fault (exit $rc, want 0 and L1.moe.router_logits)" >&2
  exit 1
fi
"$work/env/bin/python" -c "import tic_trace, sys; f = tic_trace.__file__; sys.exit(0 if '$repo' not in f else f'imported from the checkout: {f}')"
echo "wheel: the installed tic-trace ran the demo: $(grep -m1 '^FIRST DIVERGENCE' "$work/demo.log" | cut -c1-60)..."
