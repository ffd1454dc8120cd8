#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite. Extra arguments go to pytest, except
#   --code-path avx2   every CPU kernel family on its AVX2 code path (ATen's vector kernels, MKL's GEMMs,
#                      oneDNN's bf16 kernels): the roundings another machine's CPU gives (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --code-path)
      case "${2:-}" in
        avx2) export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
        default) ;;
        *) echo "test.sh: --code-path takes avx2 or default, not '${2:-}'" >&2; exit 2 ;;
      esac
      shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
./scripts/setup.sh
# A test that ends pytest's own process (not a failure: the process is gone) is named here (tests/conftest.py).
export TIC_TRACE_TEST_RUNNING_FILE="${TMPDIR:-/tmp}/tic-trace-test-running.$$"
rc=0
"${TIC_TRACE_VENV:-.venv}/bin/python" -m pytest -q ${args[@]+"${args[@]}"} || rc=$?
if [ -s "$TIC_TRACE_TEST_RUNNING_FILE" ]; then
  echo "test.sh: pytest's process ended (exit $rc) inside $(cat "$TIC_TRACE_TEST_RUNNING_FILE"), before its summary" >&2
  rm -f "$TIC_TRACE_TEST_RUNNING_FILE"
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
