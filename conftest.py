"""Repository-wide pytest set-up: doctest namespace, strict broadcasting, and
the ``slow`` marker (``python -m pytest -m "not slow"`` is the quick subset).
"""

import contextlib
import ctypes
import gc
import inspect
import os
import pathlib
import re
import shutil
import tempfile

# The tests run thousands of tiny programs: building them (JAX's tracing
# and lowering, then XLA's compile) is most of the suite's time. Two
# settings change how fast XLA compiles a program, not what it computes:
# LLVM at -O0 (the same IEEE results; no fast-math either way; about a
# third of the suite), and XLA:CPU's older elemental emitters for fusions
# (the newer MLIR fusion emitters compile a fusion about twice as slowly:
# test_kv_cache.py and test_decoding_positions.py spent 25 s compiling
# with them, 14 s without, and the whole suite went from 847 s to 735 s on
# 2 cores; the float64 references and golden values check that both
# compute the same). And one LLVM module a program, compiled in one
# piece, rather than split into 32 parts for a thread each (XLA:CPU's
# parallel codegen): the same code, but on 2 cores the parts only add
# work (each part's set-up, the threads' hand-offs); the compiles of a
# sample of contract cases took 20-35% fewer CPU-seconds (the suite's
# programs are small).
# Read when the backend starts, so before any computation below. A setting
# already in XLA_FLAGS wins (the flags pass on to multi-device subprocesses).
_COMPILE_FASTER = {"xla_backend_optimization_level": "0",
                   "xla_cpu_use_fusion_emitters": "false",
                   "xla_cpu_parallel_codegen_split_count": "1"}
for _flag, _value in _COMPILE_FASTER.items():
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --{_flag}={_value}").strip()

# Many tests compile the same small programs (one jnp operation at one
# shape, run eagerly) in each xdist worker and multi-device process: JAX's
# persistent compilation cache, in a directory of this run's own (started
# empty, removed at the end: the run's time is a cold one), lets a program
# compiled once be loaded by the others (about 9% of the wall time of four
# layer files on 2 workers). A cache directory already set is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="attention_jax_tests_jax_cache_")
  _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
else:
  _OWN_CACHE = None
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

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


# Python's cycle collector: tracing allocates objects by the million, and
# with the default thresholds (700, 10, 10) full collections ran often,
# each walking every live object (the modules, every cached program):
# about 5% of a worker's CPU-seconds (13.7 of 283 over six test
# files in one process; 2.5 with the settings below, the same peak memory
# and cache drops). Young objects are still collected often; what is
# alive once the tests are collected (modules, test items) is frozen out
# of the walks; _bounded_memory collects everything when it drops caches.
gc.set_threshold(50_000, 50, 1000)


