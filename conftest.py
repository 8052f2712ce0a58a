"""Repository-wide pytest set-up: doctest namespace, strict broadcasting, and
the ``slow`` marker (``python -m pytest -m "not slow"`` is the quick subset).
"""

import os
import pathlib

# The tests run thousands of tiny programs: XLA compile time dominates the
# suite (about 80% of a single-device file's time). Two settings change how
# fast a program is compiled, not what it computes: LLVM at -O0 (the same
# IEEE results; no fast-math either way; about a third of the suite), and
# XLA:CPU's older elemental emitters for fusions (the newer MLIR fusion
# emitters compile a fusion about twice as slowly: test_kv_cache.py and
# test_decoding_positions.py spent 25 s compiling with them, 14 s without,
# and the whole suite went from 847 s to 735 s on 2 cores; the float64
# references and golden values check that both compute the same).
# Read when the backend starts, so before any computation below. A setting
# already in XLA_FLAGS wins (the flags pass on to multi-device subprocesses).
_COMPILE_FASTER = {"xla_backend_optimization_level": "0",
                   "xla_cpu_use_fusion_emitters": "false"}
for _flag, _value in _COMPILE_FASTER.items():
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --{_flag}={_value}").strip()

# A developer's tuned block sizes (aj.kernels.autotune's cache) must not
# change what the tests run: the automatic choice reads no cache here
# (tests/test_autotune.py points it at temporary files itself).
os.environ.setdefault("AJ_AUTOTUNE_CACHE", "off")

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



# The quick subset, `python -m pytest -m "not slow"` (under 2 minutes on 2
# cores), runs only these files; every other test, doctest and README/docs
# example run is marked slow (as is anything marked @pytest.mark.slow), so a
# new test file is slow until it is listed here. Plain `python -m pytest`
# runs everything. The suite's time is spread over many tests of about a
# second each (mostly XLA compiles), so files are chosen whole: the core API
# and its errors, and checks that compile little.
QUICK_FILES = frozenset({
    # scaled_dot_product_attention vs float64 references, every option.
    "tests/test_dot_product.py",
    # Bad input: the error names the argument, eagerly and under jit.
    "tests/test_validation.py",
    # aj.Mask and the dense mask helpers; which kernel runs.
    "tests/test_mask.py",
    "tests/test_masks.py",
    "tests/test_kernel_choice.py",
    # Numerics at the edges: extreme logits, return_max_logits, Rope.
    "tests/test_extremes.py",
    "tests/test_max_logits.py",
    "tests/test_rope_variants.py",
    "tests/test_ring_steps.py",
    "tests/test_torch_convert.py",
    # No compiles: imports, pages (not their examples), flags, data.
    "tests/test_architecture.py",
    "tests/test_readme.py",
    "tests/test_docs_offline.py",
    "tests/test_experiment_config_flags.py",
    "tests/test_experiment_data_metrics.py",
    "tests/test_lm_data.py",
    "tests/test_lm_flags.py",
    "tests/test_run_flags_read.py",
})


_ROOT = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
  del config  # the files are named from this repository's root, not rootdir
  for item in items:
    path = pathlib.Path(item.path).resolve()
    name = path.relative_to(_ROOT).as_posix() if path.is_relative_to(
        _ROOT) else None
    if name not in QUICK_FILES:
      item.add_marker(pytest.mark.slow)
