"""Training one model (the copy/reverse task unless told otherwise): jitted
step, checkpoints, the throughput.

The wall time of the steps trained is kept in every checkpoint, so a rerun
that restores a finished training reports the steps/s measured when it
trained (labelled as restored), not a throughput of zero steps.

The data of step ``s`` is a pure function of ``(seed, s)`` and the model has
no dropout, so a run that is killed and resumed from its last checkpoint ends
with exactly the numbers of an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import signal
import threading
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import checkpoints
from experiments import config_flags
from experiments import data
from experiments import parallel
from experiments import progress


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How one model is trained; each field is also a ``run.py`` flag."""
  task: str = config_flags.field("copy", "The task.", choices=data.TASKS)
  steps: int = config_flags.field(1000, "Training steps per model.",
                                  lower_bound=1)
  batch_size: int = config_flags.field(64, "Batch size.", lower_bound=1)
  learning_rate: float = config_flags.field(
      3e-3, "Peak Adam learning rate (cosine decay to 10%).",
      lower_bound=1e-8)
  min_len: int = config_flags.field(5, "Shortest training source.",
                                    lower_bound=1, not_above="max_len")
  max_len: int = config_flags.field(30, "Longest training source.",
                                    lower_bound=1)
  vocab_size: int = config_flags.field(20, "Content tokens.", lower_bound=2)
  seed: int = config_flags.field(0, "Seed for data and parameters.")
  checkpoint_every: int = config_flags.field(
      500, "Steps between checkpoints (0: at the end only).", lower_bound=0)
  log_every: int = config_flags.field(50, "Steps between logged losses.",
                                      lower_bound=1)
  mesh: str = config_flags.field(
      "", "Device mesh for training, e.g. 'data:2,model:4' (batch "
      "split over data; Transformer heads and FFN over model; -1 = the "
      "remaining devices; --experiment=lm also splits sequences over seq "
      "and ring: 'data:2,seq:4'). Default: all devices on data.")


def make_optimizer(model: nnx.Module, config: TrainConfig) -> nnx.Optimizer:
  tx = _transform(config.learning_rate, config.steps)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


@functools.cache
def _transform(learning_rate: float, steps: int):
  """One optax transform per schedule: the optimizer holds it as static
  data, so a new one per model would retrace ``train_step`` for every
  model of the same structure (a resumed run, another variant)."""
  schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.1)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def loss_fn(model, src, src_len, tgt_in, tgt_out, tgt_mask):
  """Mean cross-entropy over the target tokens (EOS included, PAD not)."""
  logits, _ = model(src, src_len, tgt_in)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt_out)
  mask = tgt_mask.astype(ce.dtype)
  return jnp.sum(ce * mask) / jnp.sum(mask)


@nnx.jit
def train_step(model, optimizer, src, src_len, tgt_in, tgt_out, tgt_mask):
  loss, grads = nnx.value_and_grad(loss_fn)(model, src, src_len, tgt_in,
                                            tgt_out, tgt_mask)
  optimizer.update(model, grads)
  return loss


def batch_arrays(batch: data.Batch, mesh: jax.sharding.Mesh | None = None):
  """The batch as device arrays, split over the mesh's ``data`` axis."""
  arrays = (batch.src, batch.src_len, batch.tgt_in, batch.tgt_out,
            batch.tgt_mask)
  if mesh is None:
    return tuple(jnp.asarray(x) for x in arrays)
  return parallel.shard_batch(arrays, mesh)


def training_mesh(config: TrainConfig, *,
                  sequence: bool = False) -> jax.sharding.Mesh:
  """The mesh ``config.mesh`` asks for; checks the batch splits over it,
  and unless ``sequence`` (a model with sequence-parallel attention) that
  it does not split sequences."""
  mesh = parallel.build_mesh(parallel.parse_mesh(config.mesh))
  parallel.check_batch(config.batch_size, mesh)
  if not sequence:
    parallel.check_no_sequence_axes(mesh, "this experiment")
  return mesh


def train(name: str, model: nnx.Module, config: TrainConfig,
          checkpointer: checkpoints.Checkpointer | None,
          mesh: jax.sharding.Mesh | None = None, *,
          batches: Callable[[int], tuple[np.ndarray, ...]] | None = None,
          step_fn: Callable[..., jax.Array] | None = None) -> dict:
  """Trains ``model`` in place, resuming from ``checkpointer`` if it has one.

  With ``mesh`` (``training_mesh``; build the model under ``jax.set_mesh(mesh)``
  so its annotations apply), model and optimizer state are placed on it and
  every batch is split over ``data``; the loss curve equals the
  single-device one up to float summation order. Ctrl-C saves a checkpoint
  of the last finished step, then re-raises; so does SIGTERM.

  Another experiment brings its own data and loss: ``batches(step)`` gives
  the host arrays of a step (a pure function of the step, so a resumed run
  sees the same data) and ``step_fn(model, optimizer, *arrays)`` trains on
  them and returns the loss. The defaults are ``config.task``'s batches
  (``data.train_batch``) and ``train_step``.

  Returns:
    ``{"steps", "final_loss", "seconds", "steps_per_s", "timed_steps",
    "timing", "trained_steps", "resumed_from", "loss_curve": [[step, loss],
    ...]}``. ``steps_per_s`` is ``timed_steps / seconds``: over the steps
    this call trained, or, when it trained none (everything restored), the
    wall time the checkpoint recorded when it was trained; ``timing`` says
    which, in words. None (``seconds`` 0.0, ``timed_steps`` 0) only when a
    checkpoint written before timings were kept was restored whole.
  """
  if mesh is None:
    mesh = training_mesh(config)
  if batches is None:
    batches = functools.partial(_task_batch, config)
  with jax.set_mesh(mesh), _StopRequests() as stop:
    return _train(name, model, config, checkpointer, mesh, stop, batches,
                  step_fn or train_step)


