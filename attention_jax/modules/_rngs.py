"""Dropout plumbing shared by the modules, in the style of ``nnx.Dropout``."""

from __future__ import annotations

from flax import nnx
import jax


def dropout_stream(rngs: nnx.Rngs | None, rate: float):
  """The module's own ``dropout`` stream (forked), or ``None`` if unused."""
  if rate == 0.0 or rngs is None:
    return nnx.data(None)
  return rngs["dropout"].fork()


def dropout_key(call_rngs, own_stream) -> jax.Array:
  """A dropout key from the call's rngs if given, else the module's stream."""
  source = call_rngs if call_rngs is not None else own_stream
  if source is None:
    raise ValueError(
        "Dropout is on (deterministic=False, dropout_rate > 0) but the module "
        "has no rngs: pass rngs=nnx.Rngs(dropout=...) to the constructor or "
        "to the call, or call with deterministic=True.")
  if isinstance(source, nnx.Rngs):
    return source["dropout"]()
  if isinstance(source, nnx.RngStream):
    return source()
  if isinstance(source, jax.Array):
    return source
  raise TypeError("rngs must be an nnx.Rngs, nnx.RngStream or a jax.random "
                  f"key, got {type(source).__name__}.")
