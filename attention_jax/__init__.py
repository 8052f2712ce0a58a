"""attention_jax: attention mechanisms as pure JAX functions and Flax NNX modules.

Shape glossary used throughout: B batch, T query length, S key/value length,
N query heads, K key/value heads, H head dim, D model dim.

The options every attention entry point shares (``mask``, ``bias``,
``scale``, ``is_causal``, ``score_mod``, ``sinks``, dropout,
``implementation``, the ``return_*`` flags) are defined in
docs/options.md and stated in full in code only by
``aj.scaled_dot_product_attention``'s docstring; the other entry points'
docstrings say what differs for them.

``aj.kernels`` is the kernel interface (the registry the automatic choice
walks, one class per kernel); ``aj.paged_cache`` the paged KV cache's pure
updates (``append``, ``release``, ``share_prefix``, ``check_overflow``).
Nothing here is jitted internally: wrap calls in ``jax.jit`` (with the
keyword flags such as ``is_causal`` as static arguments) at your boundary.
"""

from attention_jax import kernels as kernels  # the kernel interface
from attention_jax import lesson as lesson  # the textbook versions, to read
from attention_jax.attention.blockwise import blockwise_attention
from attention_jax.attention.dot_product import scaled_dot_product_attention
from attention_jax.attention.explain import Explanation
from attention_jax.attention.explain import explain
from attention_jax.attention.importance import key_importance
from attention_jax.attention.ring import ring_attention
from attention_jax.attention.sequence_parallel import SequenceParallel
from attention_jax.attention.ulysses import ulysses_attention
from attention_jax.core.merge import merge_attentions
from attention_jax.core.softmax import masked_softmax
from attention_jax.core.traced_checks import checked
from attention_jax.decoding import paged_cache as paged_cache  # its updates
from attention_jax.decoding.eviction import evict
from attention_jax.decoding.eviction import h2o_keep
from attention_jax.decoding.eviction import moved_scores
from attention_jax.decoding.eviction import snapkv_keep
from attention_jax.decoding.eviction import streaming_keep
from attention_jax.decoding.kv_cache import cache_overflow
from attention_jax.decoding.kv_cache import ring_slot_positions
from attention_jax.decoding.kv_cache import update_kv_cache
from attention_jax.decoding.kv_cache import update_ring_cache
from attention_jax.decoding.paged_attention import paged_attention
from attention_jax.decoding.paged_cache import PagedKVCache
from attention_jax.decoding.paged_cache import init_paged_cache
from attention_jax.decoding.paged_edit import move_slots
from attention_jax.decoding.paged_importance import paged_key_importance
from attention_jax.decoding.speculative import greedy_accept
from attention_jax.interop.checkpoints import LoadedAttention
from attention_jax.interop.checkpoints import load_attention_weights
from attention_jax.interop.flax_fn import flax_attention_fn
from attention_jax.interop.jax_nn import dot_product_attention
from attention_jax.interop.torch_convert import from_torch_multihead_attention
from attention_jax.interop.torch_convert import to_torch_multihead_attention
from attention_jax.kernels.ring_layout import unzigzag
from attention_jax.kernels.ring_layout import zigzag
from attention_jax.kernels.ring_layout import zigzag_indices
from attention_jax.layers.additive import additive_attention
from attention_jax.layers.additive import additive_score
from attention_jax.layers.additive import init_additive_params
from attention_jax.layers.additive import precompute_additive_keys
from attention_jax.layers.decoder_attention_module import BahdanauAttention
from attention_jax.layers.decoder_attention_module import LuongAttention
from attention_jax.layers.dsa import dsa_selection
from attention_jax.layers.dsa import indexer_loss
from attention_jax.layers.dsa import indexer_scores
from attention_jax.layers.dsa import indexer_top_k
from attention_jax.layers.dsa import init_indexer_params
from attention_jax.layers.dsa_module import LightningIndexer
from attention_jax.layers.generate import generate
from attention_jax.layers.latent import init_latent_cache
from attention_jax.layers.latent import init_latent_params
from attention_jax.layers.latent import init_paged_latent_cache
from attention_jax.layers.latent import latent_attention
from attention_jax.layers.latent import latent_decode
from attention_jax.layers.latent_module import MultiHeadLatentAttention
from attention_jax.layers.luong import init_luong_params
from attention_jax.layers.luong import luong_attention
from attention_jax.layers.luong import precompute_luong_keys
from attention_jax.layers.moba import moba_attention
from attention_jax.layers.moba import moba_attention_fn
from attention_jax.layers.moba import moba_selection
from attention_jax.layers.multi_head import attend_heads
from attention_jax.layers.multi_head import multi_head_attention
from attention_jax.layers.multi_head import project_memory
from attention_jax.layers.multi_head_module import MultiHeadAttention
from attention_jax.layers.multi_head_params import init_multi_head_params
from attention_jax.layers.nsa import init_nsa_params
from attention_jax.layers.nsa import nsa_attention
from attention_jax.layers.nsa_module import NativeSparseAttention
from attention_jax.layers.qk_norm import QKNorm
from attention_jax.layers.speculative_generate import speculative_generate
from attention_jax.layers.speculative_generate import tree_step_options
from attention_jax.masking.arrays import causal_mask
from attention_jax.masking.arrays import combine_masks
from attention_jax.masking.arrays import make_attention_mask
from attention_jax.masking.arrays import padding_mask
from attention_jax.masking.block_tables import block_mask
from attention_jax.masking.block_tables import chunked_mask_fn
from attention_jax.masking.block_tables import prefix_lm_mask_fn
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask
from attention_jax.masking.mask import MaskRule
from attention_jax.masking.selection import select_blocks
from attention_jax.masking.selection import select_tokens
from attention_jax.masking.selection import top_k_indices
from attention_jax.masking.selection import top_k_mask
from attention_jax.masking.tree import tree_ancestors
from attention_jax.masking.tree import tree_depths
from attention_jax.masking.tree import tree_mask
from attention_jax.masking.tree import tree_positions
from attention_jax.masking.tree import tree_rule
from attention_jax.scores.rope import Rope
from attention_jax.scores.rope import apply_rope
from attention_jax.scores.rope import segment_positions
from attention_jax.scores.score_mods import ScoreMod
from attention_jax.scores.score_mods import T5Bias
from attention_jax.scores.score_mods import alibi
from attention_jax.scores.score_mods import alibi_slopes
from attention_jax.scores.score_mods import chain
from attention_jax.scores.score_mods import query_temperature
from attention_jax.scores.score_mods import soft_cap
from attention_jax.scores.score_mods import t5_buckets
from attention_jax.scores.score_mods import t5_relative_bias

