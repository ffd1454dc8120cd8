#!/usr/bin/env bash
# Create/update the project's virtual environment with every pinned dependency. Idempotent and quick when
# nothing changed (a stamp of requirements/*.txt and pyproject.toml is kept in the venv): then it prints nothing.
# Otherwise one line per step; pip itself speaks only to report a problem, and then in full.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TIC_TRACE_VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.tic-trace-setup"
want=$(cat requirements/*.txt pyproject.toml | sha256sum | cut -c1-16)
[ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ] && exit 0

step() { echo "set-up: $*"; }
# pip warns about every local index location this machine lacks; keep everything else, errors included.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
py="$VENV/bin/python"
pip=(quiet "$py" -m pip install -q --disable-pip-version-check)
installed() { "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
sglang_pin=$(grep -i '^sglang==' requirements/constraints.txt) \
  || { echo "set-up: requirements/constraints.txt has no sglang==VERSION line; add the pinned SGLang" >&2; exit 1; }

if [ ! -x "$py" ]; then
  step "creating the environment $VENV ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
fi

if installed torch; then
  step "installing pinned packages (requirements/)"
else
  step "installing pinned packages (requirements/); this first install brings torch and its CUDA libraries," \
       "several GB: it takes minutes"
fi
# SGLang is installed without its dependencies (below), so pip would list every one of them as missing whenever
# it re-checks sglang; take it out while the resolver runs, and put it back last.
if installed sglang; then quiet "$py" -m pip uninstall -q -y sglang; fi
"${pip[@]}" -c requirements/constraints.txt -r requirements/base.txt -r requirements/hf.txt -r requirements/megatron.txt \
  -r requirements/test.txt -r requirements/fast.txt -r requirements/sglang-light.txt -r requirements/real-model.txt

step "installing SGLang's model code ($sglang_pin) without its serving dependencies, on purpose" \
     "(requirements/sglang-light.txt says why)"
"${pip[@]}" --no-deps "$sglang_pin"
step "installing tic-trace itself (editable: pip install -e .)"
"${pip[@]}" --no-deps -e .

step "checking that SGLang's model code imports with the light packages"
"$py" -m tic_trace.testing.sglang_light_check

# SGLang 0.5.15.post1 (slime's pin) is read, never installed: tests/test_sglang_versions.py checks its source
# statically. Downloaded once into $VENV/tic-trace-wheels/ and checked against its sha256.
step "fetching SGLang 0.5.15.post1's wheel (slime's pin) to check its source statically, never installed"
"$py" -m tic_trace.testing.sglang_source

echo "$want" > "$stamp"
step "done: $VENV is ready"
