"""Decode rows beyond cache-vs-recompute: a shared prefix and latent attention.

Used by ``python -m benchmarks.decode`` (``--shared_prefix``, ``--latent``);
each function checks the fast path against the plain one before timing,
times with every program traced once, and returns rows plus a markdown table.

* ``shared_prefix_rows``: ``B`` sequences share a ``P``-token prompt and then
  decode ``G`` tokens each. ``concatenated``: one ``aj.MultiHeadAttention``
  KV cache per sequence holding its copy of the prompt and its own tokens
  (``[B, K, P + G, H]``), each step attending to all of it. ``shared
  prefix``: the prompt's keys and values projected once (``[1, K, P, H]``,
  ``aj.project_memory``), each sequence's own tokens in a ``[B, K, G, H]``
  cache; each step attends to the prompt (the batch's queries against one
  copy) and to its own tokens, merged exactly by ``aj.merge_attentions``.
* ``latent_rows``: ``aj.MultiHeadLatentAttention`` (DeepSeek-V2's latent
  cache, up-projections absorbed) against ``aj.MultiHeadAttention`` of the
  same width, cached decoding: tokens/s and cache bytes per token.

Shape glossary: B batch, P shared prompt, G generated tokens per sequence,
C context, D model dim, N heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import collections
import statistics
import textwrap
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import multi_head

# Both paths compute in float32 and differ in how the softmax over P + G
# keys is split (one pass, or two merged by their log-sum-exps): roundings
# of ~1e-6 relative, carried on by the unit-RMS feedback without growing.
CHECK_TOL = 1e-4


def next_token(out):
  """The next input: the output row ``[B, 1, D]`` at unit RMS (no
  vocabulary), so each step depends on the one before."""
  return out * jax.lax.rsqrt(jnp.mean(out * out, -1, keepdims=True) + 1e-6)


def _timed_generation(prefill, step, fresh, prompt, steps: int,
                      keep: bool = False):
  """``(prefill_s, decode_s, outputs)`` of one generation from ``fresh()``."""
  carry = fresh()
  jax.block_until_ready(carry)
  start = time.perf_counter()
  carry, token, out = prefill(carry, prompt)
  jax.block_until_ready(token)
  prefill_s = time.perf_counter() - start
  outs = [np.asarray(out)] if keep else []
  start = time.perf_counter()
  for _ in range(steps):
    carry, token, out = step(carry, token)
    if keep:
      outs.append(np.asarray(out))
  jax.block_until_ready(token)
  return prefill_s, time.perf_counter() - start, outs


def _module_programs(module, batch: int, context: int, traces, name: str):
  """Jitted cached prefill/step of a module with ``init_cache``/``decode``."""
  module.init_cache(batch, context)
  graphdef, state = nnx.split(module)

  def prefill(state, prompt):
    traces[f"{name}.prefill"] += 1
    m = nnx.merge(graphdef, state)
    out = m(prompt, decode=True)[:, -1:]  # [B, 1, D]
    return nnx.state(m), next_token(out), out

  def step(state, token):
    traces[f"{name}.step"] += 1
    m = nnx.merge(graphdef, state)
    out = m(token, decode=True)  # [B, 1, D]
    return nnx.state(m), next_token(out), out

  fresh = lambda: jax.tree.map(jnp.copy, state)
  return (jax.jit(prefill, donate_argnums=0), jax.jit(step, donate_argnums=0),
          fresh)


def _shared_prefix_programs(module, batch: int, steps: int, traces):
  """Prefill: project the ``[1, P, D]`` prompt once; step: prompt + own."""
  params = module.params_dict()
  dims = multi_head.param_dims(params)
  own_shape = (batch, dims.num_kv_heads, steps, dims.head_dim)  # [B, K, G, H]

  def prefill(carry, prompt):  # prompt [1, P, D], shared by the batch
    traces["shared.prefill"] += 1
    memory = aj.project_memory(params, prompt)  # [1, K, P, H] each
    out = aj.multi_head_attention(params, prompt[:, -1:], None, None,
                                  memory=memory)  # the prompt's last row
    out = jnp.broadcast_to(out, (batch, 1, out.shape[-1]))  # [B, 1, D]
    return (memory, *carry[1:]), next_token(out), out

  def step(carry, token):  # token [B, 1, D]
    traces["shared.step"] += 1
    memory, own_k, own_v, index = carry
    q = multi_head.project_heads(token, params["W_q"])  # [B, N, 1, H]
    k = multi_head.project_heads(token, params["W_k"])  # [B, K, 1, H]
    v = multi_head.project_heads(token, params["W_v"])
    own_k, own_v, _ = aj.update_kv_cache(own_k, own_v, index, k, v)
    index = index + 1  # [B], this step's token included
    shared = aj.scaled_dot_product_attention(
        q, memory.key, memory.value, return_lse=True)  # prompt keys, batch 1
    own = aj.scaled_dot_product_attention(
        q, own_k, own_v, aj.Mask(kv_lengths=index), return_lse=True)
    heads, _ = aj.merge_attentions([shared[0], own[0]],
                                   [shared[1], own[1]])  # [B, N, 1, H]
    out = multi_head.output_projection(heads, params["W_o"])  # [B, 1, D]
    return (memory, own_k, own_v, index), next_token(out), out

  def fresh():
    zeros = jnp.zeros(own_shape, jnp.float32)
    return (None, zeros, jnp.zeros_like(zeros), jnp.zeros((batch,), jnp.int32))

  return (jax.jit(prefill), jax.jit(step, donate_argnums=0), fresh)


def _check(outs: dict[str, list], what: str) -> float:
  a, b = (np.stack(o) for o in outs.values())
  diff = float(np.max(np.abs(a - b)))
  if not np.allclose(a, b, atol=CHECK_TOL, rtol=CHECK_TOL):
    raise RuntimeError(f"{what}: the two paths differ by {diff:.3g} "
                       f"(tolerance {CHECK_TOL}).")
  return diff


def _check_traces(traces, names) -> None:
  want = {f"{n}.{p}": 1 for n in names for p in ("prefill", "step")}
  if dict(traces) != want:
    raise RuntimeError(f"traced {dict(traces)}, expected each program once "
                       "(a retrace per step would time compilation).")


def shared_prefix_rows(batch: int = 8, prefix: int = 1024, steps: int = 64,
                       d_model: int = 256, num_heads: int = 8,
                       repeats: int = 1, check_steps: int = 4):
  """Rows ``{mode, batch, prefix, steps, prefill_ms, tokens_per_s,
  speedup, check_max_diff}`` for ``concatenated`` and ``shared prefix``."""
  module = aj.MultiHeadAttention(d_model, num_heads, rngs=nnx.Rngs(0))
  traces = collections.Counter()
  prompt = jnp.asarray(np.random.default_rng(0).standard_normal(
      (1, prefix, d_model), np.float32))  # [1, P, D]
  copies = jnp.broadcast_to(prompt, (batch, prefix, d_model))  # [B, P, D]
  programs = {
      "concatenated": (*_module_programs(
          module, batch, prefix + steps, traces, "concatenated"), copies),
      "shared prefix": (*_shared_prefix_programs(module, batch, steps,
                                                 traces), prompt)}
  check_steps = min(check_steps, steps)
  outs = {mode: _timed_generation(pre, st, fresh, p, check_steps,
                                  keep=True)[2]
          for mode, (pre, st, fresh, p) in programs.items()}
  diff = _check(outs, "shared-prefix decoding against the concatenation")
  timed = {mode: [] for mode in programs}
  for _ in range(repeats):
    for mode, (pre, st, fresh, p) in programs.items():
      timed[mode].append(_timed_generation(pre, st, fresh, p, steps)[:2])
  _check_traces(traces, ("concatenated", "shared"))
  rows = []
  for mode in programs:
    prefill_s = statistics.median(t[0] for t in timed[mode])
    decode_s = statistics.median(t[1] for t in timed[mode])
    rows.append(dict(mode=mode, batch=batch, prefix=prefix, steps=steps,
                     prefill_ms=1e3 * prefill_s,
                     tokens_per_s=batch * steps / decode_s, speedup=None,
                     check_max_diff=diff))
  rows[1]["speedup"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
  return rows


def shared_prefix_table(rows) -> str:
  lines = ["| mode | B | shared prompt P | generated G | prefill (ms) | "
           "decode tokens/s | speed-up |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    lines.append(f"| {r['mode']} | {r['batch']} | {r['prefix']} | "
                 f"{r['steps']} | {r['prefill_ms']:.3g} | "
                 f"{r['tokens_per_s']:.4g} | {speedup} |")
  return "\n".join(lines)


def _paragraph(text: str) -> str:
  # Whole words only, as the main report: a flag is never split.
  return textwrap.fill(text, 76, break_long_words=False,
                       break_on_hyphens=False)


def shared_prefix_report(rows) -> str:
  r = rows[0]
  text = _paragraph(
      f"Shared prefix: B={r['batch']} sequences share a {r['prefix']}-token "
      f"prompt and generate {r['steps']} tokens each (one layer, float32). "
      "`concatenated` caches each sequence's copy of the prompt and attends "
      "to all of it; `shared prefix` projects the prompt once and merges "
      "attention over it with attention over each sequence's own tokens "
      "(`aj.merge_attentions`). Prefill: the whole prompt (B copies, or "
      "one). Their outputs agreed before timing (max |diff| "
      f"{r['check_max_diff']:.2g}).")
  return f"\n{text}\n\n{shared_prefix_table(rows)}\n"


def latent_config(d_model: int, num_heads: int) -> dict:
  """MLA sizes for a layer of width ``D`` with ``N`` heads of ``H = D // N``.

  DeepSeek-V2's proportions (``H`` 128: latent 512 = 4H, rotary 64 = H/2,
  full-rank queries as in V2-Lite).
  """
  h = d_model // num_heads
  return dict(kv_lora_rank=4 * h, qk_nope_head_dim=h,
              qk_rope_head_dim=max(2, h // 2 // 2 * 2), v_head_dim=h)


def _check_against_full_forward(module, prompt, outs) -> float:
  """Cached outputs against the module's uncached causal forward."""
  tokens = [jnp.asarray(next_token(jnp.asarray(o))) for o in outs[:-1]]
  seq = jnp.concatenate([prompt, *tokens], 1)  # [B, P + steps, D]
  full = np.asarray(module(seq, is_causal=True))[:, prompt.shape[1] - 1:]
  got = np.concatenate(outs, 1)
  diff = float(np.max(np.abs(full - got)))
  if not np.allclose(full, got, atol=CHECK_TOL, rtol=CHECK_TOL):
    raise RuntimeError(f"latent decoding differs from its full forward by "
                       f"{diff:.3g} (tolerance {CHECK_TOL}).")
  return diff


