"""T5's three attentions: encoder, decoder and cross, with the relative bias.

Shape glossary: D model dim (``d_model``), N heads (``num_heads``), H head
dim (``d_kv``; ``N * H`` may differ from ``D``), R relative position buckets
(``relative_attention_num_buckets``).

What HF's ``modeling_t5.py`` (``T5Attention``) computes, per ``attention=``:

- ``"encoder"`` (``encoder.block.{i}.layer.0.SelfAttention.``):
  bidirectional, no mask, T5's relative position bias with bidirectional
  buckets;
- ``"decoder"`` (``decoder.block.{i}.layer.0.SelfAttention.``): causal, the
  bias with causal buckets (a key after the query shares bucket 0);
- ``"cross"`` (``decoder.block.{i}.layer.1.EncDecAttention.``): the decoder
  attending to the encoder output (``module()(x, encoder_output)``), no mask
  and no bias.

All three: ``q``, ``k``, ``v`` ``[N * H, D]`` and ``o`` ``[D, N * H]``
without biases, and no ``1 / sqrt(H)`` (``scale=1.0``). The bias table
``relative_attention_bias.weight [R, N]`` lives only in block 0 of each
stack, and HF's later blocks reuse the position bias block 0 computed; so
layer ``i > 0`` reads block 0's table: the layer's prefix with
``block.{i}.`` replaced by ``block.0.``. It becomes ``params["t5_bias"] =
{"table": [R, N]}`` with ``options["t5_bias"] = aj.T5Bias(R,
relative_attention_max_distance, bidirectional)``.

- t5, mt5 (``modeling_mt5.py`` is a copy of T5's attention): one table per
  stack, as above.
- umt5 (``modeling_umt5.py``): every self-attention layer has a table of
  its own (``has_relative_attention_bias=True`` in every block), read under
  the layer's own prefix; otherwise as T5.

An old checkpoint's ``decoder.block.0.layer.1.EncDecAttention
.relative_attention_bias.weight`` (HF's ``_keys_to_ignore_on_load_unexpected``:
the cross attention never uses it) is checked for its shape and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_jax.interop.checkpoints import decoders
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.masking.mask import Mask
from attention_jax.scores import score_mods

# Where each attention of block {layer} lives, below the model's prefix.
PREFIXES = {
    "encoder": "encoder.block.{layer}.layer.0.SelfAttention.",
    "decoder": "decoder.block.{layer}.layer.0.SelfAttention.",
    "cross": "decoder.block.{layer}.layer.1.EncDecAttention.",
}
_TABLE = "relative_attention_bias.weight"
# The config classes' defaults (T5Config, MT5Config, UMT5Config) for the keys
# the attention reads, used only where a config leaves one out.
_DEFAULTS = {
    "t5": dict(d_model=512, d_kv=64, num_heads=8, num_layers=6,
               relative_attention_num_buckets=32,
               relative_attention_max_distance=128),
    "mt5": dict(d_model=512, d_kv=64, num_heads=6, num_layers=8,
                relative_attention_num_buckets=32,
                relative_attention_max_distance=128),
}
_DEFAULTS["umt5"] = _DEFAULTS["mt5"]
# The config classes' attribute_map: a config may name a key by its alias.
_ALIASES = {"d_model": "hidden_size", "num_heads": "num_attention_heads",
            "d_kv": "head_dim", "num_layers": "num_hidden_layers"}


def _int(cfg: Mapping[str, Any], name: str, family: str) -> int:
  """A size from the config (or its alias), else the config class's default.

  A config without ``model_type`` gets a default only where T5's, mT5's and
  umT5's agree (not ``num_heads``: 8 against 6).
  """
  alias = _ALIASES.get(name)
  if cfg.get(name) is None and alias and cfg.get(alias) is not None:
    name = alias
  if cfg.get(name) is not None:
    return reading.positive_int(cfg, name, family)
  model_type = cfg.get("model_type")
  kinds = ((model_type,) if model_type in _DEFAULTS
           else tuple(t for t in _DEFAULTS if t in _FAMILY_TYPES[family]))
  defaults = {t: _DEFAULTS[t][name] for t in kinds}
  values = set(defaults.values())
  if len(values) != 1:
    raise ValueError(
        f"config has no {name!r} and no model_type: the config classes of "
        f"{list(kinds)} default it differently ({defaults}), so the loader does "
        "not guess it; add it (the model's config.json has it) or the "
        "config's model_type.")
  return values.pop()


def _layers(cfg: Mapping[str, Any], family: str, layer: int,
            attention: str) -> None:
  """Checks ``layer`` against the stack's depth: the encoder has
  ``num_layers`` blocks, the decoder ``num_decoder_layers`` (HF's default:
  ``num_layers``)."""
  key = "num_layers" if attention == "encoder" else "num_decoder_layers"
  count = cfg.get(key)
  if count is None:
    key, count = "num_layers", _int(cfg, "num_layers", family)
  if layer >= count:
    raise ValueError(
        f"layer={layer} is out of range for the {attention} attention: the "
        f"config's {key}={count} ({'encoder' if attention == 'encoder' else 'decoder'}"
        f" blocks 0..{count - 1}).")


def _block0(read: reading.Reader, layer: int) -> reading.Reader:
  """A reader of block 0 of the layer's stack: the layer's prefix with its
  last ``block.{layer}.`` made ``block.0.`` (the table's only home)."""
  marker = f"block.{layer}."
  i = read.prefix.rfind(marker)
  while i > 0 and read.prefix[i - 1] != ".":  # not e.g. "subblock.1."
    i = read.prefix.rfind(marker, 0, i)
  if i < 0:
    raise ValueError(
        f"prefix {read.prefix!r} (layer {layer}) has no 'block.{layer}.': "
        f"T5 keeps its relative position table only in block 0 of each "
        f"stack ({PREFIXES['encoder'].format(layer=0) + _TABLE!r}), and the "
        "loader finds block 0 by replacing the layer's 'block.{layer}.' "
        "with 'block.0.'. Pass the state dict with HF's names "
        "('encoder.block.{i}.layer.0.SelfAttention.', ...).")
  prefix = read.prefix[:i] + "block.0." + read.prefix[i + len(marker):]
  return reading.Reader(read.state, prefix, read.spec, 0, read.known)


def _table(read: reading.Reader, family: str, layer: int, attention: str,
           buckets: int, n: int, notes: list[str]):
  """The relative position table ``[R, N]`` this self-attention layer uses."""
  shape = (buckets, n)
  why = (f"relative position table [relative_attention_num_buckets, "
         f"num_heads] = [{buckets}, {n}]")
  if family == "umt5" or layer == 0:  # the layer's own
    notes.append(f"own relative position table ({attention})")
    return read.get(_TABLE, shape, why)
  if read.prefix + _TABLE in read.state:
    raise ValueError(
        f"state_dict has {read.prefix + _TABLE!r}: a relative position "
        f"table in block {layer}, but T5 (and mT5) keep one only in block "
        "0 of each stack and every later block reuses it. A table in "
        "every block is umT5's layout: pass family='umt5' (and its config, "
        "model_type 'umt5').")
  notes.append(f"block 0's relative position table ({attention})")
  return _block0(read, layer).get(
      _TABLE, shape, f"{why}; T5's later blocks reuse block 0's")


def _build(cfg: Mapping[str, Any], family: str, layer: int,
           read: reading.Reader, overrides: Mapping[str, Any],
           attention: str) -> registry.Built:
  """One T5 attention's params, ``MultiHeadAttention`` options and notes."""
  _layers(cfg, family, layer, attention)
  d = _int(cfg, "d_model", family)
  n = _int(cfg, "num_heads", family)
  h = _int(cfg, "d_kv", family)
  dims = f"d_model={d}, num_heads={n}, d_kv={h}"
  params = {}
  for name in ("q", "k", "v"):
    w = read.get(f"{name}.weight", (n * h, d),
                 f"[num_heads * d_kv, d_model]; {dims}")
    params[f"W_{name}"] = {"kernel": w.T.reshape(d, n, h)}  # [D, N, H]
  w = read.get("o.weight", (d, n * h), f"[d_model, num_heads * d_kv]; {dims}")
  params["W_o"] = {"kernel": w.T.reshape(n, h, d)}  # [N, H, D]
  # T5 folds the scale into its initialisation: scores are q.k, unscaled.
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=n,
                                 head_dim=h, use_bias=False, scale=1.0,
                                 rope=None)
  notes = [f"{family} {attention} attention: no biases, scale 1"]
  if "mask" not in overrides:
    options["mask"] = Mask(causal=True) if attention == "decoder" else None
  if attention == "cross":
    if "t5_bias" in overrides:
      raise ValueError(
          "overrides['t5_bias'] on a cross attention: T5's cross attention "
          "has no relative table (HF gives it none); the encoder's and the "
          "decoder's self-attentions do.")
    if layer == 0 and read.prefix + _TABLE in read.state:
      # HF ignores it on load (_keys_to_ignore_on_load_unexpected).
      read.get(_TABLE, (_int(cfg, "relative_attention_num_buckets", family),
                        n), "an old checkpoint's unused cross table")
      notes.append("unused cross-attention table ignored, as HF does")
  else:
    given = overrides.get("t5_bias")  # a port's settings, else the config's
    buckets = (given.num_buckets if given is not None
               else _int(cfg, "relative_attention_num_buckets", family))
    params["t5_bias"] = {"table": _table(read, family, layer, attention,
                                         buckets, n, notes)}
    if given is not None:
      options["t5_bias"] = given
      return _finish(read, params, options, notes, overrides, n, h)
    distance = _int(cfg, "relative_attention_max_distance", family)
    # HF's buckets: bidirectional in the encoder (is_decoder False), causal
    # in the decoder, whatever the top-level config's is_decoder says.
    bidirectional = attention == "encoder"
    try:
      options["t5_bias"] = score_mods.T5Bias(buckets, distance, bidirectional)
    except ValueError as e:
      raise ValueError(
          f"config relative_attention_num_buckets={buckets}, "
          f"relative_attention_max_distance={distance} ({attention}): {e}"
      ) from e
  return _finish(read, params, options, notes, overrides, n, h)


