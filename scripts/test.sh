#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${TIC_TRACE_VENV:-.venv}/bin/python" -m pytest -q "$@"
