"""Launches an attention_jax experiment: ``python run.py [--flags]``.

With no flags: the copy task, a GRU encoder-decoder without attention
(``none``) against one with Bahdanau attention, the same step budget each;
69 s (108 s of CPU) on a lightly loaded 2-core VM, 2.5-10 minutes (230-263 s
of CPU) on 2 AMD EPYC cores shared with other jobs (docs/experiments.md).
``--experiment=logit_scale`` measures the 1/sqrt(d_k)
logit scale instead; ``--experiment=lm`` trains a character-level causal
language model on Python's help topics and generates with the KV cache;
``--experiment=dates`` translates dates written out by Babel in 8 locales
into ISO (and ISO into Vietnamese), with the copy task's models;
``--experiment=serve`` serves text requests with the LM by continuous
batching over a paged KV cache, against static padded batches;
``--experiment=sparse`` trains the LM at a long context with MoBA, NSA and
DeepSeek's sparse attention against dense attention.

The flags are generated from the experiments' config dataclasses
(``experiments/config_flags.py``): names, defaults, help and bounds are
declared once, on the config fields. Flags become the chosen experiment's
config and its ``run(config)`` does the rest; nothing else reads flags. A
flag given that the chosen experiment does not read (``--steps`` with
``--experiment=lm``, whose budget is ``--lm_steps``) is refused.
"""

import sys

from absl import app
from absl import flags
from absl import logging

from experiments import config_flags
from experiments import dates
from experiments import lm
from experiments import logit_scale
from experiments import parallel
from experiments import seq2seq
from experiments import serve
from experiments import sparse_lm

# --experiment value -> (config dataclass, the function that runs it).
EXPERIMENTS = {
    "seq2seq": (seq2seq.Seq2SeqConfig, seq2seq.run),
    "logit_scale": (logit_scale.LogitScaleConfig, logit_scale.run),
    "lm": (lm.LMConfig, lm.run),
    "dates": (dates.DatesConfig, dates.run),
    "serve": (serve.ServeConfig, serve.run),
    "sparse": (sparse_lm.SparseConfig, sparse_lm.run),
}

_EXPERIMENT = flags.DEFINE_enum(
    "experiment", "seq2seq", list(EXPERIMENTS),
    "seq2seq: copy/reverse with and without attention (bottleneck, "
    "alignment). logit_scale: why attention divides by sqrt(d_k). lm: a "
    "causal character-level language model on Python's help topics. dates: "
    "dates in 8 languages to ISO and back to Vietnamese (real data, "
    "reordering, field alignment). serve: the LM serving requests by "
    "continuous batching over a paged KV cache, against static batches. "
    "sparse: the LM at a long context with trainable sparse attention "
    "(MoBA, NSA, DSA) against dense.")
config_flags.define_flags(
    [parallel.DistributedConfig, *(c for c, _ in EXPERIMENTS.values())],
    flags.FLAGS)
flags.adopt_module_key_flags(config_flags)  # --help lists them


def check_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Refuses, before anything runs, a flag given that --experiment ignores.

  Raises:
    app.UsageError: e.g. ``--steps`` (the copy task's budget) with
      ``--experiment=lm``, whose budget is ``--lm_steps``.
  """
  try:
    config_flags.check_flags_read(
        flag_values["experiment"].value,
        {name: config for name, (config, _) in EXPERIMENTS.items()},
        flag_values, shared=[parallel.DistributedConfig])
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  check_flags()
  logging.set_verbosity(logging.WARNING)  # hide JAX's backend probing
  parallel.initialize_distributed(
      config_flags.from_flags(parallel.DistributedConfig, flags.FLAGS))
  config_cls, run = EXPERIMENTS[_EXPERIMENT.value]
  try:
    run(config_flags.from_flags(config_cls, flags.FLAGS))
  except KeyboardInterrupt:
    print("Interrupted; checkpoints written so far are kept. Run the same "
          "command to resume from them.", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  app.run(main)
