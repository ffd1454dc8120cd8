#!/usr/bin/env bash
# Set up (first run only) and run the demo on built-in tiny models. Extra arguments go to `tic-trace demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${TIC_TRACE_VENV:-.venv}/bin/tic-trace" demo "$@"
