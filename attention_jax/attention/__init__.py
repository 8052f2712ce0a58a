"""The attention functions over the kernels.

``dot_product`` is ``scaled_dot_product_attention`` (prepare the call once,
then run the first kernel that fits); ``blockwise`` and ``ring`` run it with
the flash and ring kernels; ``explain`` reports what a call would run.
"""
