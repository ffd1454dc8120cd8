#!/usr/bin/env bash
# The slime-stack lane: a named subset of the tests on slime's own stack (docs/testing.md, "The slime-stack
# lane"): torch 2.11.0, transformers 5.12.1 and SGLang 0.5.15.post1's model code (requirements/slime-image.txt),
# megatron-core from the vendored Megatron-LM 1dcf0daf source (on PYTHONPATH, as slime's image has it), and
# tic-trace installed without extras. Its own environment, .venv-slime ($TIC_TRACE_SLIME_VENV), set up on the
# first run and whenever a file it installs from changes. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TIC_TRACE_SLIME_VENV:-.venv-slime}"
PY="${PYTHON:-python3}"
py="$VENV/bin/python"
stamp="$VENV/.tic-trace-slime-stack"
inputs=(requirements/slime-image.txt requirements/slime-stack.txt requirements/sglang-light.txt
        requirements/hf.txt requirements/test.txt pyproject.toml scripts/test-slime-stack.sh)
step() { echo "slime-stack: $*"; }
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pip=(quiet "$py" -m pip install -q --disable-pip-version-check -c requirements/slime-image.txt
     -c requirements/slime-stack.txt)

# Megatron-LM as slime's image has it: the source tree at the commit slime's Dockerfile pins (the same tree
# tests/test_slime_real.py runs; $TIC_TRACE_MEGATRON_LM_DIR / $TIC_TRACE_VENDOR_DIR name another).
megatron_lm() {
  "$py" -c 'from tic_trace.testing import slime_vendor as v; print(v.vendored_paths()[0])'
}

want=$(cat "${inputs[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  [ -x "$py" ] || { step "creating $VENV ($("$PY" --version 2>&1))"; "$PY" -m venv "$VENV"; }
  step "installing slime's stack (torch 2.11.0 and its CUDA libraries: several GB on the first run)"
  # SGLang goes in --no-deps, last; out of the way while pip resolves (setup.sh says why).
  if "$py" -c 'import sglang' 2>/dev/null; then quiet "$py" -m pip uninstall -q -y sglang; fi
  runner=$(grep -E '^(pytest|hypothesis|six)==' requirements/test.txt)
  # shellcheck disable=SC2086 # one requirement per word
  "${pip[@]}" -r requirements/sglang-light.txt -r requirements/hf.txt $runner
  step "installing tic-trace without extras (its declared dependencies, resolved against slime's pins)"
  "${pip[@]}" -e .
  step "installing SGLang's model code ($(grep '^sglang==' requirements/slime-image.txt)) without its serving dependencies"
  "${pip[@]}" --no-deps "$(grep '^sglang==' requirements/slime-image.txt)"
  step "checking the versions and that SGLang 0.5.15.post1's model code imports with the light packages"
  PYTHONPATH="$(megatron_lm)" "$py" - <<'EOF'
import sys
from importlib.metadata import version
import megatron.core
want = {"torch": "2.11.0", "transformers": "5.12.1", "sglang": "0.5.15.post1"}
got = {k: version(k) for k in want}
got["megatron.core"] = megatron.core.__version__
want["megatron.core"] = "0.16.0rc0"
bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
if bad or "site-packages" in megatron.core.__file__:
    sys.exit(f"slime-stack: not slime's stack: {bad} (got, want); megatron.core from {megatron.core.__file__}")
EOF
  "$py" -m tic_trace.testing.sglang_light_check
  echo "$want" > "$stamp"
fi

# The named subset (docs/testing.md lists what each covers and what is left to the default lane).
tests=(
  tests/test_tracer.py                    # traced forwards bitwise equal; the HF adapter's points (transformers 5.12.1)
  tests/test_megatron_adapter.py          # HF vs megatron-core (Megatron-LM 1dcf0daf) at every point, faults, TP/PP/CP
  tests/test_finder.py                    # the finder: planted faults, clean pairs, workers, CLI
  tests/test_sglang_adapter.py            # SGLang 0.5.15.post1's model code vs Megatron and HF, faults, TP=2 merges
  tests/test_slime.py                     # the slime flag family, hooks and slime-report
  "tests/test_slime_real.py::test_real_parse_args_flag_family"                      # slime 624b824a8's own parse_args
  "tests/test_slime_real.py::test_real_train_step0_when_log_prob_pass_is_skipped"   # slime's train actor on Megatron-LM
  # slime's generate over HTTP into SGLang 0.5.15.post1 and its log-prob pass on Megatron-LM, then slime-report
  "tests/test_slime_real.py::test_real_flow_tags_requests_and_traces_the_log_prob_pass"
  "tests/test_slime_real.py::test_real_flow_chains_the_users_hooks"
  "tests/test_slime_real.py::test_real_flow_slime_report"
  # slime's metric reconciled: the used log-probs recorded on slime's own flow, SGLang 0.5.15.post1's sampler's
  # semantics, the split, and routing replay (R3) through slime's code into Megatron-LM's RouterReplay
  tests/test_slime_logprobs.py
  tests/test_logprob_semantics.py
  tests/test_reconcile.py
  tests/test_routing_replay.py
)
# Ray is no part of slime's image as the lane installs it (the default lane runs this test).
deselect=(--deselect tests/test_finder.py::test_workers_as_ray_tasks_give_the_same_report)
PYTHONPATH="$(megatron_lm)${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -q -p no:cacheprovider \
  "${deselect[@]}" "${tests[@]}" "$@"