def _finish(read, params, options, notes, overrides, n: int,
            h: int) -> registry.Built:
  """qk-norm and sinks where a port's overrides add them."""
  decoders.read_norms(read, params, options, notes,
                      overrides.get("normalize_qk"), n=n, k=n, h=h)
  if overrides.get("attention_sinks", False):
    decoders.read_sinks(read, params, options, notes, n)
  return params, options, "; ".join(notes)


_FAMILY_TYPES = {"t5": ("t5", "mt5"), "umt5": ("umt5",)}


def _family(name: str, maps: str) -> registry.Family:
  def build(cfg, layer, read, overrides, attention):
    return _build(cfg, name, layer, read, overrides, attention)
  return registry.Family(
      name=name, model_types=_FAMILY_TYPES[name],
      reads=("relative_attention_num_buckets",
             "relative_attention_max_distance"), build=build,
      prefix=PREFIXES, anchor="q.weight", maps=maps,
      layer_count={"encoder": "num_layers", "decoder": "num_decoder_layers",
                   "cross": "num_decoder_layers"},
      attentions=tuple(PREFIXES))


FAMILIES = (
    _family("t5", "encoder (bidirectional), decoder (causal) and cross "
                  "attention; q/k/v/o without biases, scale 1; block 0's "
                  "relative position table shared by its stack"),
    _family("umt5", "as t5, with a relative position table in every "
                    "self-attention layer"),
)
