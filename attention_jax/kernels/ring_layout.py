"""How ring attention lays a sequence over the devices of a ring.

Shape glossary: T the global query length (S the global key length), P
devices on the ring axis, C the chunk length; ``...`` leading dims.

``"contiguous"``: device ``i`` holds rows ``[i*T/P, (i+1)*T/P)``, one chunk.
With a causal mask device 0 then sees one block of keys and device
``P - 1`` sees ``P``: every ring step waits for the slowest.

``"zigzag"`` (load balanced): the sequence is cut into ``2P`` chunks of
``C = T / (2P)`` rows and device ``i`` holds chunks ``i`` and
``2P - 1 - i``, in that order (its local rows are chunk ``i``, then chunk
``2P - 1 - i``); keys the same way. Each device then holds one early and
one late chunk, and every device does the same causal work at every ring
step.

``aj.ring_attention`` runs on one device's shard, so its caller permutes
what is laid out over tokens once, before the model: tokens ``[..., T,
H]`` with ``zigzag(x, P)``, positions, segment ids and labels ``[B, T]``
with ``zigzag(x, P, axis=-1)``; ``unzigzag`` restores the order of
outputs (``aj.SequenceParallel`` permutes the whole arrays itself unless
told they are permuted). Both are chunk slices, a reversal and a stack,
so XLA moves chunks between the devices of a sharded axis rather than
gathering it. The *mask* still speaks of global positions: causality,
windows, lengths, rules and score modifiers see where a token stands in
the whole sequence, whatever device holds it. Dense masks and biases are
arrays over tokens like the tokens: their rows and columns are in the
layout's order.

Pure NumPy / ``jax.numpy``: no kernel imports.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> None:
  """A ValueError naming the choices unless ``layout`` is one of them."""
  if not isinstance(layout, str) or layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")


def num_chunks(layout: str) -> int:
  """Chunks per device: 1 (contiguous) or 2 (zigzag)."""
  check_layout(layout)
  return 2 if layout == "zigzag" else 1


def chunk_indices(layout: str, device, devices: int) -> tuple:
  """The global chunk indices device ``device`` holds, in local order
  (``device`` may be traced: ``lax.axis_index``)."""
  if num_chunks(layout) == 1:
    return (device,)
  return (device, 2 * devices - 1 - device)


def chunk_starts(layout: str, device, devices: int, chunk: int) -> tuple:
  """The global start (row index) of each chunk of ``chunk`` rows that
  ``device`` holds, in local order."""
  return tuple(c * chunk for c in chunk_indices(layout, device, devices))


def local_length(layout: str, length, device, devices: int, chunk: int):
  """A global length's share on ``device``: its valid rows.

  Each local chunk keeps ``clip(length - start, 0, chunk)`` rows. Under
  zigzag, when the late chunk ``2P - 1 - i`` holds any valid row the early
  chunk ``i`` is full, so the valid rows are still a prefix of the local
  rows (what a kernel's lengths count).
  """
  return sum(jnp.clip(length - start, 0, chunk)
             for start in chunk_starts(layout, device, devices, chunk))


def zigzag_indices(length: int, devices: int) -> np.ndarray:
  """``perm`` (int ``[length]``) such that ``x[perm]`` is the zigzag order.

  Raises:
    ValueError: ``length`` is not a multiple of ``2 * devices``.
  """
  chunk = _chunk(length, devices)
  order = [c for i in range(devices) for c in (i, 2 * devices - 1 - i)]
  return (np.asarray(order)[:, None] * chunk
          + np.arange(chunk)[None, :]).reshape(-1)


def _chunk(length: int, devices: int) -> int:
  """The zigzag chunk, ``length / (2 * devices)`` (a ValueError unless it
  divides)."""
  for name, value in (("length", length), ("devices", devices)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
        or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if length % (2 * devices):
    raise ValueError(
        f"length={length} is not a multiple of 2 * devices = {2 * devices} "
        f"(devices={devices}): the zigzag layout cuts the sequence into 2 * "
        "devices chunks of equal length; pad the sequence to a multiple.")
  return length // (2 * devices)


def _axis(x, axis: int) -> int:
  ndim = np.ndim(x)
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis={axis} is out of range for an array of shape "
                     f"{np.shape(x)}.")
  return axis % ndim


def zigzag(x, devices: int, axis: int = -2) -> jax.Array:
  """``x`` with ``axis`` in the zigzag order (tokens ``[..., T, H]``:
  ``axis=-2``; positions, segment ids, labels ``[B, T]``: ``axis=-1``).

  Written as chunk slices, a reversal and a stack rather than a gather:
  on an array sharded along ``axis`` XLA then moves chunks between
  devices (collective permutes) instead of gathering the whole axis.
  """
  x = jnp.asarray(x)
  axis = _axis(x, axis)
  chunk = _chunk(x.shape[axis], devices)
  chunks = x.reshape(x.shape[:axis] + (2 * devices, chunk)
                     + x.shape[axis + 1:])
  early = jax.lax.slice_in_dim(chunks, 0, devices, axis=axis)
  late = jnp.flip(jax.lax.slice_in_dim(chunks, devices, 2 * devices,
                                       axis=axis), axis)
  return jnp.stack([early, late], axis + 1).reshape(x.shape)


def unzigzag(x, devices: int, axis: int = -2) -> jax.Array:
  """The inverse of ``zigzag``: ``axis`` back in the sequence's order."""
  x = jnp.asarray(x)
  axis = _axis(x, axis)
  chunk = _chunk(x.shape[axis], devices)
  pairs = x.reshape(x.shape[:axis] + (devices, 2, chunk)
                    + x.shape[axis + 1:])
  early = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
  late = jnp.flip(jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False),
                  axis)
  return jnp.concatenate([early, late], axis).reshape(x.shape)
