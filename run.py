"""Launches an attention_jax experiment: ``python run.py --experiment=...``.

Flags become a config dataclass; the experiment's ``run(config)`` does the
rest. Nothing else reads flags.
"""

from absl import app
from absl import flags
from absl import logging

from experiments import scaling

_EXPERIMENT = flags.DEFINE_enum(
    "experiment", "scaling", ["scaling"],
    "scaling: how the 1/sqrt(d_k) scale keeps the softmax from saturating.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where results go (default: runs/<experiment>).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_DIMS = flags.DEFINE_list(
    "dims", ["4", "8", "16", "32", "64", "128", "256", "512", "1024"],
    "scaling: head dims d_k to measure.")
_NUM_KEYS = flags.DEFINE_integer("num_keys", 64, "scaling: keys per query.",
                                 lower_bound=2)
_NUM_QUERIES = flags.DEFINE_integer(
    "num_queries", 512, "scaling: random queries averaged over.",
    lower_bound=1)

flags.register_validator(
    "dims", lambda dims: all(d.isdigit() and int(d) > 0 for d in dims),
    message="--dims must be a comma-separated list of positive integers.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # hide JAX's backend probing
  workdir = _WORKDIR.value or f"runs/{_EXPERIMENT.value}"
  config = scaling.ScalingConfig(
      workdir=workdir, dims=tuple(int(d) for d in _DIMS.value),
      num_queries=_NUM_QUERIES.value, num_keys=_NUM_KEYS.value,
      seed=_SEED.value)
  scaling.run(config)


if __name__ == "__main__":
  app.run(main)
