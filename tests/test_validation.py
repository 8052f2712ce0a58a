"""Bad input gets a ValueError/TypeError that names the argument and shapes."""

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.kernels import base as kernel_base
from attention_jax.layers import multi_head_params
from tests import _data
from tests import reference

f32 = jnp.float32
Q, K, V = jnp.ones((2, 4, 8)), jnp.ones((2, 6, 8)), jnp.ones((2, 6, 5))
MHA = _data.params(aj.init_multi_head_params, 0, 16, 4)
X = jnp.ones((2, 3, 16))
ADD = _data.params(aj.init_additive_params, 0, 6, 4, 8)
GEN = _data.params(aj.init_luong_params, 0, 6, 4, score="general")
DQ, KEYS = jnp.ones((2, 6)), jnp.ones((2, 5, 4))
sdpa = aj.scaled_dot_product_attention
mha = aj.multi_head_attention
Mask = aj.Mask

# Concrete arrays made once: under the jit variant below they are closed
# over, still concrete, so the same checks must fire while tracing.
RATE_HIGH = jnp.float32(1.5)
NAN_SINKS = jnp.array([0.0, jnp.nan])
INF_BIAS = jnp.zeros((4, 6)).at[1, 2].set(jnp.inf)[None]
NAN_BIAS = jnp.zeros((4, 6)).at[3, 0].set(jnp.nan)[None]
LONG_KV = Mask(kv_lengths=jnp.array([7, 3]))
LONG_KV_NN = jnp.array([7, 3])