def _task_batch(config: TrainConfig, step: int) -> tuple[np.ndarray, ...]:
  """The copy/reverse batch of ``step`` as ``train_step``'s arrays."""
  batch = data.train_batch(
      config.task, step, seed=config.seed, batch_size=config.batch_size,
      min_len=config.min_len, max_len=config.max_len,
      vocab_size=config.vocab_size)
  return (batch.src, batch.src_len, batch.tgt_in, batch.tgt_out,
          batch.tgt_mask)


class _StopRequests:
  """Ctrl-C and SIGTERM ask the loop to stop at the next step boundary.

  Raising KeyboardInterrupt from a signal handler can land inside orbax's
  checkpoint machinery and hang the save that follows, so the handler only
  records the signal; the loop then saves and raises KeyboardInterrupt
  itself. The first signal also restores the previous handlers, so a second
  one acts at once. Installs nothing outside the main thread.
  """

  def __init__(self):
    self.signum = None
    self._previous = {}

  def _handler(self, signum, frame):
    del frame
    self.signum = signum
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._previous[sig] = signal.signal(sig, self._handler)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    return False


class _Clock:
  """Wall time of the steps trained, for the report and the checkpoints.

  ``restored`` is the resumed checkpoint's record (``{"seconds", "steps"}``,
  or None); a checkpoint written here records it plus this run's steps, so
  a training interrupted and resumed keeps the time of all its runs.
  """

  def __init__(self, start: int, restored: dict | None):
    self.start, self.restored = start, restored
    self.t0 = time.perf_counter()

  def seconds(self) -> float:
    return time.perf_counter() - self.t0

  def record(self, step: int, seconds: float | None = None) -> dict | None:
    """What a checkpoint of ``step`` keeps (None: no step was timed)."""
    total = dict(self.restored or {"seconds": 0.0, "steps": 0})
    if step > self.start:
      total["seconds"] += self.seconds() if seconds is None else seconds
      total["steps"] += step - self.start
    return total if total["steps"] else None


def _train(name, model, config, checkpointer, mesh, stop, batches, step_fn):
  parallel.shard_state(model, mesh)
  optimizer = make_optimizer(model, config)
  parallel.shard_state(optimizer, mesh)
  start, history, restored = (checkpointer.restore_run(model, optimizer)
                              if checkpointer else (0, [], None))
  if start:
    print(f"[{name}] resuming from the checkpoint at step {start}")
  bar = progress.Progress(name, config.steps, start, every=config.log_every)
  step, loss, clock = start, None, _Clock(start, restored)
  try:
    while step < config.steps:
      arrays = parallel.shard_batch(batches(step), mesh)
      loss = step_fn(model, optimizer, *arrays)
      step += 1
      if step % config.log_every == 0 or step == config.steps:
        value = float(loss)
        history.append([step, value])
        bar.update(step, value)
      # The last step is saved after the loop, with the time the report
      # states, so a rerun restoring it reports the same throughput.
      if checkpointer and config.checkpoint_every and step < config.steps and (
          step % config.checkpoint_every == 0):
        checkpointer.save(step, model, optimizer, history, clock.record(step))
      if stop.signum is not None:
        raise KeyboardInterrupt(f"signal {stop.signum}")
  except KeyboardInterrupt:
    if checkpointer:
      print(f"\n[{name}] interrupted: saving step {step}")
      checkpointer.save(step, model, optimizer, history, clock.record(step))
      checkpointer.wait()
    raise
  seconds = clock.seconds()
  if checkpointer:
    if checkpointer.manager.latest_step() != step:
      checkpointer.save(step, model, optimizer, history,
                        clock.record(step, seconds))
    checkpointer.wait()
  return _stats(step, start, seconds, history, restored)


def _stats(step: int, start: int, seconds: float, history: list,
           restored: dict | None) -> dict:
  """``train``'s numbers. A run that trained nothing (all restored) must not
  time zero steps: it reports what the checkpoint measured when trained."""
  trained = step - start
  if trained:
    timed = {"seconds": seconds, "steps": trained}
    timing = f"measured in this run over steps {start}-{step}" + (
        f" (resumed at step {start}: earlier runs' steps not included)"
        if start else "")
  elif restored:
    timed = restored
    timing = (f"restored from the checkpoint of step {step}: measured when "
              f"its {restored['steps']} timed steps were trained; this run "
              "trained none")
  else:
    timed = {"seconds": 0.0, "steps": 0}
    timing = (f"not measured: this run trained no steps and the checkpoint "
              f"of step {step} was written before timings were kept")
  return {"steps": step,
          "final_loss": history[-1][1] if history else float("nan"),
          "seconds": timed["seconds"],
          "steps_per_s": (timed["steps"] / timed["seconds"]
                          if timed["steps"] and timed["seconds"] > 0
                          else None),
          "timed_steps": timed["steps"], "timing": timing,
          "trained_steps": trained, "resumed_from": start,
          "loss_curve": history}


def throughput_text(stats: dict) -> str:
  """``train``'s throughput with where it was measured, for a report."""
  if stats["steps_per_s"] is None:
    return f"steps/s {stats['timing']}"
  return f"{stats['steps_per_s']:.1f} steps/s, {stats['timing']}"
