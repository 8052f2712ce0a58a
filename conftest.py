"""Repository-wide pytest set-up: doctest namespace and strict broadcasting."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Catch silent rank promotion (e.g. a [T, S] mask quietly meeting [B, T, S]) in
# every test and doctest: the library must broadcast explicitly.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
  doctest_namespace.update(jax=jax, jnp=jnp, np=np, nnx=nnx)