def pytest_unconfigure(config):
  # The process that made the cache directory removes it (xdist's workers
  # and the multi-device processes inherit it through the environment).
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_finish(session):
  gc.collect()
  gc.freeze()


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
# processes; test_cudnn_wiring's option grids beyond every pair), or it is
# a chex variant that _variant_repeats leaves out. The default run
# deselects them (`-m "not slow"` too); an -m expression naming
# "exhaustive" decides for itself.
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
        "GpuCheckSmokeTest::test_pattern_timings",
        "DecodeSmokeTest::test_tiny_run_checks_times_and_writes_docs"),
    # The MoBA benchmark's tiny run (its visited-block count runs by
    # default; its programs are moba_attention's, tested in test_moba).
    "tests/test_benchmark_sparse_smoke.py": (
        "SparseBenchmarkTest::test_a_tiny_run",),
    # The benchmarks' tiny presets end to end (5-15 CPU-s each): what they
    # time is the library's calls, tested by default; their report
    # helpers run by default in the smoke files' other tests.
    "tests/test_benchmark_structured_smoke.py": (
        "StructuredBenchmarkSmokeTest::test_tiny_preset_writes_its_tables",),
    "tests/test_benchmark_smoke.py": (
        "BenchmarkSmokeTest::test_tiny_preset_writes_its_table",
        "BenchmarkSmokeTest::test_ring_memory_writes_its_table"),
    "tests/test_benchmark_serving_smoke.py": (
        "ServingBenchmarkSmokeTest::test_paged_rows",),
    # An int8 paged cache through the layer (the int8 pages against what
    # was stored, and their error against float pages, run by default in
    # test_quantized_pages); and:
    # A shared prompt through the layer (read by both holders in
    # test_paged_attention by default).
    "tests/test_modules_paged.py": (
        "PagedModuleTest::test_an_int8_cache_decodes_close_to_the_float_one",
        "PagedModuleTest::test_a_shared_prompt_is_stored_once_and_read_by_"
        "both"),
    # Merging partial results: the gradients against the union's (the
    # forward, one part and empty parts run by default).
    "tests/test_merge.py": ("MergeTest::test_gradients_equal_the_unions",),
    # The latent functions' scale as concrete and traced arrays (the
    # module's concrete scalar and the refusals run by default).
    "tests/test_latent_refusals.py": (
        "ScaleTest::test_the_functions_take_concrete_and_traced_scalar_"
        "arrays",),
    # The latent layer's paged-cache example, eager (the same calls run
    # jitted by default in test_latent).
    "attention_jax/layers/latent_module.py": (
        "attention_jax.layers.latent_module.MultiHeadLatentAttention."
        "init_paged_cache",),
    # LongRoPE past its original context while decoding (within it runs by
    # default; the scaling formula itself in test_rope_variants).
    "tests/test_rope_longrope_mrope.py": (
        "DecodeTest::test_longrope_past_the_original_context",),
    # That dropping any one mapped option moves a golden's output (a check
    # of the goldens, which the default run's test_matches_transformers
    # relies on: every family's layers equal transformers'); and paged
    # decoding of the families whose options act before the cache (llama's
    # rope scaling, qwen3's qk-norm): gemma2 (window, soft cap) and gpt_oss
    # (sinks, window, YaRN) run by default.
    "tests/test_checkpoints.py": (
        "GoldenTest::test_each_option_is_seen",
        "ServingTest::test_paged_decoding_gives_the_checkpoints_outputs0",
        "ServingTest::test_paged_decoding_gives_the_checkpoints_outputs2"),
    # The paged GPU kernel against flash over the same pages, dtype x
    # splits: the default run keeps float32 in one partition and int8 in
    # three (0 and 3), so each page dtype and each split count runs; the
    # contract's paged_gpu column runs two partitions on its cases.
    "tests/test_paged_gpu.py": (
        "PagedGpuTest::test_equals_the_flash_kernel_over_the_same_pages1",
        "PagedGpuTest::test_equals_the_flash_kernel_over_the_same_pages2"),
    # The flash kernel against jax.nn on the patterns both share: dense
    # meets jax.nn on them by default, and flash the float64 reference on
    # every contract case.
    "tests/test_dot_product.py": (
        "ReferenceTest::test_patterns_agree_with_jax_nn4",
        "ReferenceTest::test_patterns_agree_with_jax_nn5",
        "ReferenceTest::test_patterns_agree_with_jax_nn6",
        "ReferenceTest::test_patterns_agree_with_jax_nn7"),
    # Finite differences through the flash kernel with dropout: the
    # contract checks its dropout cases' gradients and jvp against the
    # float64 reference on every kernel by default.
    "tests/test_flash_autodiff.py": (
        "ForwardModeTest::test_check_grads_both_modes_with_dropout",),
    # Eager generation (jit=False) of what runs under jit by default; eager
    # and jitted both run on test_equals_the_argmax_..._step0 and 1.
    "tests/test_generate.py": (
        "GreedyTest::test_equals_the_argmax_of_a_full_forward_recomputed_"
        "each_step2",
        "GreedyTest::test_eos_stops_a_row_which_then_emits_pad0",
        "SamplingTest::test_the_same_key_gives_the_same_tokens_within_the_"
        "top_k0"),
    # Speculative decoding and its cache edits: the default run keeps each
    # property once (move_slots against its NumPy model, the verified
    # cache against plain decoding's, speculative_generate's tokens against
    # aj.generate's with prompt lookup); these repeat them through another
    # door (reuse of freed pages, one row's page table, a draft that is
    # always right or always wrong, the JAX lookup against the host one)
    # or test the serve experiment's draft model (the serve run uses it).
    "tests/test_paged_edit.py": ("MoveSlotsTest::test_freed_pages_are_reused",),
    "tests/test_speculative.py": (
        "ModelDraftTest::",
        "VerifiedCacheTest::test_one_row_keeps_the_same_page_table"),
    "tests/test_speculative_generate.py": (
        "SpeculativeGenerateTest::test_a_draft_of_the_greedy_tokens",
        "SpeculativeGenerateTest::test_a_wrong_draft",
        "PromptLookupTest::"),
    # Docstring examples that run a paged cache eagerly (op by op, 5-11
    # CPU-s each): the same calls are tested jitted by default
    # (test_paged_edit, test_importance, test_eviction,
    # test_speculative_generate).
    "attention_jax/decoding/paged_edit.py": ("",),
    "attention_jax/decoding/paged_importance.py": ("",),
    "attention_jax/decoding/eviction.py": ("",),
    "attention_jax/layers/speculative_generate.py": ("",),
    # The paged route with int8 pages and a window (float pages run by
    # default); the eviction model's importance against the full forward
    # (the measurement's H2O reads it in the exhaustive serve run).
    "tests/test_importance.py": (
        "PagedKeyImportanceTest::test_equals_key_importance_over_the_linear_"
        "keys_int8",),
    # Multi-device (tests/test_multidevice.py runs these files' default
    # and exhaustive tests in a process each). The ring contract's columns
    # (ring and ring_zigzag sharing their cases, contract.COVERED_TOGETHER)
    # cover every feature of the zigzag and hybrid calls below; the ring
    # against the references at 2, 4 and 8 devices is one check at three
    # sizes, which the contract makes on 4 (outputs, lse and gradients of
    # every feature) and test_window_skips_ring_steps on 8 (outputs); a
    # window that reaches one block back ((3, 0)) is the rule of (7, 0),
    # two back.
    "tests/multidevice/test_ring.py": (
        "RingAttentionTest::test_matches_references",
        "RingAttentionTest::test_window_skips_ring_steps0",
        "RingAttentionTest::test_score_mod_with_a_learned_slope"),
    "tests/multidevice/test_ring_zigzag.py": (
        "ZigzagTest::test_window_rule_dense_mask_bias_max_logits",
        "ZigzagTest::test_causal_lengths_segments_sinks_alibi",
        "ZigzagTest::test_replicated_key_mask_and_bias1"),
    "tests/multidevice/test_ulysses.py": ("UlyssesTest::test_hybrid_ring2_a2a2",),
    # The layer split with the hybrid (a ring over groups, zigzag, heads
    # over "model") and with all-to-all (zigzag) runs by default, and the
    # function with the ring and the heads split in
    # test_every_array_reaches_its_shard; the LM trained end to end under
    # each split (experiments/lm.py's sequence-parallel glue) is a whole
    # experiment, like those above: the layers it splits run by default.
    "tests/multidevice/test_sequence_parallel.py": (
        "SequenceParallelLMTest::",
        "SequenceParallelLayerTest::test_split_layer_equals_the_layer_ring_"
        "zigzag",
        "SequenceParallelLayerTest::test_split_layer_equals_the_layer_ring_"
        "contiguous_heads",
        # One of batch or heads split, for ring and all-to-all (method x
        # split): the default run keeps ring with the batch split and
        # all-to-all with the heads split (0 and 3), so each method runs
        # with the other axis's shift a constant 0 and each axis split
        # alone; test_every_array_reaches_its_shard splits both axes under
        # both methods by default.
        "SequenceParallelLayerTest::test_shared_arrays_under_one_split1",
        "SequenceParallelLayerTest::test_shared_arrays_under_one_split2",
        # Zigzag on natural and on pre-permuted arrays: the default run
        # keeps the ring and all-to-all (zigzag is contiguous there) on
        # natural order; the hybrid on pre-permuted arrays runs by default
        # in the layer test (test_split_layer_equals_the_layer_hybrid_...).
        "SequenceParallelZigzagTest::test_zigzag_equals_dense_attention1",
        "SequenceParallelZigzagTest::test_zigzag_equals_dense_attention2",
        "SequenceParallelZigzagTest::test_zigzag_equals_dense_attention3",
        "SequenceParallelZigzagTest::test_zigzag_equals_dense_attention5"),
    # The heads split on an Explicit mesh, plain causal self-attention:
    # the same call with sinks, T5 bias, a gate, qk-norm and rope runs by
    # default.
    "tests/multidevice/test_explicit_axes.py": (
        "ExplicitAxesTest::test_equals_unsharded_self_causal",),
    # Per shard: the Pallas GPU kernel by default, the others exhaustive.
    "tests/multidevice/test_sharded_kernels.py": (
        "ShardedModuleTest::test_equals_unsharded_without_gathering_flash",
        "ShardedModuleTest::test_equals_unsharded_without_gathering_splash"),
    "tests/multidevice/test_sharded_training.py": (
        "ShardedTrainingTest::test_loss_curve_equals_single_device",),
}


