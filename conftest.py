"""Repository-wide pytest set-up: doctest namespace and strict broadcasting."""

import os

# The tests run thousands of tiny programs: XLA compile time, most of it
# LLVM's optimiser, dominates the suite. -O0 code computes the same IEEE
# results (no fast-math either way) and cuts the suite's time by about a
# third. Read when the backend starts, so before any computation below.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

from flax import nnx  # noqa: E402 - after XLA_FLAGS
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import attention_jax  # noqa: E402

# Catch silent rank promotion (e.g. a [T, S] mask quietly meeting [B, T, S]) in
# every test and doctest: the library must broadcast explicitly.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
  doctest_namespace.update(jax=jax, jnp=jnp, np=np, nnx=nnx,
                           aj=attention_jax)

