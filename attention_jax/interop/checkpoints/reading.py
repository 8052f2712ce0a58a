"""Reading one layer's tensors and config values, with messages that name them.

Shape glossary: N query heads, K key/value heads, H head dim, D hidden size.
torch is never imported: tensors are converted through their
``.detach().cpu()`` NumPy view.
"""

from __future__ import annotations

from collections.abc import Mapping
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_jax.interop.checkpoints import registry

# Entries under a layer's prefix that no family's attention reads: old
# Llama-style checkpoints' rotary buffers.
IGNORED_PREFIX = "rotary_emb."


def as_numpy(x) -> np.ndarray:
  """A torch tensor (any device; bfloat16 included) or array as NumPy."""
  if hasattr(x, "detach"):  # a torch tensor, without importing torch
    x = x.detach().cpu()
    if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16 of its own
      return np.asarray(x.float().numpy()).astype(jnp.bfloat16)
    return np.asarray(x.numpy())
  return np.asarray(x)


def is_number(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, bool))


def require(cfg: Mapping[str, Any], name: str, family: str):
  if cfg.get(name) is None:
    raise ValueError(f"config has no {name!r}, which {family} attention "
                     f"needs; got keys {sorted(cfg)}.")
  return cfg[name]


def positive_int(cfg: Mapping[str, Any], name: str, family: str) -> int:
  value = require(cfg, name, family)
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < 1):
    raise ValueError(f"config[{name!r}] must be a positive int, got "
                     f"{value!r}.")
  return int(value)


def find_prefix(state: Mapping[str, Any], family: registry.Family, layer: int,
                attention: str, known: Mapping[str, registry.Family],
                config: Mapping[str, Any] | None = None) -> str:
  """The layer's attention prefix, found by its anchor weight's name."""
  tail = family.layer_prefix(layer, attention) + family.anchor
  found = sorted(k[:-len(family.anchor)] for k in state
                 if (k == tail or k.endswith("." + tail))
                 and "vision" not in k)  # a multimodal model's image tower
  if not found:
    refuse_fused(state, family, layer, prefix=None, known=known)
    if family.name == "qwen3_next":  # its linear-attention layers
      linear = f"layers.{layer}.linear_attn."
      if any(linear in k for k in state):
        raise ValueError(
            f"layer {layer} of this qwen3_next checkpoint is a linear "
            f"attention layer (Gated DeltaNet, {linear!r}), not softmax "
            "attention: load_attention_weights reads its full_attention "
            "layers (config['layer_types']).")
    refuse_other_family(state, family, tail, layer, known, config)
  if len(found) != 1:
    raise ValueError(
        f"state_dict has {'no key' if not found else 'several keys'} ending "
        f"in {tail!r}{'' if not found else f' (prefixes {found})'}: pass "
        f"prefix= (the layer's attention prefix, e.g. "
        f"{'model.' + family.layer_prefix(layer, attention)!r}).")
  return found[0]


def families_with_weights(state: Mapping[str, Any],
                          known: Mapping[str, registry.Family]) -> list[str]:
  """The families whose anchor weight (of any layer) the state dict has,
  e.g. ``["llama", "mistral", ...]`` for ``q_proj.weight`` names: what a
  refusal lists, never what the loader picks."""
  names = []
  for family in known.values():
    templates = ([family.prefix] if isinstance(family.prefix, str)
                 else list(family.prefix.values()))
    for template in templates:
      pattern = re.compile(
          r"(^|\.)" + re.escape(template).replace(r"\{layer\}", r"\d+")
          + re.escape(family.anchor) + "$")
      if any(pattern.search(k) and "vision" not in k for k in state):
        names.append(family.name)
        break
  return names


def look_alikes(state: Mapping[str, Any], family: registry.Family,
                layer: int, known: Mapping[str, registry.Family],
                config: Mapping[str, Any] | None = None,
                prefix: str | None = None) -> tuple[list[str], str]:
  """The other families whose anchor weight for layer ``layer`` the state
  dict has (under ``prefix`` if given), and that key.

  Families whose attention reads every sign key (``registry.SIGNS``) the
  config carries come first: a config with a sliding window points to the
  windowed families among those with the same weight names."""
  names, hit = [], ""
  for other in known.values():
    if other.name == family.name:
      continue
    for attention in other.attentions:
      if prefix is not None:  # the anchor under the prefix given
        keys = [prefix + other.anchor] if prefix + other.anchor in state else []
      else:
        tail = other.layer_prefix(layer, attention) + other.anchor
        keys = sorted(k for k in state if (k == tail or k.endswith(
            "." + tail)) and "vision" not in k)
      if keys:
        names.append(other.name)
        hit = hit or keys[0]
        break
  signs = {k for k in registry.SIGNS if (config or {}).get(k) is not None}

  def fit(name):  # a given prefix in the family's own pattern, then signs
    layout = known[name]
    placed = prefix is None or any(
        prefix.endswith(layout.layer_prefix(layer, a))
        for a in layout.attentions)
    return (not placed, bool(signs - set(layout.reads)))
  names.sort(key=fit)  # stable: FAMILIES' order among equals
  return names, hit


