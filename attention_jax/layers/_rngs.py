"""Dropout plumbing shared by the modules, in the style of ``nnx.Dropout``.

A module with ``dropout_rate > 0`` draws its dropout keys from the ``dropout``
stream of its ``rngs``, falling back to the ``default`` one (``nnx.Rngs(0)``);
a per-call ``rngs=`` (an ``nnx.Rngs``, an ``nnx.RngStream`` or a key)
overrides it for that call.
"""

from __future__ import annotations

from flax import nnx
import jax

_EXAMPLE = "nnx.Rngs(params=0, dropout=1)"


def _stream_name(rngs: nnx.Rngs) -> str | None:
  """``'dropout'`` if ``rngs`` has it, else ``'default'`` if it has it."""
  for name in ("dropout", "default"):
    if name in rngs:
      return name
  return None


def _streams(rngs: nnx.Rngs) -> str:
  """The stream names in ``rngs``, for error messages."""
  return ", ".join(repr(name) for name in rngs) or "none"


def dropout_stream(rngs: nnx.Rngs | None, rate: float):
  """The module's own dropout stream (forked), or ``None`` if unused.

  Args:
    rngs: the constructor's ``nnx.Rngs``; its ``dropout`` stream, else its
      ``default`` one, is forked. ``None`` leaves the module without a stream
      (calls in training mode must then pass ``rngs=``).
    rate: the module's ``dropout_rate``; ``0.0`` needs no stream.

  Returns:
    An ``nnx.RngStream``, or ``nnx.data(None)``.

  Raises:
    ValueError: ``rate > 0`` and ``rngs`` has neither a ``dropout`` nor a
      ``default`` stream.
    TypeError: ``rngs`` is not an ``nnx.Rngs``.
  """
  if rate == 0.0 or rngs is None:
    return nnx.data(None)
  if not isinstance(rngs, nnx.Rngs):
    raise TypeError(f"rngs must be an nnx.Rngs (e.g. {_EXAMPLE}), got "
                    f"{type(rngs).__name__}.")
  name = _stream_name(rngs)
  if name is None:
    raise ValueError(
        f"dropout_rate={rate} needs a 'dropout' or 'default' stream in rngs: "
        f"{_EXAMPLE} (rngs has {_streams(rngs)}); or pass dropout_rate=0.0.")
  return rngs[name].fork()


def dropout_key(call_rngs, own_stream) -> jax.Array:
  """A dropout key from the call's rngs if given, else the module's stream.

  Args:
    call_rngs: the call's ``rngs=``: an ``nnx.Rngs`` (its ``dropout``, else
      ``default``, stream), an ``nnx.RngStream``, a ``jax.random`` key, or
      ``None``.
    own_stream: the module's stream from ``dropout_stream``, or ``None``.

  Returns:
    A ``jax.random`` key.

  Raises:
    ValueError: neither gives a key, or the call's ``nnx.Rngs`` has neither a
      ``dropout`` nor a ``default`` stream.
    TypeError: ``call_rngs`` is of another type.
  """
  source = call_rngs if call_rngs is not None else own_stream
  if source is None:
    raise ValueError(
        "Dropout is on (deterministic=False, dropout_rate > 0) but the module "
        "has no rngs: pass rngs=nnx.Rngs(dropout=...) to the constructor or "
        "to the call, or call with deterministic=True.")
  if isinstance(source, nnx.Rngs):
    name = _stream_name(source)
    if name is None:
      raise ValueError(
          "Dropout is on (deterministic=False, dropout_rate > 0) and needs a "
          "'dropout' or 'default' stream in the call's rngs, which has "
          f"{_streams(source)}: pass rngs=nnx.Rngs(dropout=...) or a "
          "jax.random key, or call with deterministic=True.")
    return source[name]()
  if isinstance(source, nnx.RngStream):
    return source()
  if isinstance(source, jax.Array):
    return source
  raise TypeError("rngs must be an nnx.Rngs, nnx.RngStream or a jax.random "
                  f"key, got {type(source).__name__}.")