CASES = [
    # (name, call, exception, message regex)
    ("sdpa_dropout_rng_without_rate", lambda: sdpa(
        Q, K, V, dropout_rng=jax.random.key(0)), ValueError,
     r"dropout_rng is given but dropout_rate is 0.*dropout_rng=None"),
    ("sdpa_dropout_rng_int_seed", lambda: sdpa(
        Q, K, V, dropout_rate=0.1, dropout_rng=3), TypeError,
     r"dropout_rng must be one PRNG key.*got 3 \(int\).*jax.random.key"),
    ("sdpa_dropout_rng_float_array", lambda: sdpa(
        Q, K, V, dropout_rate=0.1, dropout_rng=jnp.ones(2)), TypeError,
     r"dropout_rng must be one PRNG key.*dtype float32 with shape \(2,\)"),
    ("sdpa_dropout_rng_batch", lambda: sdpa(
        Q, K, V, dropout_rate=0.1,
        dropout_rng=jax.random.split(jax.random.key(0), 3)), ValueError,
     r"dropout_rng must be one PRNG key, got a batch of keys with shape "
     r"\(3,\)"),
    ("sdpa_dropout_rate_array_high", lambda: sdpa(
        Q, K, V, dropout_rate=RATE_HIGH, dropout_rng=jax.random.key(0)),
     ValueError, r"dropout_rate must be in \[0, 1\), got 1.5"),
    ("sdpa_sinks_nan", lambda: sdpa(jnp.ones((2, 2, 4, 8)), K[:, None],
                                    V[:, None], sinks=NAN_SINKS),
     ValueError, r"sinks must be finite \(-inf is no sink\).*index \(1,\)"),
    ("sdpa_bias_inf", lambda: sdpa(Q, K, V, bias=INF_BIAS), ValueError,
     r"bias must be finite \(-inf masks the entry\).*\(0, 1, 2\)"),
    ("sdpa_bias_nan", lambda: sdpa(Q, K, V, bias=NAN_BIAS), ValueError,
     r"bias must be finite.*1 of them, the first at index \(0, 3, 0\)"),
    ("sdpa_kv_lengths_beyond_s", lambda: sdpa(Q, K, V, LONG_KV), ValueError,
     r"kv_lengths must lie in \[0, 6\], got values from 3 to 7"),
    ("jax_nn_kv_lengths_beyond_s", lambda: aj.dot_product_attention(
        Q[:, :, None], K[:, :, None], V[:, :, None],
        key_value_seq_lengths=LONG_KV_NN), ValueError,
     r"key_value_seq_lengths must lie in \[0, 6\], got values from 3 to 7"),
    ("sdpa_rule_shape", lambda: sdpa(Q, K, V, Mask(
        rule=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx)[..., :3])),
     ValueError, r"rule returned shape \(1, 4, 3\).*must broadcast to the "
     r"call's \[..., T, S\] = \(2, 4, 6\)"),
    ("sdpa_rule_arity", lambda: sdpa(Q, K, V, Mask(
        rule=lambda q_idx, kv_idx: kv_idx <= q_idx)), TypeError,
     r"rule is called with 4 positional arguments \(b, h, q_idx, kv_idx\)"
     r", but <lambda>\(q_idx, kv_idx\) cannot take them"),
    ("sdpa_score_mod_arity", lambda: sdpa(
        Q, K, V, score_mod=lambda score, q_idx, kv_idx: score), TypeError,
     r"score_mod is called with 5 positional arguments \(score, b, h, q_idx, "
     r"kv_idx\)"),
    ("explain_strings", lambda: aj.explain("q", "k", "v"), TypeError,
     r"query must be a real floating-point array, got 'q' \(str\)"),
    ("sdpa_query_rank", lambda: sdpa(jnp.ones(8), K, V), ValueError,
     r"query must have rank >= 2.*\(8,\)"),
    ("sdpa_head_dim", lambda: sdpa(jnp.ones((2, 4, 7)), K, V), ValueError,
     r"same head dim H.*query \(2, 4, 7\), key \(2, 6, 8\)"),
    ("sdpa_kv_length", lambda: sdpa(Q, K, jnp.ones((2, 5, 5))), ValueError,
     r"same length S.*key \(2, 6, 8\), value \(2, 5, 5\)"),
    ("sdpa_batch", lambda: sdpa(jnp.ones((3, 4, 8)), K, V), ValueError,
     r"do not broadcast: query \(3,\), key \(2,\)"),
    ("sdpa_mask_shape", lambda: sdpa(Q, K, V, jnp.ones((1, 4, 5), bool)),
     ValueError, r"mask with shape \(1, 4, 5\) \(its last axes \(4, 5\)\) "
     r"is not broadcastable to \[T, S\] = \(4, 6\)"),
    # A [B, S] padding mask against [B, N, T, S] logits with T == B would
    # be read as [T, S] by NumPy broadcasting: refused, with the fix.
    ("sdpa_mask_rank_padding", lambda: sdpa(
        jnp.ones((2, 3, 2, 8)), jnp.ones((2, 3, 6, 8)), jnp.ones((2, 3, 6, 8)),
        jnp.ones((2, 6), bool)), ValueError,
     r"mask with shape \(2, 6\) has rank 2, but the logits are \[B, N, T, "
     r"S\] = \(2, 3, 2, 6\).*mask\[:, None, None, :\].*"
     r"aj\.Mask\(kv_lengths=\.\.\.\)"),
    ("sdpa_mask_rank_shared", lambda: sdpa(Q, K, V, jnp.ones((4, 6), bool)),
     ValueError, r"mask with shape \(4, 6\) has rank 2.*mask\[None\]"),
    ("sdpa_bias_rank", lambda: sdpa(Q, K, V, bias=jnp.ones((4, 6))),
     ValueError, r"bias with shape \(4, 6\) has rank 2.*bias\[None\]"),
    # jax.nn's [B, T, N, H] operands with a mask that fits that reading.
    ("sdpa_jax_nn_layout", lambda: sdpa(
        jnp.ones((2, 5, 4, 8)), jnp.ones((2, 7, 4, 8)), jnp.ones((2, 7, 4, 8)),
        jnp.ones((2, 1, 5, 7), bool)), ValueError,
     r"jax.nn's \[B, T, N, H\] layout.*jnp.swapaxes\(x, 1, 2\)"),
    ("sdpa_jax_nn_layout_heads", lambda: sdpa(
        jnp.ones((2, 5, 4, 8)), jnp.ones((2, 7, 3, 8)), jnp.ones((2, 7, 3, 8))),
     ValueError, r"jnp.swapaxes\(x, 1, 2\)"),
    ("sdpa_mask_batch", lambda: sdpa(Q, K, V, jnp.ones((3, 4, 6), bool)),
     ValueError, r"mask \(3,\)"),
    ("sdpa_float_mask", lambda: sdpa(Q, K, V, jnp.ones((4, 6))), TypeError,
     r"Mask's dense must be a bool \(or integer, 0 = blocked\) array, got "
     r"dtype float32 with shape \(4, 6\)"),
    ("sdpa_int_query", lambda: sdpa(jnp.ones((4, 8), jnp.int32), K[0], V[0]),
     TypeError, r"query must be a real floating-point array.*int32"),
    ("sdpa_complex_key", lambda: sdpa(Q, K.astype(jnp.complex64), V),
     TypeError, r"key must be a real floating-point.*complex64"),
    ("sdpa_int_bias", lambda: sdpa(Q, K, V, bias=jnp.ones((4, 6), jnp.int32)),
     TypeError, r"bias must be a real floating-point"),
    ("sdpa_bias_shape", lambda: sdpa(Q, K, V, bias=jnp.ones((1, 3, 6))),
     ValueError, r"bias with shape \(1, 3, 6\) \(its last axes \(3, 6\)\) "
     r"is not broadcastable"),
    ("sdpa_dropout_rate_high", lambda: sdpa(Q, K, V, dropout_rate=1.0,
                                            dropout_rng=jax.random.key(0)),
     ValueError, r"dropout_rate must be in \[0, 1\), got 1.0"),
    ("sdpa_dropout_rate_negative", lambda: sdpa(Q, K, V, dropout_rate=-0.1),
     ValueError, r"dropout_rate must be in \[0, 1\), got -0.1"),
    ("sdpa_dropout_no_rng", lambda: sdpa(Q, K, V, dropout_rate=0.2),
     ValueError, r"dropout_rate=0.2 needs a dropout_rng"),
    # An array rate (it may be traced and positive) was silently ignored.
    ("sdpa_array_dropout_no_rng", lambda: sdpa(
        Q, K, V, dropout_rate=jnp.float32(0.2)), ValueError,
     r"a dropout_rate given as an array \(shape \(\)\) needs a dropout_rng"),
    ("sdpa_window_negative", lambda: sdpa(Q, K, V, Mask(window=(-1, 2))),
     ValueError, r"window must be non-negative, got \(-1, 2\)"),
    ("sdpa_window_float", lambda: sdpa(Q, K, V, Mask(window=2.5)),
     TypeError, r"window must be a Python int or a \(left, right\) pair of "
     r"ints, got 2.5.*aj\.Mask\(causal=True, window=\(W - 1, 0\)\)"),
    ("blockwise_window_triple", lambda: aj.blockwise_attention(
        Q, K, V, Mask(window=(1, 2, 3))), TypeError,
     r"window must be a Python int.*got \(1, 2, 3\)"),
    ("soft_cap_zero", lambda: aj.soft_cap(0.0),
     ValueError, r"soft_cap's cap must be positive and finite, got 0.0"),
    ("soft_cap_array", lambda: aj.soft_cap(jnp.ones(2)), TypeError,
     r"soft_cap's cap must be a positive Python number"),
    ("sdpa_float_query_lengths", lambda: sdpa(
        Q, K, V, Mask(q_lengths=jnp.ones(2))), TypeError,
     r"Mask's q_lengths must be an integer array.*float32"),
    ("sdpa_query_lengths_shape", lambda: sdpa(
        Q, K, V, Mask(q_lengths=jnp.ones(3, jnp.int32))), ValueError,
     r"do not broadcast.*query \(2,\).*the mask's q_lengths \(3,\)"),
    ("causal_zero", lambda: aj.causal_mask(0), ValueError,
     r"q_len must be positive, got 0"),
    ("causal_float", lambda: aj.causal_mask(2.5), TypeError,
     r"q_len must be a Python int, got 2.5"),
    ("padding_float_lengths", lambda: aj.padding_mask(jnp.ones(2), 3),
     TypeError, r"lengths must be an integer array.*float32"),
    ("padding_rank", lambda: aj.padding_mask(jnp.ones((2, 2), jnp.int32), 3),
     ValueError, r"lengths must have rank 1 \(\[B\]\), got shape \(2, 2\)"),
    ("padding_max_len", lambda: aj.padding_mask(jnp.array([1]), -1),
     ValueError, r"max_len must be positive, got -1"),
    ("attention_mask_batch", lambda: aj.make_attention_mask(
        jnp.ones((2, 3), bool), jnp.ones((3, 4), bool)), ValueError,
     r"query_valid \(2, 3\) and key_valid \(3, 4\)"),
    ("attention_mask_float", lambda: aj.make_attention_mask(
        jnp.ones((2, 3)), jnp.ones((2, 4), bool)), TypeError,
     r"query_valid must be a bool or integer"),
    ("combine_shapes", lambda: aj.combine_masks(
        jnp.ones((2, 3), bool), jnp.ones((4, 3), bool)), ValueError,
     r"masks\[0\] \(2, 3\), masks\[1\] \(4, 3\)"),
    ("init_d_model", lambda: aj.init_multi_head_params(
        jax.random.key(0), 10, 4), ValueError,
     r"d_model=10 must be divisible by num_heads=4"),
    ("init_kv_heads", lambda: aj.init_multi_head_params(
        jax.random.key(0), 16, 4, num_kv_heads=3), ValueError,
     r"num_heads=4 must be divisible by num_kv_heads=3"),
    ("init_zero_heads", lambda: aj.init_multi_head_params(
        jax.random.key(0), 16, 0), ValueError, r"num_heads must be positive"),
    ("mha_query_rank", lambda: mha(MHA, X[0], X, X), ValueError,
     r"query must have rank 3 \(\[B, T, D\]\), got shape \(3, 16\)"),
    ("mha_model_dim", lambda: mha(MHA, X, jnp.ones((2, 3, 8)),
                                  jnp.ones((2, 3, 8))),
     ValueError, r"key and value have 8 features \(shape \(2, 3, 8\)\), but "
     r"params\['W_k'\]\['kernel'\] has shape \(16, 4, 4\): \[Dkv, K, H\] with "
     r"Dkv=16"),
    ("mha_query_dim", lambda: mha(MHA, jnp.ones((2, 3, 8)), X, X), ValueError,
     r"query has 8 features \(shape \(2, 3, 8\)\), but params\['W_q'\]"),
    # multi_head_attention reads the head counts from params; the module
    # checks its own against them (param_dims), and they must agree.
    ("mha_kv_heads_vs_params", lambda: multi_head_params.param_dims(
        MHA, num_heads=4, num_kv_heads=2),
     ValueError, r"num_kv_heads=2 but params\['W_k'\]\['kernel'\] has shape "
     r"\(16, 4, 4\): 4 key/value heads.*leave num_kv_heads out"),
    ("mha_heads_vs_params", lambda: multi_head_params.param_dims(
        MHA, num_heads=5),
     ValueError, r"num_heads=5 but params\['W_q'\]\['kernel'\] has shape "
     r"\(16, 4, 4\): 4 heads.*leave num_heads out"),
    ("mha_flat_params", lambda: mha(
        {**MHA, "W_q": {"kernel": jnp.ones((16, 16))}}, X, X, X), ValueError,
     r"params\['W_q'\]\['kernel'\] has shape \(16, 16\), expected \[D, N, H\]"
     r".*kernel.reshape\(D, heads, H\)"),
    ("mha_kv_heads_divide_params", lambda: mha(
        {**MHA, "W_k": {"kernel": jnp.ones((16, 3, 4))},
         "W_v": {"kernel": jnp.ones((16, 3, 4))}}, X, X, X), ValueError,
     r"params\['W_k'\]\['kernel'\] has shape \(16, 3, 4\).*K=3 heads must "
     r"divide W_q's N=4 heads"),
    ("mha_w_o_layout", lambda: mha(
        {**MHA, "W_o": {"kernel": jnp.ones((4, 2, 16))}}, X, X, X), ValueError,
     r"params\['W_o'\]\['kernel'\] has shape \(4, 2, 16\), expected "
     r"\[N, H, Dout\] with N=4, H=4"),
    ("mha_bias_layout", lambda: mha(
        {**MHA, "W_q": {**MHA["W_q"], "bias": jnp.ones(16)}}, X, X, X),
     ValueError, r"params\['W_q'\]\['bias'\] has shape \(16,\), expected "
     r"\(4, 4\)"),
    ("mha_one_qk_norm", lambda: mha(
        {**MHA, "q_norm": {"scale": jnp.ones(4)}}, X, X, X), ValueError,
     r"params has q_norm but not k_norm"),
    ("mha_mask_rank", lambda: mha(MHA, X, X, X, jnp.ones((2, 3), bool)),
     ValueError, r"mask with shape \(2, 3\) has rank 2, but the logits are "
     r"\[B, N, T, S\] = \(2, 4, 3, 3\) \(rank 4\).*mask\[:, None, None, :\]"),
    ("mha_bias_rank", lambda: mha(MHA, X, X, X, bias=jnp.zeros((3, 3))),
     ValueError, r"bias with shape \(3, 3\) has rank 2.*bias\[None, None\]"),
    ("init_head_dim", lambda: aj.init_multi_head_params(
        jax.random.key(0), 16, 4, head_dim=0), ValueError,
     r"head_dim must be positive, got 0"),
    ("mha_mask_shape", lambda: mha(MHA, X, X, X, jnp.ones((2, 3, 3, 3), bool)),
     ValueError,
     r"mask with shape \(2, 3, 3, 3\) is not broadcastable to \[B, N, T, S\] "
     r"= \(2, 4, 3, 3\)"),
    ("mha_kv_batch", lambda: mha(MHA, X, jnp.ones((1, 3, 16)),
                                 jnp.ones((1, 3, 16))),
     ValueError, r"same batch size B"),
    ("additive_query_rank", lambda: aj.additive_attention(
        ADD, jnp.ones((2, 1, 1, 6)), KEYS), ValueError,
     r"query must have rank 2 or 3"),
    ("additive_query_features", lambda: aj.additive_attention(
        ADD, jnp.ones((2, 5)), KEYS), ValueError,
     r"query has 5 features \(shape \(2, 5\)\) but params\['W_q'\] is "
     r"\(6, 8\)"),
    ("additive_mask_shape", lambda: aj.additive_attention(
        ADD, DQ, KEYS, mask=jnp.ones((2, 4), bool)), ValueError,
     r"mask with shape \(2, 4\) is not broadcastable to \[B, S\] = \(2, 5\)"),
    # One rule with the others: a [B, S] mask for [B, T, Dq] queries is a
    # lower rank than the weights [B, T, S] and could be read as [T, S].
    ("additive_mask_rank", lambda: aj.additive_attention(
        ADD, jnp.ones((2, 3, 6)), KEYS, mask=jnp.ones((2, 5), bool)),
     ValueError, r"mask with shape \(2, 5\) has rank 2, but the logits are "
     r"\[B, T, S\] = \(2, 3, 5\).*mask\[:, None, :\]"),
    ("luong_mask_rank", lambda: aj.luong_attention(
        None, jnp.ones((2, 3, 4)), KEYS, mask=jnp.ones((2, 5), bool)),
     ValueError, r"mask with shape \(2, 5\) has rank 2.*mask\[:, None, :\]"),
    ("additive_values_length", lambda: aj.additive_attention(
        ADD, DQ, KEYS, jnp.ones((2, 4, 3))), ValueError,
     r"keys \(2, 5, 4\) and values \(2, 4, 3\)"),
    ("additive_projected_keys", lambda: aj.additive_attention(
        ADD, DQ, KEYS, projected_keys=jnp.ones((2, 5, 7))), ValueError,
     r"projected_keys has shape \(2, 5, 7\), expected \(2, 5, 8\)"),
    ("additive_init_hidden", lambda: aj.init_additive_params(
        jax.random.key(0), 6, 4, 0), ValueError,
     r"hidden_features must be positive"),
    ("luong_unknown_score", lambda: aj.luong_attention(None, DQ, KEYS,
                                                       score="cosine"),
     ValueError, r"score must be one of \('dot', 'general', 'concat'\), got "
     r"'cosine'"),
    ("luong_dot_features", lambda: aj.luong_attention(None, DQ, KEYS),
     ValueError,
     r"score='dot' needs query and keys with the same features, got Dq=6 and "
     r"Dk=4"),
    ("luong_missing_params", lambda: aj.luong_attention(
        None, DQ, KEYS, score="general"), ValueError,
     r"score='general' needs params\['W'\]"),
    ("luong_general_shape", lambda: aj.luong_attention(
        GEN, jnp.ones((2, 5)), KEYS, score="general"), ValueError,
     r"params\['W'\] has shape \(6, 4\), expected \[Dq, Dk\] = \[5, 4\]"),
    ("luong_concat_needs_hidden", lambda: aj.init_luong_params(
        jax.random.key(0), 6, 4, score="concat"), ValueError,
     r"score='concat' needs hidden_features"),
    ("luong_float_mask", lambda: aj.luong_attention(
        GEN, DQ, KEYS, score="general", mask=jnp.ones((2, 5))),
     TypeError, r"mask must be a bool or integer array"),
    ("blockwise_float_lengths", lambda: aj.blockwise_attention(
        Q, K, V, Mask(kv_lengths=jnp.ones((2,)))), TypeError,
     r"Mask's kv_lengths must be an integer array, got dtype float32 with "
     r"shape \(2,\)"),
    ("blockwise_lengths_batch", lambda: aj.blockwise_attention(
        Q, K, V, Mask(kv_lengths=jnp.ones((3,), jnp.int32))), ValueError,
     r"do not broadcast: .*the mask's kv_lengths \(3,\)"),
    # [B] lengths against [B, N, T, H] now mean per example (aligned to the
    # left; NowAcceptedTest); more axes than the leading dims are refused.
    ("sdpa_lengths_more_axes_than_leading_dims", lambda: sdpa(
        jnp.ones((2, 3, 4, 8)), jnp.ones((2, 3, 6, 8)), jnp.ones((2, 3, 6, 5)),
        Mask(kv_lengths=jnp.ones((2, 3, 1), jnp.int32))), ValueError,
     r"Mask's kv_lengths with shape \(2, 3, 1\) has 3 leading axes, but the "
     r"operands have 2 leading dims: it must be a scalar or \[B\], aligned "
     r"to the left"),
    ("blockwise_block_size", lambda: aj.blockwise_attention(
        Q, K, V, block_q=0), ValueError, r"block_q must be positive, got 0"),
    ("blockwise_complex", lambda: aj.blockwise_attention(
        Q.astype(jnp.complex64), K, V), TypeError,
     r"query must be a real floating-point array, got dtype complex64"),
    ("blockwise_mask_shape", lambda: aj.blockwise_attention(
        Q, K, V, mask=jnp.ones((1, 4, 5), bool)), ValueError,
     r"mask with shape \(1, 4, 5\) \(its last axes \(4, 5\)\) is not "
     r"broadcastable"),
    ("blockwise_mask_rank", lambda: aj.blockwise_attention(
        Q, K, V, mask=jnp.ones((4, 6), bool)), ValueError,
     r"mask with shape \(4, 6\) has rank 2"),
    ("sdpa_unknown_implementation", lambda: sdpa(Q, K, V,
                                                 implementation="flashy"),
     ValueError, r"implementation must be None, a kernel, a sequence of them, "
     r"or one of \['cudnn', 'splash', 'paged_tpu', 'paged_gpu', 'pallas_gpu', "
     r"'gathered', 'flash', "
     r"'dense'\], "
     r"got 'flashy'"),
    ("sdpa_splash_dropout", lambda: sdpa(
        Q, K, V, implementation=aj.kernels.Splash(interpret=True),
        dropout_rate=0.1, dropout_rng=jax.random.key(0)), ValueError,
     r"implementation='splash' is not possible: it has no dropout"),
    ("sdpa_blockwise_weights", lambda: sdpa(
        Q, K, V, implementation="flash", return_weights=True), ValueError,
     r"implementation='flash' is not possible: it never forms the "
     r"attention weights"),
    # The ring kernel takes a dense mask or bias over every key column
    # ([..., T|1, P*S|1]) from ring_attention: one that does not fit is
    # refused naming both lengths; the dispatcher refuses either (its
    # checks see this device's keys), naming the fix.
    ("ring_mask", lambda: _in_ring(lambda q, k, v: aj.ring_attention(
        q, k, v, jnp.ones((1, 4, 5), bool), axis_name="seq")), ValueError,
     r"the mask's dense field has shape \(1, 4, 5\).*T_local = 4 .*"
     r"P\*S_local = 1 \* 6 = 6"),
    ("ring_bias", lambda: _in_ring(lambda q, k, v: sdpa(
        q, k, v, bias=jnp.ones((1, 4, 6)),
        implementation=aj.kernels.Ring("seq"))), ValueError,
     r"implementation='ring' is not possible: it takes a bias only over "
     r"every key column .*\(got shape \(1, 4, 6\)\).*aj\.ring_attention"),
    ("ring_outside_shard_map", lambda: aj.ring_attention(
        Q, K, V, axis_name="seq"), ValueError,
     r"axis_name='seq' is not bound: call ring_attention inside "
     r"jax.shard_map"),
    ("sdpa_float_segment_ids", lambda: sdpa(
        Q, K, V, Mask(q_segment_ids=jnp.ones((2, 4)),
                      kv_segment_ids=jnp.ones((2, 6), jnp.int32))), TypeError,
     r"Mask's q_segment_ids must be an integer array, got dtype float32 with "
     r"shape \(2, 4\)"),
    ("sdpa_segment_ids_length", lambda: sdpa(
        Q, K, V, Mask(q_segment_ids=jnp.ones((2, 4), jnp.int32),
                      kv_segment_ids=jnp.ones((2, 5), jnp.int32))), ValueError,
     r"the mask's kv_segment_ids with shape \(2, 5\) must be \[S\] = \[6\] "
     r"\(shared\) or \[B, S\] \(per example"),
    # [B, T] ids against [B, N, T, H] now mean per example (aligned to the
    # left; NowAcceptedTest); more axes than the leading dims are refused.
    ("sdpa_segment_ids_more_axes_than_leading_dims", lambda: sdpa(
        jnp.ones((2, 2, 4, 8)), jnp.ones((2, 2, 4, 8)), jnp.ones((2, 2, 4, 8)),
        Mask(q_segment_ids=jnp.ones((2, 2, 1, 4), jnp.int32),
             kv_segment_ids=jnp.ones((2, 2, 1, 4), jnp.int32))), ValueError,
     r"Mask's q_segment_ids with shape \(2, 2, 1, 4\) has 3 leading axes, "
     r"but the operands have 2 leading dims: it must be \[T\] or \[B, T\], "
     r"aligned to the left"),
    # q_segment_ids alone now means packed self-attention (NowAcceptedTest);
    # key ids alone still say what is missing.
    ("sdpa_segment_ids_alone", lambda: sdpa(
        Q, K, V, Mask(kv_segment_ids=jnp.ones((2, 6), jnp.int32))),
     ValueError, r"Mask's kv_segment_ids need q_segment_ids .*pass both"),
    # Concrete lengths are range-checked (NumPy stays concrete under jit);
    # traced ones cannot be and clip.
    ("sdpa_lengths_out_of_range", lambda: sdpa(
        Q, K, V, Mask(kv_lengths=np.array([6, 7]))), ValueError,
     r"the mask's kv_lengths must lie in \[0, 6\], got values from 6 to 7"),
    ("blockwise_negative_query_length", lambda: aj.blockwise_attention(
        Q, K, V, Mask(q_lengths=np.array([-1, 2]))), ValueError,
     r"the mask's q_lengths must lie in \[0, 4\]"),
    ("sdpa_block_mask_lengths", lambda: sdpa(
        Q, K, V, aj.block_mask(aj.chunked_mask_fn(2), 4, 5)), ValueError,
     r"mask is a BlockMask built for \[T, S\] = \[4, 5\], but its rule "
     r"indices here run over T = 4, S = 6: build it with "
     r"block_mask\(mask_fn, 4, 6"),
    ("blockwise_block_mask_block_size", lambda: aj.blockwise_attention(
        Q, K, V, aj.block_mask(aj.chunked_mask_fn(2), 4, 6, block_q=2),
        block_q=4), ValueError,
     r"block_q=4 differs from the block mask's 2"),
    ("sdpa_sinks_shape", lambda: sdpa(Q, K, V, sinks=jnp.ones(3)),
     ValueError, r"sinks with shape \(3,\) is not broadcastable to the "
     r"leading dims .* = \(2,\)"),
    ("blockwise_int_sinks", lambda: aj.blockwise_attention(
        Q, K, V, sinks=jnp.ones(2, jnp.int32)), TypeError,
     r"sinks must be a real floating-point array"),
    ("sdpa_score_mod_not_callable", lambda: sdpa(Q, K, V, score_mod=2.0),
     TypeError, r"score_mod must be callable as score_mod\(score, b, h, "
     r"q_idx, kv_idx\)"),
    ("alibi_slopes_not_per_head", lambda: aj.alibi(jnp.ones((2, 1, 1))),
     ValueError, r"alibi takes float slopes \[N\], one per query head, got "
     r"shape \(2, 1, 1\)"),
    ("chain_not_callable", lambda: aj.chain(aj.alibi(jnp.ones(2)), 3),
     TypeError, r"chain's argument 1 must be a score modifier"),
    ("block_mask_not_bool", lambda: aj.block_mask(
        lambda b, h, q, k: q - k, 4, 6), TypeError,
     r"mask_fn must return a bool array, got dtype int64"),
    ("block_mask_not_callable", lambda: aj.block_mask(3, 4, 6), TypeError,
     r"mask_fn must be callable"),
    ("block_mask_traced_closure", lambda: jax.jit(lambda p: aj.block_mask(
        lambda b, h, q, k: k < p, 4, 6).kinds)(2), TypeError,
     r"mask_fn depends on traced values it closes over.*aj\.MaskRule"),
    ("block_mask_per_example_without_batch", lambda: aj.block_mask(
        aj.prefix_lm_mask_fn(jnp.array([2, 3])), 4, 6), ValueError,
     r"one rule per example \(2 examples\).*batch=\(2, 1\)"),
    ("block_mask_batch_rank", lambda: sdpa(
        Q, K, V, aj.block_mask(aj.prefix_lm_mask_fn(jnp.array([2, 3])), 4, 6,
                               batch=(2, 1))), ValueError,
     r"tables for batch=\(2, 1\), but the operands have 1 leading dims"),
    ("prefix_lengths_float", lambda: aj.prefix_lm_mask_fn(jnp.ones(2)),
     TypeError, r"prefix_len must be a positive int or an integer array"),
    ("mha_segments_while_decoding", lambda: _decode_with_segments(),
     ValueError, r"segment ids are not supported while decoding with a KV "
     r"cache.*dense mask instead"),
    ("sdpa_traced_is_causal", lambda: jax.jit(
        lambda c: sdpa(Q, K, V, is_causal=c))(True), TypeError,
     r"is_causal must be a Python bool, got a traced value: pass it as a "
     r"static argument"),
    ("blockwise_traced_return_lse", lambda: jax.jit(
        lambda r: aj.blockwise_attention(Q, K, V, return_lse=r))(False),
     TypeError, r"return_lse must be a Python bool, got a traced value"),
    ("sdpa_key_none", lambda: sdpa(Q, None, V), TypeError,
     r"key is None: pass a float array \[..., S, H\]"),
    ("sdpa_mask_full_shape", lambda: sdpa(Q, K, V, jnp.ones((2, 1, 5), bool)),
     ValueError, r"mask with shape \(2, 1, 5\) \(its last axes \(1, 5\)\) is "
     r"not broadcastable to \[T, S\] = \(4, 6\)"),
    ("causal_mask_negative", lambda: aj.causal_mask(-1, 3), ValueError,
     r"q_len must be positive, got -1"),
    ("padding_mask_float", lambda: aj.padding_mask(jnp.ones((2,)), 4),
     TypeError, r"lengths must be an integer array, got dtype float32"),
    # The mask is converted once, by the public function: the validated
    # call's constructor takes only an aj.Mask (or None).
    ("canonicalize_raw_mask", lambda: kernel_base.canonicalize(
        Q, K, V, jnp.ones((4, 6), bool)), TypeError,
     r"canonicalize takes the call's mask as an aj.Mask \(or None\), got "
     r"\w+"),
]


