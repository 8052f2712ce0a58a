"""Real checkpoints' attention layers: HF state dicts and configs -> our layer.

Shape glossary: B batch, T length, N query heads, K key/value heads, H head
dim, D model (hidden) dim, L number of layers.

``load_attention_weights(state_dict, config=..., layer=i)`` reads one
layer's attention weights out of a Hugging Face transformers state dict and
the options the family's modeling code applies to that layer (its
``config.json``), and returns them as ``aj.MultiHeadAttention``'s options
and ``aj.multi_head_attention``'s params dict (``W_q`` kernel ``[D, N, H]``
... ``W_o`` kernel ``[N, H, D]``). One module per kind of layout says what
each family maps, as HF's ``modeling_<family>.py`` computes it:
``decoders`` (Llama-style families), ``multimodal`` (the Qwen-VL text
models, M-RoPE), ``others`` (StableLM, OLMo, OLMoE, Phi, BitNet),
``fused_layouts`` (GPT-BigCode, DBRX, MPT, Persimmon), ``encoders``
(ModernBERT), ``gpt`` (GPT-2 and its descendants' fused layouts), ``t5``
(encoder, decoder and cross attention with the relative bias), ``latent``
(DeepSeek-V2/V3 into ``aj.MultiHeadLatentAttention``); ``registry`` holds
the ``Family`` record each fills in, ``reading`` and ``config_rope`` what
they share. docs/families.md lists them.

Nothing is mapped by a guess: the family is ``family=`` or the config's
``model_type`` (neither: refused, with the families whose weights the state
dict has); a config of another model type is refused (a look-alike family
can differ where the weights do not show it, e.g. Cohere's interleaved
rotary pairs), and so is a config setting a key that changes some family's
attention and that this family does not read (``registry.SIGNS``), a config
without ``model_type`` that lacks the keys its family's class always writes
(``Family.requires``), a rope field its rope type does not read, a fused
q/k/v weight the family does not read, weights laid out as another
family's (named, as the ``family=`` to pass), a size whose default differs
between config classes, rope parameters the layer's type has no entry for,
and a scaled rope without a pretraining length (nor transformers' fallback
for it). ``overrides=`` replaces what the loader inferred (``OVERRIDABLE``)
for a port that knows better.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import difflib
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.interop.checkpoints.families import FAMILIES
from attention_jax.layers import multi_head
from attention_jax.layers.latent_module import MultiHeadLatentAttention
from attention_jax.layers.multi_head_module import MultiHeadAttention
from attention_jax.layers.qk_norm import QKNorm
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import score_mods

# The inferred options a port may replace (overrides=); sizes, use_bias and
# the output gate follow the weights' shapes and the config.
OVERRIDABLE = ("rope", "mask", "scale", "logits_soft_cap", "normalize_qk",
               "attention_sinks", "score_mod", "t5_bias")
# The options that are the checkpoint's (not to be overridden by module()).
_FIXED = ("d_model", "num_heads", "num_kv_heads", "head_dim", "use_bias",
          "normalize_qk", "mask", "scale", "logits_soft_cap",
          "attention_sinks", "rope", "score_mod", "output_gate", "t5_bias",
          "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
          "qk_rope_head_dim", "v_head_dim", "out_features", "clip_qkv",
          "value_norm", "output_norm", "kv_shared")


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedAttention:
  """One checkpoint layer's attention: options and parameters.

  Attributes:
    family: the family it was read as (one of ``FAMILIES``).
    attention: which attention of the layer (``"self"``; T5: ``"encoder"``,
      ``"decoder"``, ``"cross"``).
    layer: the layer index.
    prefix: the state-dict prefix its weights were read under, e.g.
      ``"model.layers.3.self_attn."``.
    params: ``aj.multi_head_attention``'s params dict (its arrays only:
      calling the function with them takes the ``options`` too, e.g.
      ``qk_norm=options["normalize_qk"]``, ``scale=``, ``rope=``, as
      ``.module()`` does) (``W_q``, ``W_k``,
      ``W_v``, ``W_o``, with ``q_norm``/``k_norm`` for qk-norm and
      ``sinks`` ``{"logits": [N]}`` for learned sinks), jnp arrays: all the
      layer's weights.
    options: ``aj.MultiHeadAttention`` keyword arguments that reproduce the
      layer (``d_model``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
      ``use_bias``, ``normalize_qk``, ``mask``, ``scale``,
      ``logits_soft_cap``, ``attention_sinks``, ``rope``, ``param_dtype``).
    kv_source: the layer whose keys and values this one attends over (a
      ``kv_shared=True`` layer: Gemma 3n's last layers), else None: call
      its module with ``shared_kv=`` that layer's ``shared_kv(x)`` (or,
      decoding, that layer's module).
  """

  family: str
  layer: int
  prefix: str
  params: multi_head.Params
  options: Mapping[str, Any]
  attention: str = "self"
  kv_source: int | None = None

  @property
  def sinks(self) -> jax.Array | None:
    """The learned sink logits ``[N]`` (gpt-oss), read from ``params``
    (``params["sinks"]["logits"]``), else None."""
    return self.params.get("sinks", {}).get("logits")

  def module(self, *, rngs: nnx.Rngs | None = None,
             **overrides) -> MultiHeadAttention | MultiHeadLatentAttention:
    """An ``aj.MultiHeadAttention`` (DeepSeek-V3:
    ``aj.MultiHeadLatentAttention``) holding this layer's weights.

    Args:
      rngs: for the module's construction (its parameters are then
        replaced, so only a dropout stream draws from it); default
        ``nnx.Rngs(0)``.
      **overrides: other ``MultiHeadAttention`` options (``dtype``,
        ``param_dtype``, ``attention_fn``, ``precision``, ``head_axis``,
        ``dropout_rate``, ...). The options that make up the checkpoint's
        attention (``_FIXED``: sizes, mask, scale, soft cap, sinks, rope)
        are refused here: ``load_attention_weights(..., overrides=)``
        replaces those it infers.

    Raises:
      ValueError: an override of a checkpoint option.
    """
    fixed = sorted(set(overrides) & set(_FIXED))
    if fixed:
      have = ", ".join(f"{k}={self.options.get(k)!r}" for k in fixed)
      raise ValueError(
          f"module() options {fixed} are the checkpoint's (this {self.family} "
          f"layer has {have});"
          f" pass overrides= to load_attention_weights to change "
          f"{[k for k in fixed if k in OVERRIDABLE] or list(OVERRIDABLE)} "
          "(sizes and use_bias follow the weights).")
    options = {**self.options, **overrides}
    cls = (MultiHeadLatentAttention
           if FAMILIES[self.family].module == "latent" else MultiHeadAttention)
    mha = cls(**options, rngs=nnx.Rngs(0) if rngs is None else rngs)
    mha.load_params(self.params)  # sinks included
    return mha


def _as_dict(config) -> dict[str, Any]:
  """The config as a dict (a transformers config object or a mapping)."""
  if isinstance(config, Mapping):
    return dict(config)
  if hasattr(config, "to_dict") and callable(config.to_dict):
    return dict(config.to_dict())
  raise TypeError(
      f"config must be a dict (e.g. json.load of config.json) or a "
      f"transformers config object, got {type(config).__name__}.")


def _owner(model_type) -> str | None:
  """The family that reads configs of ``model_type``, or None."""
  owners = [f for f in FAMILIES if model_type in FAMILIES[f].model_types]
  return owners[0] if owners else None


def _nearest(name: str) -> str:
  """`` (nearest: 'x')`` for a name like a known family or model type."""
  known = sorted({*FAMILIES, *(t for f in FAMILIES.values()
                                for t in f.model_types)})
  close = difflib.get_close_matches(str(name).lower(), known, n=1,
                                    cutoff=0.6)
  if not close:
    return ""
  owner = _owner(close[0]) or close[0]
  return (f" The nearest supported family is {owner!r}"
          + (f" (model_type {close[0]!r})" if close[0] != owner else "")
          + ": pass it only if this model's attention is that family's.")


def _unknown_model_type(model_type, text) -> ValueError:
  hint = ""
  if isinstance(text, Mapping) and _owner(text.get("model_type")):
    hint = (f" Its text_config has model_type {text['model_type']!r}: for "
            "the language model's layers pass config['text_config'].")
  return ValueError(
      f"config has model_type={model_type!r}, which load_attention_weights "
      f"does not read: it maps the families {list(FAMILIES)} and no other "
      "model by a guess, since a look-alike can differ where the weights "
      f"do not show it (e.g. interleaved rotary pairs).{hint}"
      f"{_nearest(model_type)} To use this model, {registry.BY_HAND}.")


def _config_dict(cfg: dict[str, Any], family: str) -> dict[str, Any]:
  """The config the declared ``family`` reads: its own (a multimodal
  config's ``text_config`` where that is the family's), checked to be one
  (``model_type``) and to set nothing the family does not read."""
  text = cfg.get("text_config")
  spec = FAMILIES[family]
  if (isinstance(text, Mapping)  # the family's own multimodal model
      and cfg.get("model_type") in spec.model_types  # (Gemma 3, Llama 4)
      and text.get("model_type") in spec.model_types):
    cfg = dict(text)
  model_type = cfg.get("model_type")
  if model_type is not None and model_type not in spec.model_types:
    owner = _owner(model_type)
    if owner:
      raise ValueError(
          f"config has model_type={model_type!r}, but family={family!r} "
          f"reads configs of model_type {list(spec.model_types)}: this is a "
          f"{owner} config, pass family={owner!r} (or leave family out: "
          "the config's model_type names it).")
    raise _unknown_model_type(model_type, text)
  missing = [k for k in spec.requires if k not in cfg]
  if model_type is None and missing:
    have = ("nothing in its config tells it apart from a look-alike whose "
            "code differs" if missing == ["model_type"] else
            f"every {family} config has {missing}, and this one does not")
    raise ValueError(
        f"config has no model_type, and {have}: reading it as {family} "
        f"would be a guess. Give the config its model_type (its "
        f"config.json's) if it is a {family} model; otherwise pass the "
        "family its model_type names.")
  # A config of the family's own model type may carry keys its code
  # ignores (spec.ignores); one without model_type must not.
  unread = [k for k in spec.unread(cfg)
            if model_type is None or k not in spec.ignores]
  if model_type is None:
    unread = sorted({*unread, *(k for k in spec.ignores
                                if k in registry.present_signs(cfg))})
  if unread:
    said = ("config has no model_type, and it" if model_type is None
            else f"config (model_type={model_type!r})")
    raise ValueError(
        f"{said} sets "
        + ", ".join(f"{k}={registry.sign_value(cfg, k)!r} "
                    f"({registry.SIGNS[k]})" for k in unread)
        + f", which {family} attention does not read: {family}'s modeling code "
        "would ignore it, so these numbers would not be the model's. It is "
        "another model's config: pass the family its model_type names "
        "(aj.interop.checkpoints.FAMILIES lists them, docs/families.md says "
        "what each reads), or, if the key is a leftover this model does not "
        f"use, remove it from the config; for any other model, "
        f"{registry.BY_HAND}.")
  return cfg


def _declared(cfg: dict[str, Any], family, state_dict) -> str:
  """The family: ``family=`` or the config's ``model_type``; neither is
  refused with the families whose weights the state dict has."""
  if family is not None:
    return _family(family)
  model_type = cfg.get("model_type")
  text = cfg.get("text_config")
  if model_type is None:
    candidates = reading.families_with_weights(state_dict, FAMILIES)
    raise ValueError(
        "config has no model_type and no family= was given: the loader "
        "does not guess a family from keys that look alike. Pass family= "
        "(the model_type of its config.json names it)"
        + (f"; the state dict's weights are named as {candidates}'s"
           if candidates else "") + f". Families: {list(FAMILIES)}.")
  owner = _owner(model_type)
  if owner is None and isinstance(text, Mapping):
    inner = _owner(text.get("model_type"))
    if inner and model_type in FAMILIES[inner].model_types:
      owner = inner
  if owner is None:
    raise _unknown_model_type(model_type, text)
  return owner


def _family(family) -> str:
  if not isinstance(family, str):
    raise TypeError(f"family must be a string, one of {list(FAMILIES)}; got "
                    f"{family!r}.")
  name = family.lower().replace("-", "_")
  if name not in FAMILIES:
    raise ValueError(f"unknown family {family!r}: known families are "
                     f"{list(FAMILIES)}.{_nearest(name)} For another model, "
                     f"{registry.BY_HAND}.")
  return name


def _overrides(overrides) -> dict[str, Any]:
  """``overrides=`` checked: known names; bools bools; rope as an aj.Rope."""
  if overrides is None:
    return {}
  if not isinstance(overrides, Mapping):
    raise TypeError(f"overrides must be a dict of aj.MultiHeadAttention "
                    f"options (names {list(OVERRIDABLE)}), got "
                    f"{type(overrides).__name__}.")
  unknown = sorted(str(k) for k in overrides if k not in OVERRIDABLE)
  if unknown:
    window = (" (a window W is mask=aj.Mask(causal=True, window=(W - 1, "
              "0)))" if "window" in unknown else "")
    raise ValueError(
        f"overrides has {unknown}, which load_attention_weights does not "
        f"infer: the options it can override are {list(OVERRIDABLE)}"
        f"{window}. Sizes and use_bias follow the weights' shapes and the "
        "config; other options (dtype, precision, attention_fn, "
        "dropout_rate, ...) go to .module().")
  out = dict(overrides)
  if "attention_sinks" in out:
    if not isinstance(out["attention_sinks"], (bool, np.bool_)):
      raise TypeError(f"overrides['attention_sinks'] must be a bool "
                      f"(whether the layer has them), got "
                      f"{out['attention_sinks']!r}.")
    out["attention_sinks"] = bool(out["attention_sinks"])
  if "normalize_qk" in out:
    value = out["normalize_qk"]
    if isinstance(value, np.bool_):
      value = bool(value)
    if not isinstance(value, (bool, QKNorm)):
      raise TypeError(f"overrides['normalize_qk'] must be a bool or an "
                      f"aj.QKNorm (the layer's qk-norm), got {value!r}.")
    out["normalize_qk"] = value
  if "rope" in out:
    out["rope"] = rope_lib.as_rope(out["rope"])
  if "t5_bias" in out and not isinstance(out["t5_bias"], score_mods.T5Bias):
    raise TypeError(f"overrides['t5_bias'] must be an aj.T5Bias(num_buckets, "
                    f"max_distance, bidirectional), got {out['t5_bias']!r}.")
  return out


def load_attention_weights(
    state_dict: Mapping[str, Any],
    *,
    config: Any,
    layer: int,
    family: str | None = None,
    prefix: str | None = None,
    dtype: jnp.dtype | None = None,
    overrides: Mapping[str, Any] | None = None,
    attention: str = "self",
) -> LoadedAttention:
  """One layer's attention of an HF checkpoint, as our layer's options and params.

  Args:
    state_dict: HF names to arrays: a model's ``state_dict()`` (torch
      tensors, any device, bfloat16 included) or NumPy arrays (e.g. from
      ``safetensors.numpy.load_file``). Only the layer's attention entries
      are read; every other entry under its prefix must be one this
      family's attention uses (an unused ``o_proj.bias`` is an error, not
      ignored).
    family: one of ``FAMILIES`` (``"-"`` reads as ``"_"``; docs/families.md
      lists them with what each maps), e.g. ``"llama"``, ``"qwen3"``,
      ``"gemma3"``, ``"granite"``, ``"deepseek_v3"``; None (the default):
      the family whose model types include the config's ``model_type``.
    config: the model's config: a dict (``json.load`` of its
      ``config.json``; old ``rope_scaling``/``rope_theta`` or new
      ``rope_parameters`` format) or a transformers config object (read via
      ``to_dict()``); a multimodal Gemma 3 or Llama 4 config's
      ``text_config`` is used.
    layer: the layer index, ``0 <= layer < num_hidden_layers``.
    prefix: the layer's attention prefix in ``state_dict`` (e.g.
      ``"model.layers.3.self_attn."``); by default found as the one key
      ending in the family's layer prefix and a weight every layer has
      (``layers.{layer}.self_attn.q_proj.weight``; GPT-2:
      ``h.{layer}.attn.c_attn.weight``), which covers ``model.``,
      ``model.language_model.`` and base-model (no prefix) checkpoints.
    dtype: the params' dtype; None keeps the checkpoint's (bfloat16 stays
      bfloat16). Also the module's ``param_dtype``.
    overrides: ``aj.MultiHeadAttention`` options that replace what the
      loader infers from the config, by name (``OVERRIDABLE``): ``rope``
      (an ``aj.Rope``, a base, or None; the config's rope is then not read,
      so an unsupported rope type there is no obstacle), ``mask`` (an
      ``aj.Mask``: a window ``W`` is ``aj.Mask(causal=True, window=(W - 1,
      0))``), ``scale``, ``logits_soft_cap``, ``normalize_qk`` (True reads
      ``q_norm.weight``/``k_norm.weight [H]`` under the prefix, as
      ``aj.QKNorm()``; an ``aj.QKNorm`` reads the weights it names; False
      drops the family's), ``attention_sinks`` (True reads ``sinks [N]``),
      ``score_mod`` (e.g. ALiBi, Llama 4's temperature) and ``t5_bias``
      (T5's bucket settings, an ``aj.T5Bias``). For a port whose modeling
      code differs from the family's in these only, e.g. ``{"rope":
      aj.Rope(base=1e4, interleaved=True)}``. Sizes, ``use_bias`` and the
      output gate follow the weights and the config.
    attention: which attention of the layer: ``"self"``; T5 and umT5:
      ``"encoder"``, ``"decoder"`` (self-attention) or ``"cross"`` (the
      decoder's attention to the encoder output: call the module with it
      as the key/value input).

  Returns:
    A ``LoadedAttention``: ``.params`` (``aj.multi_head_attention``'s
    params dict), ``.options`` (``aj.MultiHeadAttention`` keywords),
    ``.sinks`` (``[N]`` or None, from ``.params``) and
    ``.module(rngs=...)``, the layer built.

  Raises:
    ValueError: an unknown family or model type (the nearest supported
      one named); neither ``family=`` nor a ``model_type`` (the families
      whose weights the state dict has named); a config of another model
      type, or setting a key this family does not read (``registry.SIGNS``),
      or without ``model_type`` and lacking the keys its family's configs
      always have (``Family.requires``); a rope field its rope type does not
      read; a fused q/k/v weight, an unknown ``overrides`` name (the valid
      ones listed), a missing config key, an option we cannot
      reproduce (a rope type without an ``aj.Rope`` scaling, bidirectional
      Gemma, a Qwen3-Next linear-attention layer); a missing or
      unused state-dict key (named with the prefix); a wrong shape (named,
      with the expected one).
    TypeError: ``config`` neither a dict nor a config object; ``layer`` not
      an int; ``overrides`` not a mapping, or a bool override that is not a
      bool.

  Example:
    >>> D, N, K, H = 8, 2, 1, 4
    >>> rng = np.random.default_rng(0)
    >>> w = lambda *shape: rng.normal(size=shape).astype(np.float32)
    >>> p = "model.layers.0.self_attn."
    >>> sd = {p + "q_proj.weight": w(N * H, D), p + "k_proj.weight": w(K * H, D),
    ...       p + "v_proj.weight": w(K * H, D), p + "o_proj.weight": w(D, N * H)}
    >>> cfg = {"hidden_size": D, "num_attention_heads": N,
    ...        "num_key_value_heads": K, "num_hidden_layers": 1,
    ...        "sliding_window": 4, "rope_theta": 10000.0}
    >>> loaded = load_attention_weights(sd, family="mistral", config=cfg,
    ...                                 layer=0)
    >>> loaded.options["mask"].window, loaded.options["use_bias"]
    ((3, 0), False)
    >>> loaded.params["W_q"]["kernel"].shape      # [D, N, H]
    (8, 2, 4)
    >>> loaded.module()(jnp.ones((1, 5, D))).shape
    (1, 5, 8)
  """
  if not isinstance(state_dict, Mapping):
    raise TypeError(f"state_dict must be a mapping of HF names to arrays "
                    f"(model.state_dict()), got {type(state_dict).__name__}.")
  raw = _as_dict(config)
  family = _declared(raw, family, state_dict)
  spec = FAMILIES[family]
  if attention not in spec.attentions:
    raise ValueError(
        f"attention={attention!r}, but {family} layers have "
        f"{list(spec.attentions)}"
        + ("" if len(spec.attentions) > 1 else
           " (only T5 has encoder, decoder and cross attentions)") + ".")
  if (overrides is not None and "t5_bias" in overrides
      and family not in ("t5", "umt5")):
    raise ValueError(
        f"overrides['t5_bias'] sets how distances fall into a T5 relative "
        f"table's buckets; {family} layers have no such table (t5 and umt5 "
        "do).")
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
    raise TypeError(f"layer must be an int (the layer index), got {layer!r}.")
  layer = int(layer)
  overrides = _overrides(overrides)
  cfg = _config_dict(raw, family)
  count = cfg.get(spec.count_key(attention))
  if layer < 0 or (count is not None and layer >= count):
    raise ValueError(f"layer={layer} is out of range: the config has "
                     f"{count} layers (0 <= layer < {count}).")
  if prefix is None:
    prefix = reading.find_prefix(state_dict, spec, layer, attention,
                                 FAMILIES, cfg)
  elif not isinstance(prefix, str):
    raise TypeError(f"prefix must be a string such as "
                    f"'model.layers.{layer}.self_attn.', got {prefix!r}.")
  elif prefix and not prefix.endswith("."):
    prefix += "."
  read = reading.Reader(state_dict, prefix, spec, layer, FAMILIES, cfg)
  arrays, options, notes = spec.build(cfg, layer, read, overrides, attention)
  read.check_all_taken(notes)
  kv_source = options.pop("kv_source", None)
  options.update(overrides)
  options = {k: v for k, v in options.items() if v is not None
             or k in ("rope", "scale", "mask")}
  param_dtype = reading.dtype_of(next(iter(arrays.values())), dtype)
  params = {name: {entry: jnp.asarray(value, param_dtype)
                   for entry, value in entries.items()}
            for name, entries in arrays.items()}
  options["param_dtype"] = param_dtype
  return LoadedAttention(
      family=family, layer=layer, prefix=prefix, params=params,
      options=options, attention=attention, kv_source=kv_source)
