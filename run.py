"""Launches an attention_jax experiment: ``python run.py [--flags]``.

With no flags: the copy task, a GRU encoder-decoder without attention
(``none``) against one with Bahdanau attention, the same step budget each;
about 3 minutes on 2 CPU cores. ``--experiment=scaling`` measures the
1/sqrt(d_k) scale instead. Flags become a config dataclass and the
experiment's ``run(config)`` does the rest; nothing else reads flags.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from experiments import data
from experiments import parallel
from experiments import scaling
from experiments import seq2seq
from experiments import training

_EXPERIMENT = flags.DEFINE_enum(
    "experiment", "seq2seq", ["seq2seq", "scaling"],
    "seq2seq: copy/reverse with and without attention (bottleneck, "
    "alignment). scaling: why attention divides by sqrt(d_k).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where results and checkpoints go (default: "
    "runs/<experiment>). Rerunning with the same flags resumes.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for data and parameters.")
_MESH = flags.DEFINE_string(
    "mesh", "", "Device mesh for seq2seq training, e.g. 'data:2,model:4' "
    "(batch split over data; Transformer heads and FFN over model; -1 = the "
    "remaining devices). Default: all devices on data.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-host: call jax.distributed.initialize() "
    "first (also done when JAX_COORDINATOR_ADDRESS is set). Without the "
    "three flags below JAX reads the cluster from its environment (TPU pod, "
    "SLURM, Open MPI).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-host: number of processes.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index.", lower_bound=0)

# seq2seq
_TASK = flags.DEFINE_enum("task", "copy", list(data.TASKS), "The task.")
_MODELS = flags.DEFINE_list(
    "models", ["none", "bahdanau"],
    f"Models to train, comma-separated, from {list(seq2seq.MODELS)}.")
_ENCODER = flags.DEFINE_enum("encoder", "forward",
                             ["forward", "bidirectional"],
                             "GRU encoder direction.")
_LUONG_SCORE = flags.DEFINE_enum("luong_score", "general",
                                 ["dot", "general", "concat"],
                                 "Score of the luong model.")
_STEPS = flags.DEFINE_integer("steps", 1000, "Training steps per model.",
                              lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.",
                                   lower_bound=1)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 3e-3, "Peak Adam learning rate (cosine decay to 10%).",
    lower_bound=1e-8)
_MIN_LEN = flags.DEFINE_integer("min_len", 5, "Shortest training source.",
                                lower_bound=1)
_MAX_LEN = flags.DEFINE_integer("max_len", 30, "Longest training source.",
                                lower_bound=1)
_EVAL_LENGTHS = flags.DEFINE_list(
    "eval_lengths", ["5", "10", "15", "20", "25", "30", "35", "40"],
    "Source lengths to evaluate (longer than --max_len tests extrapolation).")
_EVAL_EXAMPLES = flags.DEFINE_integer("eval_examples", 128,
                                      "Examples per evaluation length.",
                                      lower_bound=1)
_HEATMAP_LENGTHS = flags.DEFINE_list(
    "heatmap_lengths", ["10", "30"], "Lengths to draw attention maps for.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 20, "Content tokens.",
                                   lower_bound=2)
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 500, "Steps between checkpoints (0: at the end only).",
    lower_bound=0)
_LOG_EVERY = flags.DEFINE_integer("log_every", 50,
                                  "Steps between logged losses.",
                                  lower_bound=1)

# scaling
_DIMS = flags.DEFINE_list(
    "dims", ["4", "8", "16", "32", "64", "128", "256", "512", "1024"],
    "scaling: head dims d_k to measure.")
_NUM_KEYS = flags.DEFINE_integer("num_keys", 64, "scaling: keys per query.",
                                 lower_bound=2)
_NUM_QUERIES = flags.DEFINE_integer(
    "num_queries", 512, "scaling: random queries averaged over.",
    lower_bound=1)
_SCALING_TRAIN_STEPS = flags.DEFINE_integer(
    "scaling_train_steps", 300,
    "scaling: steps per model of the scaled-vs-unscaled training run "
    "(0 skips it).", lower_bound=0)


def _positive_ints(values) -> bool:
  return all(v.strip().isdigit() and int(v) > 0 for v in values)


for _name in ("dims", "eval_lengths", "heatmap_lengths"):
  flags.register_validator(
      _name, _positive_ints,
      message=f"--{_name} must be a comma-separated list of positive "
      "integers.")
flags.register_validator(
    "models", lambda ms: bool(ms) and all(m in seq2seq.MODELS for m in ms),
    message=f"--models must be a non-empty list from {list(seq2seq.MODELS)}.")
flags.register_multi_flags_validator(
    ["min_len", "max_len"], lambda f: f["min_len"] <= f["max_len"],
    message="--min_len must not exceed --max_len.")


def _ints(values) -> tuple[int, ...]:
  return tuple(int(v) for v in values)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # hide JAX's backend probing
  if _DISTRIBUTED.value or os.environ.get("JAX_COORDINATOR_ADDRESS"):
    parallel.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                                    _PROCESS_ID.value)
  workdir = _WORKDIR.value or f"runs/{_EXPERIMENT.value}"
  if _EXPERIMENT.value == "scaling":
    scaling.run(scaling.ScalingConfig(
        workdir=workdir, dims=_ints(_DIMS.value),
        num_queries=_NUM_QUERIES.value, num_keys=_NUM_KEYS.value,
        seed=_SEED.value, train_steps=_SCALING_TRAIN_STEPS.value))
    return
  train = training.TrainConfig(
      task=_TASK.value, steps=_STEPS.value, batch_size=_BATCH_SIZE.value,
      learning_rate=_LEARNING_RATE.value, min_len=_MIN_LEN.value,
      max_len=_MAX_LEN.value, vocab_size=_VOCAB_SIZE.value, seed=_SEED.value,
      checkpoint_every=_CHECKPOINT_EVERY.value, log_every=_LOG_EVERY.value,
      mesh=_MESH.value)
  try:
    seq2seq.run(seq2seq.Seq2SeqConfig(
        workdir=workdir, models=tuple(_MODELS.value), encoder=_ENCODER.value,
        luong_score=_LUONG_SCORE.value, train=train,
        eval_lengths=_ints(_EVAL_LENGTHS.value),
        eval_examples=_EVAL_EXAMPLES.value,
        heatmap_lengths=_ints(_HEATMAP_LENGTHS.value)))
  except KeyboardInterrupt:
    print("Interrupted; the last checkpoint is saved. Run the same command "
          "to resume.", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  app.run(main)