def refuse_other_family(state: Mapping[str, Any], family: registry.Family,
                        missing: str, layer: int,
                        known: Mapping[str, registry.Family],
                        config: Mapping[str, Any] | None = None,
                        prefix: str | None = None) -> None:
  """Raises if the family's anchor weight (``missing``) is not in the state
  dict but another family's is: the weights are that family's, and no
  prefix= would help."""
  names, key = look_alikes(state, family, layer, known, config, prefix)
  if not names:
    return
  others = ", ".join(names[1:])
  said = (config or {}).get("model_type")
  raise ValueError(
      f"state_dict has no key {'ending in ' if prefix is None else ''}"
      f"{missing!r} (the weight {family.name} layers are found by) but has "
      f"{key!r}: these look like another family's weights ({names[0]}"
      f"{'; the same names are also read by ' + others if others else ''}),"
      f" not {family.name}'s, and no prefix= changes that. Pass "
      f"family={names[0]!r} (or the family its config.json's model_type "
      "names)"
      + (f"; note the config says model_type={said!r}, so the config and the "
         "weights seem to be different models'" if said else "") + ".")


def refuse_fused(state: Mapping[str, Any], family: registry.Family,
                 layer: int, *, prefix: str | None,
                 known: Mapping[str, registry.Family]) -> None:
  """Raises if the layer's q/k/v are a fused weight this family does not read.

  Looks under ``prefix`` if given, else at keys of layer ``layer``: a key
  ``... .<layer>. ... .<fused name>.weight`` outside a vision tower.
  """
  hits = []
  for key in state:
    parts = key.split(".")
    if (len(parts) < 2 or parts[-1] != "weight"
        or parts[-2] not in registry.FUSED or parts[-2] in family.fused
        or "vision" in key or "visual" in key):
      continue
    if (key.startswith(prefix) if prefix is not None
        else str(layer) in parts[:-2]):
      hits.append(key)
  if not hits:
    return
  key = sorted(hits)[0]
  name = key.split(".")[-2]
  readers = [f.name for f in known.values() if name in f.fused]
  reads = f"{family.anchor} under {family.templates()}"
  hint = (f"load it with the family that reads it ({', '.join(readers)})"
          if readers else "load it with the family it belongs to")
  raise ValueError(
      f"state_dict has {key!r}: a fused q/k/v projection "
      f"({registry.FUSED[name]}). The {family.name} loader does not read "
      f"this layout (it reads {reads}), and no prefix= changes that. To "
      f"proceed: {hint}; or split it by hand into separate q, k and v "
      "weights (in the row order its modeling code uses) and pass that "
      f"state dict; or {registry.BY_HAND}.")


class Reader:
  """Takes a layer's tensors by name, with messages that name key and prefix."""

  def __init__(self, state: Mapping[str, Any], prefix: str,
               family: registry.Family, layer: int,
               known: Mapping[str, registry.Family],
               config: Mapping[str, Any] | None = None):
    self.state, self.prefix, self.known = state, prefix, known
    self.config = config
    self.spec, self.family, self.layer = family, family.name, layer
    self.taken: set[str] = set()

  def under(self) -> list[str]:
    return sorted(k for k in self.state if k.startswith(self.prefix))

  def get(self, name: str, shape: tuple[int, ...], why: str) -> np.ndarray:
    key = self.prefix + name
    if key not in self.state:
      refuse_fused(self.state, self.spec, self.layer, prefix=self.prefix,
                   known=self.known)
      if name == self.spec.anchor:
        refuse_other_family(self.state, self.spec, key, self.layer,
                            self.known, self.config, prefix=self.prefix)
      raise ValueError(
          f"state_dict has no {key!r} ({self.family} layer {self.layer}, "
          f"prefix {self.prefix!r}; {why}). Keys under that prefix: "
          f"{[k[len(self.prefix):] for k in self.under()]}. Pass prefix= if "
          "the checkpoint names this layer's attention differently.")
    value = as_numpy(self.state[key])
    if value.shape != shape:
      raise ValueError(
          f"state_dict[{key!r}] has shape {value.shape}, expected {shape} "
          f"({why}).")
    self.taken.add(key)
    return value

  def check_all_taken(self, why: str) -> None:
    unused = [k for k in self.under() if k not in self.taken
              and k[len(self.prefix):] not in self.spec.ignored
              and not k[len(self.prefix):].startswith(IGNORED_PREFIX)]
    if unused:
      raise ValueError(
          f"state_dict has {unused} under prefix {self.prefix!r}, which the "
          f"{self.family} attention this config describes does not use "
          f"({why}). Check the config (e.g. attention_bias) matches the "
          "checkpoint, the prefix, or that no overrides= (normalize_qk=False, "
          "attention_sinks=False) dropped weights the checkpoint has.")


def dtype_of(arrays: Mapping[str, np.ndarray], dtype) -> jnp.dtype:
  if dtype is not None:
    return jnp.dtype(dtype)
  first = np.asarray(next(iter(arrays.values())))
  if not jnp.issubdtype(first.dtype, jnp.floating):
    raise TypeError(f"the checkpoint's weights have dtype {first.dtype}; "
                    "pass dtype= (e.g. jnp.float32) to convert them.")
  return jnp.dtype(first.dtype)


def size(cfg: Mapping[str, Any], name: str, family: str, derived: int,
          derives: tuple[str, ...], how: str) -> int:
  """A size key, or ``derived`` where the family's config class derives it.

  Other config classes default a missing key to a fixed number of their own
  (not ``derived``); there a missing key is refused rather than guessed.
  """
  if cfg.get(name) is not None:
    return positive_int(cfg, name, family)
  if family in derives:
    return derived
  raise ValueError(
      f"config has no {name!r}: {family}'s config class gives it a default "
      f"of its own, not necessarily {how}={derived}, so the loader does not "
      f"guess it; add it to the config (its config.json has it).")

