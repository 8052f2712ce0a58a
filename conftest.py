"""Repository-wide pytest set-up: doctest namespace, strict broadcasting, and
the ``slow`` marker (``python -m pytest -m "not slow"`` is the quick subset).
"""

import contextlib
import ctypes
import gc
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


# A worker process keeps every program it compiled (jax's caches), so its
# memory grows with the tests it ran (past 6 GB in one worker over the
# whole suite). When it has grown by _GROWTH since the last time, the
# caches are dropped after a test and freed memory handed back to the
# system (a program compiled again later costs a recompile, not a result;
# dropping after every test instead would recompile everything).
_GROWTH = 1024 * 2**20
_since = {}


def _resident_bytes() -> int:
  try:
    with open("/proc/self/statm") as f:  # pages: size, resident, ...
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0  # not Linux: no bound


def _hand_back() -> None:
  with contextlib.suppress(OSError, AttributeError):  # glibc only
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed pages


@pytest.fixture(autouse=True)
def _bounded_memory():
  yield
  now = _resident_bytes()
  start = _since.setdefault("rss", now)
  if now - start > _GROWTH:
    jax.clear_caches()
    gc.collect()
    _hand_back()
    _since["rss"] = _resident_bytes()


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

# The exhaustive run, `python -m pytest -m exhaustive` (CI runs it after the
# default run): what repeats a check the default run already makes on
# other inputs, or runs a whole experiment, too slowly for every edit. A
# test is in it when EXHAUSTIVE names it (a file and the start of its test
# ids after "::", "" for the whole file), or its module's
# ``is_exhaustive(test_name)`` says so (the contract: each slow column's
# cases beyond a subset that covers its features; the multi-device
# processes). The default run deselects them (`-m "not slow"` too); an -m
# expression naming "exhaustive" decides for itself.
EXHAUSTIVE = {
    # The docs pages' examples (README's own run by default).
    "tests/test_readme.py": ("test_python_examples_run[docs/",),
    # Whole experiments end to end; their configs, flags, data and models
    # are tested apart by default (test_experiment_training's smoke run
    # trains every seq2seq model).
    "tests/test_serve_experiment.py": ("ServeRunTest::",),
    "tests/test_lm_experiment.py": ("RunTest::",),
    "tests/test_experiment_reliability.py": ("KillAndResumeTest::",),
    "tests/test_logit_scale_experiment.py": ("",),
    "tests/test_cache_accuracy.py": ("CacheAccuracyTest::",),
    # Dropout in the interpreted Pallas kernel at more patterns than the
    # contract's dropout case (run by default on its column).
    "tests/test_pallas_gpu_dropout.py": ("",),
    # benchmarks.gpu_check's quick mode end to end (its checks' pieces run
    # by default: the paged level, a dropped mask caught).
    "tests/test_benchmark_decode_smoke.py": (
        "GpuCheckSmokeTest::test_quick_mode",
        "GpuCheckSmokeTest::test_pattern_timings"),
    # LongRoPE past its original context while decoding (within it runs by
    # default; the scaling formula itself in test_rope_variants).
    "tests/test_rope_longrope_mrope.py": (
        "DecodeTest::test_longrope_past_the_original_context",),
    # Multi-device (tests/test_multidevice.py runs these files' default
    # and exhaustive tests in a process each). The ring contract's columns
    # cover every feature of the zigzag and hybrid calls below; the ring
    # against the references runs on 8 devices (the contract on 4).
    "tests/multidevice/test_ring.py": (
        "RingAttentionTest::test_matches_references0",
        "RingAttentionTest::test_matches_references1",
        "RingAttentionTest::test_score_mod_with_a_learned_slope"),
    "tests/multidevice/test_ring_zigzag.py": (
        "ZigzagTest::test_window_rule_dense_mask_bias_max_logits",
        "ZigzagTest::test_causal_lengths_segments_sinks_alibi",
        "ZigzagTest::test_replicated_key_mask_and_bias1"),
    "tests/multidevice/test_ulysses.py": ("UlyssesTest::test_hybrid_ring2_a2a2",),
    # The layer split both ways (hybrid, zigzag, heads) and the LM's loss
    # curve under all-to-all run by default.
    "tests/multidevice/test_sequence_parallel.py": (
        "SequenceParallelLMTest::test_loss_curve_equals_one_device_ring_zigzag",
        "SequenceParallelLMTest::test_loss_curve_equals_one_device_hybrid",
        "SequenceParallelLayerTest::test_split_layer_equals_the_layer_ring_zigzag"),
    # Per shard: the Pallas GPU kernel by default, the others exhaustive.
    "tests/multidevice/test_sharded_kernels.py": (
        "ShardedModuleTest::test_equals_unsharded_without_gathering_flash",
        "ShardedModuleTest::test_equals_unsharded_without_gathering_splash"),
    "tests/multidevice/test_sharded_training.py": (
        "ShardedTrainingTest::test_loss_curve_equals_single_device",),
}


def _exhaustive(item, name) -> bool:
  if item.get_closest_marker("exhaustive"):
    return True
  test_id = item.nodeid.split("::", 1)[-1]
  if any(test_id.startswith(p) for p in EXHAUSTIVE.get(name, ())):
    return True
  says = getattr(getattr(item, "module", None), "is_exhaustive", None)
  return bool(says and says(item.name))


def pytest_collection_modifyitems(config, items):
  # (The files are named from this repository's root, not rootdir.)
  exhaustive, kept = [], []
  asked = "exhaustive" in (config.option.markexpr or "")
  for item in items:
    path = pathlib.Path(item.path).resolve()
    name = path.relative_to(_ROOT).as_posix() if path.is_relative_to(
        _ROOT) else None
    if name not in QUICK_FILES:
      item.add_marker(pytest.mark.slow)
    if _exhaustive(item, name):
      item.add_marker(pytest.mark.exhaustive)
      exhaustive.append(item)
    else:
      kept.append(item)
  if exhaustive and not asked:
    config.hook.pytest_deselected(items=exhaustive)
    items[:] = kept
