"""slime integration: ``--tic-trace``, default off; both sides of chosen rollouts traced and compared.

One switch on a slime command line (``--tic-trace``, or ``tic_trace: true`` in a ``--custom-config-path``
YAML) traces, for the chosen rollout ids and a few samples of each, the SGLang rollout forward passes and
the Megatron forward pass that scores the same samples, into ``{tic_trace_dir}/rollout_{id:05d}/sglang/``
and ``.../megatron/``; ``tic-trace slime-report DIR --rollout-id N`` (``tic_trace.tools.slime_report``)
finds the first operator where they diverge. See ``docs/slime.md``.

Everything goes through slime's documented extension points (checked by running slime 624b824a8's own code,
tests/test_slime_real.py); slime v0.3.1 or newer (:mod:`.version`):

* :func:`add_arguments` -- ``parse_args(add_custom_arguments=add_arguments)``; :func:`configure` -- on the
  parsed ``args`` (:mod:`.config`);
* :func:`megatron_init`, :func:`before_log_prob_hook`, :func:`before_train_step_hook` -- slime's three
  Megatron hook arguments (:mod:`.megatron_hooks`);
* :func:`generate` -- ``--custom-generate-function-path`` (:mod:`.rollout_hooks`);
* ``python -m tic_trace.integrations.slime.train`` -- slime's ``train.py`` with the flag family added.

Which samples: those of a traced rollout whose ``sample.index`` modulo the rollout's nominal size
(``rollout_batch_size * n_samples_per_prompt``) is below ``--tic-trace-max-samples``; a pure function of
the sample index, so both sides select the same samples without talking to each other.

Importing this package imports no framework and no adapter: off means off.
"""
__all__ = [
    "CHAINED_ATTR", "DEFAULT_MAX_SAMPLES", "DEFAULT_MODE", "DEFAULT_ROLLOUT_IDS", "HOOK_PATHS", "MODES", "SERVER_ARGS",
    "add_arguments", "configure", "enabled", "normalize", "rollout_dir", "sample_key", "samples_per_rollout",
    "selected", "before_log_prob_hook", "before_train_step_hook", "install_megatron_patches", "megatron_init",
    "POST_MODULES", "current_rollout_id", "generate", "install_rid_injection", "request_rid",
]

from tic_trace.integrations.slime.config import (
    CHAINED_ATTR, DEFAULT_MAX_SAMPLES, DEFAULT_MODE, DEFAULT_ROLLOUT_IDS, HOOK_PATHS, MODES, SERVER_ARGS,
    add_arguments, configure, enabled, normalize, rollout_dir, sample_key, samples_per_rollout, selected,
)
from tic_trace.integrations.slime.megatron_hooks import (
    before_log_prob_hook, before_train_step_hook, install_megatron_patches, megatron_init,
)
from tic_trace.integrations.slime.rollout_hooks import (
    POST_MODULES, current_rollout_id, generate, install_rid_injection, request_rid,
)