def latent_rows(batch: int = 8, context: int = 1024, d_model: int = 256,
                num_heads: int = 8, prompt_len: int = 1, repeats: int = 1,
                check_steps: int = 4):
  """Rows ``{layer, batch, context, prefill_ms, tokens_per_s,
  cache_bytes_per_token, check_max_diff}`` for ``MultiHeadAttention`` and
  ``MultiHeadLatentAttention`` of the same ``D`` and ``N``, cached decoding
  of ``context - prompt_len`` tokens."""
  config = latent_config(d_model, num_heads)
  builders = {
      "MultiHeadAttention": lambda: aj.MultiHeadAttention(
          d_model, num_heads, rngs=nnx.Rngs(0)),
      "MultiHeadLatentAttention": lambda: aj.MultiHeadLatentAttention(
          d_model, num_heads, rngs=nnx.Rngs(0), rope=None, **config)}
  traces = collections.Counter()
  prompt = jnp.asarray(np.random.default_rng(1).standard_normal(
      (batch, prompt_len, d_model), np.float32))
  steps = context - prompt_len
  programs, per_token, diffs = {}, {}, {}
  for name, build in builders.items():
    module = build()
    programs[name] = _module_programs(module, batch, context, traces, name)
    per_token[name] = _cache_bytes_per_token(module, context)
    outs = _timed_generation(*programs[name], prompt, min(check_steps, steps),
                             keep=True)[2]
    diffs[name] = _check_against_full_forward(build(), prompt, outs)
  timed = {name: [] for name in programs}
  for _ in range(repeats):
    for name, p in programs.items():
      timed[name].append(_timed_generation(*p, prompt, steps)[:2])
  _check_traces(traces, tuple(programs))
  rows = []
  for name in programs:
    rows.append(dict(
        layer=name, batch=batch, context=context,
        prefill_ms=1e3 * statistics.median(t[0] for t in timed[name]),
        tokens_per_s=batch * steps / statistics.median(
            t[1] for t in timed[name]),
        cache_bytes_per_token=per_token[name], check_max_diff=diffs[name],
        config=config))
  return rows


