"""What changes a score, and where tokens stand.

``score_mods`` holds the ``score_mod(score, b, h, q_idx, kv_idx)`` contract
and the built-in modifiers (ALiBi, soft cap, T5 relative bias); ``rope`` the
rotary position description (``Rope``, in ``rope_spec``; its frequencies in
``rope_frequencies``, its checks in ``rope_checks``) and its application
(``rope_apply``).
"""
