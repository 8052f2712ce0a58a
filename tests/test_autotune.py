"""Tuned flash blocks: ``aj.kernels.autotune``, its cache, and the lookup.

Every test points the cache at a temporary directory (``$AJ_AUTOTUNE_CACHE``,
with ``$XDG_CACHE_HOME`` and ``$HOME`` moved there too), so nothing reads or
writes the real user cache. Most tests store entries with
``block_cache.store`` rather than timing: one test times (forward only, two
candidates), and one runs the kernel at tuned and default blocks.
``AutotuneChoiceTest`` fakes compiling and timing (known costs per pair):
the fastest wins, each candidate is warmed up before it is timed, and a
call the automatic choice gives another kernel is named.

Shape glossary: B batch, N heads, T query length, S key/value length, H
head dim.
"""

import importlib
import json
import os
import pathlib
import tempfile
from unittest import mock
import warnings

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.kernels import base
from attention_jax.kernels import block_cache
from attention_jax.masking import mask as mask_lib
from tests import _data

# The module (aj.kernels.autotune is its function, which shadows it there).
tune = importlib.import_module("attention_jax.kernels.autotune")

B, N, T, H = 1, 2, 128, 16


def _qkv(t=T, dtype=jnp.float32):
  return tuple(_data.normal(seed, (B, N, t, H), dtype) for seed in range(3))


def _key(query, key, value, mask=None, *, is_causal=False):
  problem = base.canonicalize(query, key, value,
                              mask_lib.as_mask(mask, is_causal=is_causal))
  return block_cache.cache_key(problem)


def _store(blocks, query, key, value, mask=None, *, is_causal=False):
  return block_cache.store(_key(query, key, value, mask,
                                is_causal=is_causal),
                           {"blocks": list(blocks)})


class _CacheInTemp(absltest.TestCase):
  """The cache in a temporary directory, and the process's memory of it
  dropped before and after."""

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()  # pytest runs no absl flags
    self.addCleanup(tmp.cleanup)
    self.dir = pathlib.Path(tmp.name)
    env = mock.patch.dict(os.environ, {
        block_cache.ENV: str(self.dir / "tuned"),
        "XDG_CACHE_HOME": str(self.dir / "xdg"),
        "HOME": str(self.dir / "home"),
    })
    env.start()
    self.addCleanup(env.stop)
    block_cache.forget()
    self.addCleanup(block_cache.forget)
    self.path = self.dir / "tuned" / block_cache.FILE_NAME


class AutotuneTest(_CacheInTemp):

  def test_autotune_writes_the_winner_and_lookup_finds_it(self):
    q, k, v = _qkv()
    pairs = [(32, 64), (64, 32)]
    # (T * S below MIN_SCORES: the automatic choice runs dense, and says so)
    with self.assertWarnsRegex(UserWarning, "runs the 'dense' kernel"):
      tuned = aj.kernels.autotune(q, k, v, is_causal=True, candidates=pairs,
                                  repeats=1, fwd_bwd=False)
    self.assertIn(tuned.blocks, pairs)
    self.assertEqual(set(tuned.timings), set(pairs))
    self.assertTrue(all(t > 0 for t in tuned.timings.values()))
    self.assertEqual(tuned.path, self.path)
    data = json.loads(self.path.read_text())
    self.assertEqual(data["entries"][tuned.key]["blocks"],
                     list(tuned.blocks))
    self.assertEqual(data["entries"][tuned.key]["mode"], "fwd")
    # Read back through a fresh process's path (memory dropped).
    block_cache.forget()
    self.assertEqual(aj.kernels.flash_blocks(q, k, v, is_causal=True),
                     (*tuned.blocks, "cache"))
    # The lookup needs only shapes and dtypes.
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    self.assertEqual(aj.kernels.flash_blocks(*abstract, is_causal=True),
                     (*tuned.blocks, "cache"))
    # No temporary file is left beside it (written, then moved over).
    self.assertEqual(os.listdir(self.path.parent), [self.path.name])

  def test_another_shape_pattern_or_dtype_misses(self):
    q, k, v = _qkv()
    _store((32, 64), q, k, v, is_causal=True)
    self.assertEqual(aj.kernels.flash_blocks(q, k, v, is_causal=True),
                     (32, 64, "cache"))
    defaults = aj.kernels.flash_blocks(q, k, v)  # not causal
    self.assertEqual(defaults.source, "defaults")
    short = _qkv(t=64)
    self.assertEqual(
        aj.kernels.flash_blocks(*short, is_causal=True).source, "defaults")
    half = _qkv(dtype=jnp.bfloat16)
    self.assertEqual(
        aj.kernels.flash_blocks(*half, is_causal=True).source, "defaults")
    lengths = aj.Mask(causal=True, kv_lengths=jnp.array([100]))
    self.assertEqual(aj.kernels.flash_blocks(q, k, v, lengths).source,
                     "defaults")
    window = aj.Mask(causal=True, window=(32, 0))
    self.assertEqual(aj.kernels.flash_blocks(q, k, v, window).source,
                     "defaults")
    # The leading dims count as a product (heads): [2, 1] finds [1, 2]'s.
    swapped = [x.reshape(2, 1, T, H) for x in (q, k, v)]
    self.assertEqual(aj.kernels.flash_blocks(*swapped, is_causal=True),
                     (32, 64, "cache"))

  def test_another_machine_misses(self):
    q, k, v = _qkv()
    _store((32, 64), q, k, v)
    other = dict(block_cache.fingerprint(), cpu="another CPU")
    with mock.patch.object(block_cache, "fingerprint", lambda: other):
      self.assertEqual(aj.kernels.flash_blocks(q, k, v).source, "defaults")
    self.assertEqual(aj.kernels.flash_blocks(q, k, v).source, "cache")
    self.assertContainsSubset(
        {"machine", "cpu", "cpus", "jax", "jaxlib", "backend", "device"},
        block_cache.fingerprint())

  def test_a_corrupt_or_foreign_file_warns_and_the_defaults_run(self):
    q, k, v = _qkv()
    self.path.parent.mkdir(parents=True)
    for text in ("{not json", json.dumps({"version": 99, "entries": {}}),
                 json.dumps([1, 2])):
      self.path.write_text(text)
      block_cache.forget()
      with self.assertWarnsRegex(UserWarning, "ignored"):
        found = aj.kernels.flash_blocks(q, k, v)
      self.assertEqual(found.source, "defaults")
    # Read once per process: no second warning from memory.
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      aj.kernels.flash_blocks(q, k, v)
    # The next write replaces the file with a valid one.
    with self.assertWarnsRegex(UserWarning, "ignored"):
      _store((64, 64), q, k, v)
    self.assertEqual(json.loads(self.path.read_text())["version"],
                     block_cache.VERSION)
    self.assertEqual(aj.kernels.flash_blocks(q, k, v), (64, 64, "cache"))

  def test_memory_is_read_once_and_updated_by_own_writes(self):
    q, k, v = _qkv()
    _store((32, 64), q, k, v)
    self.assertEqual(aj.kernels.flash_blocks(q, k, v), (32, 64, "cache"))
    # Another writer's change is not seen until forget() (or a restart).
    self.path.write_text(json.dumps({"version": block_cache.VERSION,
                                     "entries": {}}))
    self.assertEqual(aj.kernels.flash_blocks(q, k, v), (32, 64, "cache"))
    block_cache.forget()
    self.assertEqual(aj.kernels.flash_blocks(q, k, v).source, "defaults")
    _store((64, 32), q, k, v)  # this process's write: seen at once
    self.assertEqual(aj.kernels.flash_blocks(q, k, v), (64, 32, "cache"))

  def test_given_blocks_win_over_the_cache(self):
    q, k, v = _qkv()
    _store((32, 64), q, k, v)
    self.assertEqual(aj.kernels.flash_blocks(q, k, v, block_q=16),
                     (16, 256, "given"))  # the other side: the default
    self.assertEqual(
        aj.kernels.flash_blocks(q, k, v, block_q=16, block_k=16),
        (16, 16, "given"))

  def test_a_block_masks_sizes_win_over_the_cache(self):
    q, k, v = _qkv()
    bm = aj.block_mask(lambda b, h, i, j: i >= j, T, T, block_q=64,
                       block_k=32)
    _store((16, 16), q, k, v, bm)  # an entry a block mask never reads
    self.assertEqual(aj.kernels.flash_blocks(q, k, v, bm),
                     (64, 32, "block_mask"))
    with self.assertRaisesRegex(ValueError, "block mask's"):
      aj.kernels.autotune(q, k, v, bm, candidates=[(32, 32)], repeats=1)
    # Only its own pair is a candidate.
    problem = base.canonicalize(q, k, v, aj.Mask(rule=bm))
    self.assertEqual(tune.default_candidates(problem), [(64, 32)])

  def test_tuned_blocks_give_the_default_blocks_numbers(self):
    q, k, v = _qkv()
    mask = aj.Mask(causal=True, kv_lengths=jnp.array([100]))
    _store((32, 64), q, k, v, mask)
    ran = []
    real = block_cache.blocks

    def spy(*args):
      ran.append(real(*args))
      return ran[-1]

    call = jax.jit(lambda q, k, v, m, impl: aj.scaled_dot_product_attention(
        q, k, v, m, implementation=impl, return_lse=True),
                   static_argnums=4)
    with mock.patch.object(block_cache, "blocks", spy):
      tuned = call(q, k, v, mask, aj.kernels.Flash())
      default = call(q, k, v, mask, aj.kernels.Flash(128, 128))
    self.assertEqual([b.source for b in ran], ["cache", "given"])
    self.assertEqual(ran[0][:2], (32, 64))
    # Other blocks sum the same terms in another order (online softmax
    # rescaled per key block): float32 rounding, a few ulps of O(1) values.
    for a, b in zip(tuned, default):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def test_default_candidates_stay_within_the_lengths(self):
    q = jnp.zeros((1, 300, 8))
    k = jnp.zeros((1, 2048, 8))
    pairs = tune.default_candidates(base.canonicalize(q, k, k, None))
    # T = 300 rounds up to 512; the default 1024 x 256 clips to 300 x 256,
    # which 512 x 256 already runs.
    self.assertEqual({bq for bq, _ in pairs}, {128, 256, 512})
    self.assertEqual({bk for _, bk in pairs}, {128, 256, 512, 1024})
    self.assertLen(pairs, 12)

  def test_the_env_var_names_a_file_or_turns_the_cache_off(self):
    q, k, v = _qkv()
    custom = self.dir / "elsewhere" / "mine.json"
    with mock.patch.dict(os.environ, {block_cache.ENV: str(custom)}):
      self.assertEqual(block_cache.cache_path(), custom)
      self.assertEqual(_store((32, 32), q, k, v), custom)
      self.assertEqual(aj.kernels.flash_blocks(q, k, v), (32, 32, "cache"))
    self.assertFalse(self.path.exists())
    self.assertEqual(aj.kernels.flash_blocks(q, k, v).source, "defaults")
    with mock.patch.dict(os.environ, {block_cache.ENV: "off"}):
      self.assertIsNone(block_cache.cache_path())
      self.assertIsNone(_store((32, 32), q, k, v))
      self.assertEqual(aj.kernels.flash_blocks(q, k, v).source, "defaults")
    # Unset: the XDG cache directory, else ~/.cache.
    with mock.patch.dict(os.environ):
      del os.environ[block_cache.ENV]
      self.assertEqual(block_cache.cache_path(),
                       self.dir / "xdg" / "attention_jax" / "flash_blocks.json")
      del os.environ["XDG_CACHE_HOME"]
      self.assertEqual(
          block_cache.cache_path(),
          self.dir / "home" / ".cache" / "attention_jax" / "flash_blocks.json")

  def test_bad_arguments(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(TypeError, "candidates"):
      aj.kernels.autotune(q, k, v, candidates=[(32,)])
    with self.assertRaisesRegex(TypeError, "candidates"):
      aj.kernels.autotune(q, k, v, candidates=[])
    with self.assertRaisesRegex(ValueError, "block_q"):
      aj.kernels.autotune(q, k, v, candidates=[(0, 32)])
    with self.assertRaisesRegex(ValueError, "repeats"):
      aj.kernels.autotune(q, k, v, repeats=0)
    with self.assertRaisesRegex(TypeError, "outside jax.jit"):
      jax.jit(lambda q: aj.kernels.autotune(q, k, v).blocks)(q)
    with jax.enable_x64(True), self.assertRaisesRegex(ValueError, "float64"):
      aj.kernels.autotune(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    self.assertFalse(self.path.exists())


class _Run:
  """A compiled program's stand-in: counts its runs."""

  def __init__(self):
    self.count = 0

  def __call__(self):
    self.count += 1


class _FakeRuns:
  """Stands in for compiling and timing: each candidate's run counts its
  calls, and a timing costs what ``costs`` says (seconds by pair)."""

  def __init__(self, costs):
    self.costs, self.timed = costs, []

  def compile(self, fn, args):
    del fn, args
    return _Run()

  def seconds(self, candidate):
    # How many runs the candidate had before this timing: the warm-up.
    self.timed.append((candidate.blocks, candidate.run.count))
    candidate.run()
    return self.costs[candidate.blocks]

  def __enter__(self):
    self.patches = [mock.patch.object(tune, "_compile", self.compile),
                    mock.patch.object(tune, "_seconds", self.seconds)]
    for patch in self.patches:
      patch.start()
    return self

  def __exit__(self, *exc):
    for patch in self.patches:
      patch.stop()


class AutotuneChoiceTest(_CacheInTemp):
  """Which candidate wins, how it is timed, and whether the automatic
  choice ever runs it. Timings are faked (``_FakeRuns``): nothing runs."""

  # More than FINALISTS, so the screening decides who reaches the finals.
  COSTS = {(16, 16): 5.0, (16, 32): 3.0, (32, 16): 1.0, (32, 32): 4.0,
           (64, 16): 2.0, (16, 64): 6.0}

  def tune(self, *args, costs=None, **kwargs):
    costs = self.COSTS if costs is None else costs
    with _FakeRuns(costs) as fake, warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      tuned = aj.kernels.autotune(*args, candidates=list(costs), repeats=3,
                                  **kwargs)
    return tuned, fake, [str(x.message) for x in w]

  def test_the_fastest_candidate_wins(self):
    self.assertGreater(len(self.COSTS), tune.FINALISTS)
    tuned, _, _ = self.tune(*_qkv(), is_causal=True)
    self.assertEqual(tuned.blocks, (32, 16))
    self.assertEqual(tuned.timings, self.COSTS)
    self.assertEqual(json.loads(self.path.read_text())["entries"][
        tuned.key]["blocks"], [32, 16])
    # Wherever the fastest stands in the list; ties go to the first given.
    reordered = dict(reversed(list(self.COSTS.items())))
    self.assertEqual(self.tune(*_qkv(), costs=reordered)[0].blocks,
                     (32, 16))
    tied = {(16, 16): 2.0, (32, 32): 1.0, (64, 64): 1.0}
    self.assertEqual(self.tune(*_qkv(), costs=tied)[0].blocks, (32, 32))

  def test_each_candidate_is_warmed_up_before_it_is_timed(self):
    # A first run pays allocations and cold caches (up to 10x a later
    # run's time): the screening times each candidate's second run.
    _, fake, _ = self.tune(*_qkv(), is_causal=True)
    first = {}
    for pair, runs_before in fake.timed:
      first.setdefault(pair, runs_before)
    self.assertEqual(first, dict.fromkeys(self.COSTS, 1))
    # Then 1 screening + `repeats` for each of the FINALISTS.
    self.assertEqual(sorted(p for p, _ in fake.timed if _ > 1),
                     sorted([(32, 16), (64, 16), (16, 32), (32, 32)] * 3))

  def test_says_when_the_automatic_choice_runs_another_kernel(self):
    # B2 N4 T=512: T * S is below MIN_SCORES, so the automatic choice runs
    # the dense kernel and never reads the cache.
    q = jnp.zeros((2, 4, 512, 16))
    tuned, _, said = self.tune(q, q, q, is_causal=True)
    self.assertEqual(tuned.automatic, "dense")
    self.assertLen(said, 1)
    self.assertRegex(said[0], r"automatic choice \(implementation=None\) "
                     r"runs the 'dense' kernel for this call, not flash "
                     r"\(flash declines: T \* S = 262144 is below 1048576.*"
                     r"implementation='flash'.*aj.blockwise_attention")
    self.assertEqual(aj.explain(q, q, q, is_causal=True).kernel, "dense")
    # Cached all the same, for the calls that run flash.
    self.assertEqual(aj.kernels.flash_blocks(q, q, q, is_causal=True),
                     (32, 16, "cache"))
    # At T * S >= MIN_SCORES the automatic choice is flash: no warning.
    q = jnp.zeros((1, 1, 1024, 16))
    tuned, _, said = self.tune(q, q, q, is_causal=True)
    self.assertEqual((tuned.automatic, said), ("flash", []))

  def test_a_kernel_registered_before_flash_is_named(self):
    class First(aj.kernels.Dense):
      name = "first"

    q = jnp.zeros((1, 1, 1024, 16))
    with aj.kernels.register(First(), before="flash"):
      tuned, _, said = self.tune(q, q, q)
    self.assertEqual(tuned.automatic, "first")
    self.assertRegex(said[0], r"runs the 'first' kernel .*\('first' comes "
                     r"first in aj.kernels.REGISTRY\)")


if __name__ == "__main__":
  absltest.main()
