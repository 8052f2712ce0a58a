"""What may attend: the mask values, dense mask arrays and block tables.

``mask`` holds ``Mask`` (causal, window, lengths, segment ids, a dense array,
a rule, positions), ``MaskRule``, ``BlockMask`` and ``Union``; ``arrays``
the dense helpers (``causal_mask``, ``padding_mask``, ...); ``block_tables``
builds a rule's block tables (``aj.block_mask``); ``intervals`` is the
pattern predicate and the exact empty/full block intervals the kernels walk.
"""