__version__ = "0.1.0"

__all__ = [
    "BahdanauAttention",
    "BlockMask",
    "LoadedAttention",
    "LuongAttention",
    "Mask",
    "MaskRule",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "QKNorm",
    "Rope",
    "ScoreMod",
    "T5Bias",
    "alibi",
    "alibi_slopes",
    "chain",
    "checked",
    "soft_cap",
    "query_temperature",
    "t5_buckets",
    "t5_relative_bias",
    "apply_rope",
    "attend_heads",
    "block_mask",
    "select_blocks",
    "select_tokens",
    "top_k_indices",
    "top_k_mask",
    "tree_rule",
    "tree_mask",
    "tree_positions",
    "tree_ancestors",
    "tree_depths",
    "LightningIndexer",
    "init_indexer_params",
    "indexer_scores",
    "indexer_top_k",
    "indexer_loss",
    "dsa_selection",
    "NativeSparseAttention",
    "init_nsa_params",
    "nsa_attention",
    "moba_attention",
    "moba_attention_fn",
    "moba_selection",
    "blockwise_attention",
    "chunked_mask_fn",
    "update_kv_cache",
    "update_ring_cache",
    "cache_overflow",
    "ring_slot_positions",
    "PagedKVCache",
    "init_paged_cache",
    "move_slots",
    "greedy_accept",
    "paged_attention",
    "streaming_keep",
    "h2o_keep",
    "snapkv_keep",
    "evict",
    "moved_scores",
    "paged_key_importance",
    "key_importance",
    "additive_attention",
    "additive_score",
    "causal_mask",
    "combine_masks",
    "dot_product_attention",
    "explain",
    "Explanation",
    "flax_attention_fn",
    "generate",
    "speculative_generate",
    "tree_step_options",
    "from_torch_multihead_attention",
    "init_additive_params",
    "init_latent_cache",
    "init_latent_params",
    "init_paged_latent_cache",
    "init_luong_params",
    "init_multi_head_params",
    "latent_attention",
    "load_attention_weights",
    "latent_decode",
    "luong_attention",
    "make_attention_mask",
    "merge_attentions",
    "masked_softmax",
    "multi_head_attention",
    "padding_mask",
    "precompute_additive_keys",
    "precompute_luong_keys",
    "prefix_lm_mask_fn",
    "project_memory",
    "ring_attention",
    "ulysses_attention",
    "SequenceParallel",
    "zigzag",
    "unzigzag",
    "zigzag_indices",
    "scaled_dot_product_attention",
    "segment_positions",
    "to_torch_multihead_attention",
]