# chex.variants(with_jit=True, without_jit=True) runs each case of a test
# twice, eagerly and under jit. By default the first case of each test
# function runs both; its other cases run one each, alternately under jit
# and eagerly (in collection order), so both paths still meet every other
# case's shapes and options between them; the exhaustive run has the
# rest.
_VARIANT = re.compile(r"__(with_jit|without_jit)$")


def _variant_repeats(items) -> set[str]:
  """Node ids of the chex variants that the default run leaves out."""
  tests = {}  # (file, class, test function) -> {case: {variant: node id}}
  for item in items:
    found = _VARIANT.search(item.name)
    function = getattr(item, "obj", None)
    if not found or function is None:
      continue
    key = (item.path, getattr(item, "cls", None),
           getattr(inspect.unwrap(function), "__qualname__", item.name))
    case = item.name[:found.start()]
    tests.setdefault(key, {}).setdefault(case, {})[found[1]] = item.nodeid
  repeats = set()
  for cases in tests.values():
    for i, variants in enumerate(cases.values()):
      if i and len(variants) == 2:  # the first case keeps both
        repeats.add(variants["without_jit" if i % 2 else "with_jit"])
  return repeats


def _exhaustive(item, name, repeats=frozenset()) -> bool:
  if item.get_closest_marker("exhaustive") or item.nodeid in repeats:
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
  repeats = _variant_repeats(items)
  for item in items:
    path = pathlib.Path(item.path).resolve()
    name = path.relative_to(_ROOT).as_posix() if path.is_relative_to(
        _ROOT) else None
    if name not in QUICK_FILES:
      item.add_marker(pytest.mark.slow)
    if _exhaustive(item, name, repeats):
      item.add_marker(pytest.mark.exhaustive)
      exhaustive.append(item)
    else:
      kept.append(item)
  if exhaustive and not asked:
    config.hook.pytest_deselected(items=exhaustive)
    items[:] = kept
