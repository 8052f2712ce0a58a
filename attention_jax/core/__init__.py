"""The shared numerics and validation every layer above builds on.

Internal as a whole: what happens to inputs (``checks``): argument checks
that name the argument, the shapes and the fix, and the numerics policies
(compute dtypes, bool masks, NaN or inf reaching only the rows that see
it); whether a score
modifier is elementwise (``elementwise``); the fully-masked-row softmax
(``softmax``) and the exact log-sum-exp merge (``merge``). The public names
among them reach users as ``aj.*`` (``aj.masked_softmax``,
``aj.merge_attentions``).
"""