def _decode_with_segments():
  layer = aj.MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
  layer.init_cache(2, 4)
  ids = jnp.zeros((2, 3), jnp.int32)
  return layer(X, decode=True, mask=Mask(q_segment_ids=ids, kv_segment_ids=ids))


def _in_ring(fn):
  """``fn(Q, K, V)`` inside ``shard_map`` over a one-device "seq" axis."""
  mesh = jax.make_mesh((1,), ("seq",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec(None, "seq")
  return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(Q, K, V)


# Constructors and stateful calls: checked eagerly (modules are built
# outside jit).
MODULE_CASES = [
    ("mha_heads_divide_d_model", lambda: aj.MultiHeadAttention(
        16, 5, rngs=nnx.Rngs(0)), ValueError,
     r"d_model=16 must be divisible by num_heads=5"),
    ("mha_kv_heads_divide", lambda: aj.MultiHeadAttention(
        16, 4, num_kv_heads=3, rngs=nnx.Rngs(0)), ValueError,
     r"num_heads=4 must be divisible by num_kv_heads=3"),
    ("mha_dropout_rate", lambda: aj.MultiHeadAttention(
        16, 4, dropout_rate=1.5, rngs=nnx.Rngs(0)), ValueError,
     r"dropout_rate must be in \[0, 1\), got 1.5"),
    ("mha_zero_d_model", lambda: aj.MultiHeadAttention(
        0, 4, rngs=nnx.Rngs(0)), ValueError, r"d_model must be positive, got 0"),
    ("mha_head_axis_without_mesh", lambda: aj.MultiHeadAttention(
        16, 4, head_axis="model", rngs=nnx.Rngs(0)), ValueError,
     r"head_axis='model' shards the parameters"),
    ("mha_call_features", lambda: aj.MultiHeadAttention(
        16, 4, rngs=nnx.Rngs(0))(jnp.ones((2, 3, 8))), ValueError,
     r"query has 8 features \(shape \(2, 3, 8\)\), but the module was built "
     r"with d_model=16"),
    ("mha_call_kv_features", lambda: aj.MultiHeadAttention(
        16, 4, kv_features=6, rngs=nnx.Rngs(0))(X), ValueError,
     r"key has 16 features \(shape \(2, 3, 16\)\), but the module was built "
     r"with kv_features=6"),
    ("mha_head_dim", lambda: aj.MultiHeadAttention(
        16, 4, head_dim=-1, rngs=nnx.Rngs(0)), ValueError,
     r"head_dim must be positive, got -1"),
    ("mha_cache_length", lambda: aj.MultiHeadAttention(
        16, 4, rngs=nnx.Rngs(0)).init_cache(2, -1), ValueError,
     r"max_length must be positive, got -1"),
    ("mha_decode_without_cache", lambda: aj.MultiHeadAttention(
        16, 4, rngs=nnx.Rngs(0))(jnp.ones((2, 3, 16)), decode=True),
     ValueError, r"decode=True needs a cache: call init_cache"),
    ("mha_window", lambda: aj.MultiHeadAttention(
        16, 4, mask=Mask(window=-2), rngs=nnx.Rngs(0)), ValueError,
     r"window must be non-negative, got -2"),
    ("mha_soft_cap", lambda: aj.MultiHeadAttention(
        16, 4, logits_soft_cap=-1.0, rngs=nnx.Rngs(0)), ValueError,
     r"logits_soft_cap must be positive"),
    ("mha_rope_number", lambda: aj.MultiHeadAttention(
        16, 4, rope=10000.0, rngs=nnx.Rngs(0)), TypeError,
     r"rope=10000.0 is a number: .*rope=aj.Rope\(base=10000.0\)"),
    ("mha_rope_base", lambda: aj.MultiHeadAttention(
        16, 4, rope=aj.Rope(base=-1.0), rngs=nnx.Rngs(0)), ValueError,
     r"base must be positive"),
    ("bahdanau_hidden", lambda: aj.BahdanauAttention(
        6, 4, 0, rngs=nnx.Rngs(0)), ValueError,
     r"hidden_features must be positive, got 0"),
]


class InvalidInputTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_raises_with_message(self, call, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      call()

  @parameterized.named_parameters(*MODULE_CASES)
  def test_module_raises_with_message(self, call, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      call()

  @parameterized.named_parameters(*CASES)
  def test_raises_at_trace_time_under_jit(self, call, exception, pattern):
    # The checks read static shapes and dtypes only, so jit raises the same.
    with self.assertRaisesRegex(exception, pattern):
      jax.jit(call)()


class NowAcceptedTest(parameterized.TestCase):
  """Inputs that used to be refused and now have one meaning.

  Per-example mask arrays align to the left of the leading dims, so ``[B]``
  lengths and ``[B, T]`` segment ids against ``[B, N, T, H]`` operands are
  per example even when ``B == N`` (they were refused as ambiguous), and
  ``q_segment_ids`` alone is packed self-attention (it needed key ids).
  """

  B, N, T = 2, 2, 5  # B == N: the reading that used to be ambiguous

  def _qkv(self):
    shape = (self.B, self.N, self.T, 8)
    return tuple(_data.normal(seed, shape) for seed in (20, 21, 22))

  def _check(self, mask, reference_mask, implementation):
    q, k, v = self._qkv()
    out = sdpa(q, k, v, mask, implementation=implementation)
    ref, _ = reference.sdpa(q, k, v, reference_mask)
    np.testing.assert_allclose(out, ref.astype(np.float32), atol=1e-5,
                               rtol=1e-5)
    return out

  @parameterized.parameters("dense", "flash")
  def test_lengths_per_example(self, implementation):
    lengths = np.array([5, 2])  # [B]
    padding = (np.arange(self.T) < lengths[:, None])[:, None, None, :]
    out = self._check(Mask(kv_lengths=lengths), padding, implementation)
    old = sdpa(*self._qkv(), Mask(kv_lengths=lengths[:, None]),
               implementation=implementation)  # [B, 1] still works
    np.testing.assert_array_equal(out, old)

  @parameterized.parameters("dense", "flash")
  def test_segment_ids_per_example(self, implementation):
    q_ids = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])  # [B, T]
    k_ids = np.array([[0, 0, 0, 1, 1], [0, 0, 1, 1, 2]])  # [B, S]
    same = (q_ids[:, None, :, None] == k_ids[:, None, None, :])
    out = self._check(Mask(q_segment_ids=q_ids, kv_segment_ids=k_ids), same,
                      implementation)
    old = sdpa(*self._qkv(), Mask(q_segment_ids=q_ids[:, None, :],
                                  kv_segment_ids=k_ids[:, None, :]),
               implementation=implementation)  # [B, 1, T] still works
    np.testing.assert_array_equal(out, old)

  @parameterized.parameters("dense", "flash")
  def test_query_segment_ids_alone_are_self_attention(self, implementation):
    ids = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])  # [B, T], T == S
    same = (ids[:, None, :, None] == ids[:, None, None, :])
    out = self._check(Mask(q_segment_ids=ids), same, implementation)
    both = sdpa(*self._qkv(), Mask(q_segment_ids=ids, kv_segment_ids=ids),
                implementation=implementation)
    np.testing.assert_array_equal(out, both)


class NoAssertTest(absltest.TestCase):
  """Validation must survive ``python -O``, which strips ``assert``."""

  def test_library_and_experiments_use_no_assert(self):
    import ast  # noqa: PLC0415
    import pathlib  # noqa: PLC0415
    root = pathlib.Path(__file__).resolve().parent.parent
    found = []
    for package in ("attention_jax", "experiments"):
      for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        found += [f"{path.name}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Assert)]
    self.assertEqual(found, [])

  def test_optimised_python_raises_the_same(self):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    code = ("import jax.numpy as jnp, attention_jax as aj\n"
            "try:\n"
            "  aj.scaled_dot_product_attention(jnp.ones((2, 4, 7)),"
            " jnp.ones((2, 6, 8)), jnp.ones((2, 6, 5)))\n"
            "except ValueError as e:\n"
            "  print('ValueError:', e)\n")
    result = subprocess.run([sys.executable, "-O", "-c", code],
                            capture_output=True, text=True, timeout=120,
                            cwd=str(__import__("pathlib").Path(
                                __file__).resolve().parent.parent))
    self.assertIn("ValueError: query and key must have the same head dim H",
                  result.stdout,
                  result.stderr[-2000:])


if __name__ == "__main__":
  absltest.main()