def _cache_bytes_per_token(module, context: int) -> int:
  """Bytes of the module's cache variables per cached token (one layer)."""
  caches = [v for _, v in nnx.to_flat_state(nnx.state(module, nnx.Cache))
            if np.ndim(v[...]) >= 3]  # the buffers, not index/overflow
  total = sum(np.asarray(v[...]).nbytes for v in caches)
  batch = np.shape(caches[0][...])[0]
  return total // (batch * context)


def latent_report(rows) -> str:
  r, c = rows[0], rows[0]["config"]
  text = _paragraph(
      f"Latent attention: `aj.MultiHeadLatentAttention` (latent "
      f"R={c['kv_lora_rank']}, rotary key Hr={c['qk_rope_head_dim']}, "
      f"Hn=Hv={c['v_head_dim']}, full-rank queries, up-projections absorbed "
      "while decoding) against `aj.MultiHeadAttention` of the same D and N; "
      f"B={r['batch']}, C={r['context']}, one layer, float32, cached "
      "decoding. Cache bytes per token are measured from the cache "
      "buffers. Each decode agreed with its layer's uncached forward before "
      f"timing (max |diff| {max(x['check_max_diff'] for x in rows):.2g}).")
  lines = ["| layer | B | C | prefill (ms) | decode tokens/s | cache bytes "
           "per token |", "|---|---|---|---|---|---|"]
  for x in rows:
    lines.append(f"| {x['layer']} | {x['batch']} | {x['context']} | "
                 f"{x['prefill_ms']:.3g} | {x['tokens_per_s']:.4g} | "
                 f"{x['cache_bytes_per_token']} |")
  return f"\n{text}\n\n" + "\n".join(lines) + "\n"
