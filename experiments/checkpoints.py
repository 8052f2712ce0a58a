"""Orbax checkpoints of a model, its optimizer and the run's history.

A checkpoint stores the NNX state of model and optimizer (arrays) and a JSON
record: the step, the loss history, the training time (``timing``: the wall
seconds of the steps trained towards it and how many steps those were, so a
rerun that trains nothing more still reports the throughput measured when it
trained) and a fingerprint of the settings that shape the run
(``seq2seq._fingerprint``: the config less what may change on resume).
Restoring with different settings is refused with a message rather than
silently loading weights of another model.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

from flax import nnx
import orbax.checkpoint as ocp


class Restored(NamedTuple):
  """What ``Checkpointer.restore_run`` read.

  Attributes:
    step: the step the checkpoint holds (0: nothing to resume).
    history: the loss history ``[[step, loss], ...]``.
    timing: ``{"seconds", "steps"}``: wall seconds of training and the
      number of steps they timed; None for a checkpoint written before
      timings were kept, or nothing to resume.
  """
  step: int
  history: list
  timing: dict | None


class Checkpointer:
  """Saves and restores ``(model, optimizer, meta)`` under ``directory``."""

  def __init__(self, directory: str, fingerprint: dict[str, Any],
               max_to_keep: int = 2):
    self.fingerprint = fingerprint
    self._last_saved = None
    self.manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             create=True))

  def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer,
           history: list, timing: dict | None = None) -> None:
    """Saves ``step`` (asynchronously); a step already saved is skipped.

    ``timing`` (``{"seconds", "steps"}``, see ``Restored``) is kept in the
    record for the run that resumes it.
    """
    if step in (self._last_saved, self.manager.latest_step()):
      return
    meta = {"step": step, "history": history, "fingerprint": self.fingerprint}
    if timing is not None:  # before the step counts as saved
      meta["timing"] = _checked_timing(timing)
    self._last_saved = step
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True)

  def restore(self, model: nnx.Module,
              optimizer: nnx.Optimizer) -> tuple[int, list]:
    """Loads the latest checkpoint into model and optimizer, if there is one.

    Returns:
      ``(step, history)``; ``(0, [])`` when there is nothing to resume.

    Raises:
      ValueError: the checkpoint was written by a run with other flags.
    """
    return tuple(self.restore_run(model, optimizer)[:2])

  def restore_run(self, model: nnx.Module,
                  optimizer: nnx.Optimizer) -> Restored:
    """``restore``, with the training time the checkpoint recorded.

    Raises:
      ValueError: the checkpoint was written by a run with other flags, or
        cannot be read (its timing record malformed included).
    """
    step = self.manager.latest_step()
    if step is None:
      return Restored(0, [], None)
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
      if not isinstance(meta, dict) or "fingerprint" not in meta:
        raise ValueError(f"no run record in it: {meta!r:.200}")
      timing = meta.get("timing")
      if timing is not None:
        timing = _checked_timing(timing)
    except Exception as e:  # noqa: BLE001 - any failure means unreadable
      raise self._unreadable(step, e) from e
    if meta["fingerprint"] != self.fingerprint:
      diff = {k: (meta["fingerprint"].get(k), v)
              for k, v in self.fingerprint.items()
              if meta["fingerprint"].get(k) != v}
      raise ValueError(
          f"The checkpoint in {self.manager.directory} was written with other "
          f"settings (saved, now): {diff}. Use another --workdir, or the same "
          "flags to resume.")
    abstract = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:  # noqa: BLE001 - any failure means unreadable
      raise self._unreadable(step, e) from e
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    return Restored(meta["step"], meta["history"], timing)

  def _unreadable(self, step: int, error: Exception) -> ValueError:
    path = os.path.join(str(self.manager.directory), str(step))
    return ValueError(
        f"The checkpoint {path} cannot be read ({type(error).__name__}: "
        f"{str(error)[:300]}). It was not loaded and nothing was "
        "overwritten: delete that step's directory to resume from an "
        "earlier one, or use another --workdir.")

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def _checked_timing(timing: Any) -> dict:
  """``timing`` as ``{"seconds": float, "steps": int}``, or ValueError.

  A throughput read back from a record of the wrong shape would be reported
  as measured, so anything but positive finite seconds over at least one
  step is refused.
  """
  ok = (isinstance(timing, dict) and set(timing) == {"seconds", "steps"}
        and isinstance(timing["steps"], int)
        and not isinstance(timing["steps"], bool) and timing["steps"] >= 1
        and isinstance(timing["seconds"], (int, float))
        and math.isfinite(timing["seconds"]) and timing["seconds"] > 0)
  if not ok:
    raise ValueError(
        "timing must be {'seconds': positive finite float, 'steps': int >= 1}"
        f" (the training time the checkpoint records), got {timing!r:.200}")
  return {"seconds": float(timing["seconds"]), "steps": timing["steps"]}


def flatten(tree: dict, prefix: str = "") -> dict:
  """``{"train": {"steps": 3}}`` -> ``{"train.steps": 3}`` (fingerprints)."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat
