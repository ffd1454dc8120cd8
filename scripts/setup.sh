#!/usr/bin/env bash
# Create/update the project's virtual environment with every pinned dependency. Idempotent and quick when
# nothing changed (a stamp of the requirement files is kept in the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TIC_TRACE_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.tic-trace-setup"
# pip warns about every local index location this machine lacks; keep real errors, drop that noise.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
want=$(cat requirements/*.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  pip=(quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" -c requirements/constraints.txt -r requirements/base.txt -r requirements/test.txt
  # SGLang's declared dependencies are many GB of CUDA wheels; its model code needs only these.
  "${pip[@]}" --no-deps sglang==0.5.23
  if [ -s requirements/sglang-light.txt ]; then
    "${pip[@]}" -c requirements/constraints.txt -r requirements/sglang-light.txt
  fi
  "${pip[@]}" --no-deps -e .
  echo "$want" > "$stamp"
fi
# SGLang 0.5.15.post1 (slime's pin) is read, never installed: tests/test_sglang_versions.py checks its source
# statically. Downloaded once into $VENV/tic-trace-wheels/ and checked against its sha256; a no-op after that.
"$VENV/bin/python" -m tic_trace.testing.sglang_source
