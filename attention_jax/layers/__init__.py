"""The attention layers as pure functions of their params.

``multi_head`` (with ``multi_head_params``, ``sharding``) is multi-head
attention with GQA, qk-norm, rotary positions and cached decoding;
``latent`` is multi-head latent attention; ``additive`` (Bahdanau) and
``luong`` share ``decoder_attention``. Beside each, its NNX module
(``multi_head_module``, ``latent_module``, ``decoder_attention_module``)
owns the parameters and calls it; ``generate`` runs a model of them.
"""
