"""Every family ``aj.load_attention_weights`` reads, by name."""

from __future__ import annotations

from attention_jax.interop.checkpoints import decoders
from attention_jax.interop.checkpoints import encoders
from attention_jax.interop.checkpoints import fused_layouts
from attention_jax.interop.checkpoints import gemma3n
from attention_jax.interop.checkpoints import gpt
from attention_jax.interop.checkpoints import latent
from attention_jax.interop.checkpoints import multimodal
from attention_jax.interop.checkpoints import others
from attention_jax.interop.checkpoints import registry
from attention_jax.interop.checkpoints import t5

#: ``{name: Family}``, in the order the docs list them.
FAMILIES = registry.by_name((*decoders.FAMILIES, *gpt.FAMILIES,
                             *t5.FAMILIES, *latent.FAMILIES,
                             *encoders.FAMILIES, *others.FAMILIES,
                             *fused_layouts.FAMILIES,
                             *multimodal.FAMILIES, *gemma3n.FAMILIES))
