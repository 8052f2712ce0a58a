"""Checks of traced values: made under ``jax.experimental.checkify``, free
otherwise.

A value known only while running (a ``dropout_rate`` computed inside
``jax.jit``, lengths read from a batch, a learned ``scale`` or ``sinks``)
cannot be checked while tracing, and raising from inside a compiled
program is impossible. The library states each such condition once, at the
place a concrete value would be checked, with ``traced_check``: a
``checkify.debug_check``, which is dropped from the program unless the
caller runs it under ``checkify``. ``checked(fn)`` is that caller: it runs
``fn`` with these checks on and raises ``ValueError`` with the first failed
condition's message. Off (the default) nothing is computed, and each value
does what docs/options.md says (lengths clip, a NaN gives NaN rows, ...).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

from jax import lax
from jax.experimental import checkify


def _has_check(jaxpr) -> bool:
  """Whether a jaxpr (or one nested in it) holds a ``check``."""
  from jax._src import core  # pylint: disable=g-import-not-at-top
  for eqn in jaxpr.eqns:
    if eqn.primitive is _CHECK_P or any(
        _has_check(sub) for sub in core.jaxprs_in_params(eqn.params)):
      return True
  return False


def _extend_checkify() -> None:
  """Let checkify pass over a batched while loop that holds no check.

  vmap of a ``while_loop`` whose bound differs per head (the flash walk
  over per-example lengths) gives a loop with a batched predicate, which
  checkify refuses outright, although it only matters for checks inside
  the loop. With user checks only and none inside, the loop is bound as it
  is: the answer and the error are exactly checkify's. Anything else goes
  to checkify's own rule (which raises as before).
  """
  global _CHECK_P
  try:
    from jax._src import checkify as impl  # pylint: disable=g-import-not-at-top
    _CHECK_P, original = impl.check_p, impl.error_checks[lax.while_p]
  except (ImportError, AttributeError, KeyError):  # another JAX: its rule
    return

  def rule(error, enabled_errors, *args, **params):
    if (params["cond_jaxpr"].out_avals[0].shape
        and enabled_errors <= checkify.user_checks
        and not _has_check(params["cond_jaxpr"].jaxpr)
        and not _has_check(params["body_jaxpr"].jaxpr)):
      return error, lax.while_p.bind(*args, **params)
    return original(error, enabled_errors, *args, **params)

  impl.error_checks[lax.while_p] = rule


_CHECK_P = None
_extend_checkify()


def traced_check(pred, message: str, **values: Any) -> None:
  """Record ``pred`` (a bool scalar, traced or not) as a condition that
  ``checked`` enforces; ``message`` may format ``values`` as ``{name}``."""
  checkify.debug_check(pred, message, **values)


def checked(fn: Callable) -> Callable:
  """``fn`` with the library's checks of traced values on.

  ``aj.checked(f)(*args)`` runs ``f`` (jitted or not: put ``jax.jit``
  inside, ``aj.checked(jax.jit(f))``) under
  ``checkify.checkify(f, errors=checkify.user_checks)`` and raises
  ``ValueError`` naming the argument if a documented condition failed
  (rates in [0, 1), lengths and positions in range, finite ``scale`` and
  ``sinks``, page rows and lengths in a paged cache). Off by default: a
  program traced without it pays nothing. To keep the error as a value
  (inside a training step), call ``checkify.checkify`` yourself with
  ``errors=checkify.user_checks``.
  """
  functionalized = checkify.checkify(fn, errors=checkify.user_checks)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    error, out = functionalized(*args, **kwargs)
    message = error.get()
    if message is not None:
      raise ValueError(message.replace(" (`check` failed)", ""))
    return out

  return run
