"""Orbax checkpoints of a model, its optimizer and the run's history.

A checkpoint stores the NNX state of model and optimizer (arrays) and a JSON
record: the step, the loss history and a fingerprint of the settings that
shape the run (``seq2seq._fingerprint``: the config less what may change on
resume). Restoring with different settings is refused with a message rather
than silently loading weights of another model.
"""

from __future__ import annotations

import os
from typing import Any

from flax import nnx
import orbax.checkpoint as ocp


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
           history: list) -> None:
    """Saves ``step`` (asynchronously); a step already saved is skipped."""
    if step in (self._last_saved, self.manager.latest_step()):
      return
    self._last_saved = step
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    meta = {"step": step, "history": history, "fingerprint": self.fingerprint}
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
    step = self.manager.latest_step()
    if step is None:
      return 0, []
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
      if not isinstance(meta, dict) or "fingerprint" not in meta:
        raise ValueError(f"no run record in it: {meta!r:.200}")
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
    return meta["step"], meta["history"]

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


def flatten(tree: dict, prefix: str = "") -> dict:
  """``{"train": {"steps": 3}}`` -> ``{"train.steps": 3}`` (fingerprints)."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat
