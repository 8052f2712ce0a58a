"""The flash kernel's tuned block sizes: an on-disk cache and its cheap lookup.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim; ``...`` leading dims (the kernel runs one head per index of
their broadcast shape).

``aj.kernels.autotune`` (``kernels/autotune.py``) times the flash kernel
at candidate ``(block_q, block_k)`` pairs and writes the winner here;
``Flash()`` without block sizes asks ``blocks`` at trace time, which
answers from this cache or else ``flash_core.block_sizes``' defaults.
Nothing here times anything: the library tunes only when asked to.

The cache is one JSON file, ``{"version": 1, "entries": {key: entry}}``:

* where: ``$AJ_AUTOTUNE_CACHE`` (a path ending in ``.json`` is the file,
  any other a directory holding ``flash_blocks.json``; ``off`` disables
  the cache), else ``$XDG_CACHE_HOME/attention_jax/flash_blocks.json``,
  else ``~/.cache/attention_jax/flash_blocks.json``;
* the key (``cache_key``): this machine's ``fingerprint`` (so another
  machine, or another jax, never reuses a timing) and the call's
  ``signature`` (lengths, head dims, dtype, head and key/value head
  counts, the pattern's kind and window size, the score modifier's name,
  dropout);
* read once per process and path, then held in memory (a write by this
  process updates it; another process's write is seen after a restart);
  written atomically (a temporary file, then ``os.replace``), so a reader
  never sees half a file. A corrupt file, or one of another version, is
  ignored with a warning (the defaults run) and replaced by the next write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import platform
import tempfile
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import jaxlib

from attention_jax.kernels import base
from attention_jax.kernels import flash_core

ENV = "AJ_AUTOTUNE_CACHE"
FILE_NAME = "flash_blocks.json"
# The file's layout; a file of another version is ignored (never misread).
VERSION = 1

# {path: {key: entry}}: each file read once per process (``lookup``).
_MEMORY: dict[str, dict[str, dict[str, Any]]] = {}


class FlashBlocks(NamedTuple):
  """The blocks a flash call runs and where they came from.

  ``block_q`` and ``block_k`` are the query and key block sizes (the walk
  clips them to ``T`` and ``S``); ``source`` is ``"given"`` (the kernel's
  own ``block_q``/``block_k``; one given, the other the default),
  ``"block_mask"`` (a ``BlockMask``'s tables fix them), ``"cache"`` (tuned
  by ``autotune`` on this machine) or ``"defaults"``
  (``flash_core.block_sizes``' rule by pattern).
  """
  block_q: int  # query block size
  block_k: int  # key block size
  source: str  # given, block_mask, cache or defaults


def cache_path() -> pathlib.Path | None:
  """The cache file (not created here), or None when ``$AJ_AUTOTUNE_CACHE``
  is ``off``. Decided by the name alone: no file system call, since
  ``lookup`` reads it on every flash call (through ``_path``)."""
  return _path(os.environ.get(ENV), os.environ.get("XDG_CACHE_HOME"),
               os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _path(env: str | None, xdg: str | None, home: str | None
          ) -> pathlib.Path | None:
  # Keyed by the variables it reads (``home`` for expanduser), so a
  # changed environment is seen while a flash trace pays a dict lookup.
  del home
  if env is not None and env.strip().lower() == "off":
    return None
  if env:
    path = pathlib.Path(env).expanduser()
    return path if path.suffix == ".json" else path / FILE_NAME
  base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attention_jax" / FILE_NAME


def _cpu_model() -> str:
  """``model name`` from /proc/cpuinfo (x86; ``Hardware``/``CPU part`` on
  some ARM), else ``platform.processor()`` (often empty on Linux)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "Hardware", "CPU part"):
          return " ".join(value.split())
  except OSError:
    pass
  return platform.processor()


@functools.cache
def _machine(backend: str) -> tuple[tuple[str, str], ...]:
  # Cached: /proc/cpuinfo and the device list are read once per backend.
  try:
    cpus = len(os.sched_getaffinity(0))  # the cores this process may use
  except AttributeError:
    cpus = os.cpu_count() or 0
  return (("machine", platform.machine()), ("cpu", _cpu_model()),
          ("cpus", str(cpus)), ("jax", jax.__version__),
          ("jaxlib", jaxlib.__version__), ("backend", backend),
          ("device", jax.devices(backend)[0].device_kind))


def fingerprint(backend: str | None = None) -> dict[str, str]:
  """What makes timings this machine's: architecture, CPU model, the cores
  this process may use, jax and jaxlib versions, the backend and its device
  kind (``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``, ``"cpu"``).

  Args:
    backend: ``"cpu"``, ``"gpu"``, ``"tpu"``; None is
      ``jax.default_backend()`` (where an unplaced call compiles).
  """
  return dict(_machine(backend or jax.default_backend()))


def modifier_name(score_mod) -> str | None:
  """A score modifier's name for the key: the module and qualified name of
  its function (of a ``ScoreMod``'s ``fn``; a chain's parts joined by
  ``+``), the same in every process. None without one."""
  if score_mod is None:
    return None
  parts = getattr(score_mod, "params", None)
  if (hasattr(score_mod, "fn") and isinstance(parts, tuple) and parts
      and all(hasattr(p, "fn") for p in parts)):  # score_mods.chain
    return "+".join(modifier_name(p) for p in parts)
  fn = getattr(score_mod, "fn", score_mod)
  while isinstance(fn, functools.partial):  # chain's plain_fn(mod, ...)
    fn = fn.args[0] if fn.args and callable(fn.args[0]) else fn.func
  named = fn if hasattr(fn, "__qualname__") else type(fn)
  return f"{named.__module__}.{named.__qualname__}"


def signature(ops: base.Operands, *, dropout: bool = False
              ) -> dict[str, Any]:
  """What of one call decides its best blocks (``ops``: ``Problem.ops``;
  ``dropout``: whether it drops entries, ``Problem.dropout_on``).

  Lengths, head dims and dtype set each block's work. The leading dims
  count as products (``heads``: of the broadcast leading dims, ``kv_heads``:
  of the keys'), not shapes: the kernel runs one single-head walk per
  index of them (a vmap), so ``B=4, N=8`` and ``B=2, N=16`` are the same
  program, while ``kv_heads`` tells grouped-query calls (keys shared by
  ``heads / kv_heads`` query heads) from the others. The pattern's kind
  decides which blocks the walk skips or runs unmasked: causality, the
  window's size (a window of 16 skips most blocks of 128, one of 200 few),
  and whether segment ids, query/key lengths, a dense mask, a rule, a bias
  or positions (offsets) are present; their values are arrays, often
  traced, and not part of the key. Work per score: which score modifier
  (by name: ``modifier_name``; a soft cap's tanh costs more than ALiBi's
  multiply-add) and whether dropout draws a hash per entry (and again in
  the backward).
  """
  # The output dtype (Problem.out_dtype), by promote_types: a quarter of
  # result_type's cost, paid at every flash trace.
  key_dtype = jnp.promote_types(jnp.promote_types(ops.query.dtype,
                                                  ops.key.dtype),
                                ops.value.dtype)
  return {
      "T": ops.query.shape[-2], "S": ops.key.shape[-2],
      "H": ops.query.shape[-1], "Hv": ops.value.shape[-1],
      "dtype": key_dtype.name,
      "heads": math.prod(ops.batch_shape),
      "kv_heads": math.prod(ops.key.shape[:-2]),
      "causal": bool(ops.causal),
      "window": None if ops.window is None else tuple(ops.window),
      "segment_ids": ops.q_segment_ids is not None or ops.kv_segment_ids is not None,
      "q_lengths": ops.q_lengths is not None,
      "kv_lengths": ops.kv_lengths is not None,
      "dense_mask": ops.dense is not None,
      "rule": ops.rule is not None,
      "bias": ops.bias is not None,
      "score_mod": modifier_name(ops.score_mod),
      "offsets": ops.q_offset is not None or ops.kv_offset is not None,
      "dropout": bool(dropout),
  }


def _flat(fields: dict[str, Any]) -> str:
  # repr: strings quoted, so a CPU name holding ";" or "|" stays one field.
  return ";".join(f"{name}={value!r}" for name, value in fields.items())


def cache_key(problem) -> str:
  """The cache's key of a call (a ``Problem`` or its ``Operands``, which
  count as a call without dropout): ``fingerprint()`` and
  ``signature(ops)``, readable, ``|`` between them."""
  ops = getattr(problem, "ops", problem)
  dropout = getattr(problem, "dropout_rng", None) is not None  # dropout_on
  return _flat(fingerprint()) + "|" + _flat(signature(ops, dropout=dropout))


def _valid(entry) -> bool:
  blocks = entry.get("blocks") if isinstance(entry, dict) else None
  return (isinstance(blocks, list) and len(blocks) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                  for b in blocks))


def _read(path: pathlib.Path) -> dict[str, dict[str, Any]]:
  """The file's entries; ``{}`` (with a warning) for one we cannot use."""
  try:
    text = path.read_text(encoding="utf-8")
  except FileNotFoundError:
    return {}
  except OSError as e:
    warnings.warn(f"cannot read the flash block cache {path} ({e}); the "
                  "default blocks run.", stacklevel=3)
    return {}
  try:
    data = json.loads(text)
  except ValueError as e:
    warnings.warn(f"the flash block cache {path} is not valid JSON ({e}): "
                  "ignored, the default blocks run; the next "
                  "aj.kernels.autotune(...) replaces it.", stacklevel=3)
    return {}
  if not (isinstance(data, dict) and data.get("version") == VERSION
          and isinstance(data.get("entries"), dict)):
    found = data.get("version") if isinstance(data, dict) else None
    warnings.warn(f"the flash block cache {path} is not a version-{VERSION} "
                  f"cache (version {found!r}): ignored, the default blocks "
                  "run; the next aj.kernels.autotune(...) replaces it.",
                  stacklevel=3)
    return {}
  return {k: v for k, v in data["entries"].items() if _valid(v)}


def forget() -> None:
  """Drops what this process read, so the next lookup reads the files
  again (after another process tuned, or the file was edited)."""
  _MEMORY.clear()


def store(key: str, entry: dict[str, Any]) -> pathlib.Path | None:
  """Writes ``entry`` (with ``"blocks": [block_q, block_k]``) under ``key``.

  Merged into the file as it is on disk now (another process may have
  written since we read it), written to a temporary file beside it and
  moved over it (``os.replace`` is atomic): a reader sees the old file or
  the new one. Returns the path, or None when the cache is ``off``.
  """
  path = cache_path()
  if path is None:
    return None
  entries = dict(_read(path))
  entries[key] = entry
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                             suffix=".tmp")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump({"version": VERSION, "entries": entries}, f, indent=1,
                sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
  _MEMORY[str(path)] = entries
  return path


def lookup(problem) -> tuple[int, int] | None:
  """The cached ``(block_q, block_k)`` of a call, or None.

  ``problem``: a ``Problem`` or its ``Operands``. Never times anything;
  the first call of a process reads the cache file, later ones build the
  key (a few attribute reads and a string) and look it up in memory. A
  paged call is not keyed (its key blocks are pages): None.
  """
  if getattr(problem, "pages", None) is not None:
    return None
  path = _path(os.environ.get(ENV), os.environ.get("XDG_CACHE_HOME"),
               os.environ.get("HOME"))  # (cache_path, without a call more)
  if path is None:
    return None
  entries = _MEMORY.get(str(path))
  if entries is None:  # read once per process, then from memory
    entries = _MEMORY[str(path)] = _read(path)
  if not entries:  # nothing tuned: no key to build
    return None
  entry = entries.get(cache_key(problem))
  return None if entry is None else tuple(entry["blocks"])


def blocks(problem, block_q: int | None = None,
           block_k: int | None = None) -> FlashBlocks:
  """The blocks a flash call runs (what ``Flash.__call__`` asks).

  In order: a ``BlockMask``'s own sizes (its tables were built at them;
  given sizes must match, ``flash_core.block_sizes`` says so), the sizes
  given (one given: the other is the default, since a cached pair was
  timed as a pair), this machine's cached pair for this call (``lookup``),
  else ``flash_core.block_sizes``' defaults.

  Args:
    problem: the call's ``Problem`` (or its ``Operands``).
    block_q: the kernel's ``block_q``, or None.
    block_k: the kernel's ``block_k``, or None.

  Returns:
    A ``FlashBlocks``.
  """
  ops = getattr(problem, "ops", problem)
  bm = ops.rule
  if bm is not None and bm.kinds is not None:
    return FlashBlocks(*flash_core.block_sizes(ops, block_q, block_k),
                       "block_mask")
  if block_q is not None or block_k is not None:
    return FlashBlocks(*flash_core.block_sizes(ops, block_q, block_k),
                       "given")
  cached = lookup(problem)
  if cached is not None:
    return FlashBlocks(*cached, "cache")
  return FlashBlocks(*flash_core.block_sizes(ops, None, None), "defaults")
