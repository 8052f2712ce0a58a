"""The shared numerics and validation every layer above builds on.

Internal as a whole: argument checks that name the argument, the shapes and
the fix (``checks``); compute dtypes, bool masks and the zeroing of unseen
keys (``numerics``); GQA as a reshape, one ``vmap`` per leading dim and
the kernels' ``Result`` (``broadcast``); whether a score
modifier is elementwise (``elementwise``); the fully-masked-row softmax
(``softmax``) and the exact log-sum-exp merge (``merge``). The public names
among them reach users as ``aj.*`` (``aj.masked_softmax``,
``aj.merge_attentions``).
"""
