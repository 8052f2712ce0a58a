"""The key/value caches the layers write into while decoding.

``kv_cache`` holds the pure cache updates (a linear cache, a ring buffer,
their overflow flag); ``cache_step`` what one cached decoding step does:
``KVCache``, its ``write`` and the call's ``Mask`` over the cache slots.
``paged_cache`` holds a pool of pages shared by many sequences and its
bookkeeping (page tables, reference counts, copy on write); ``quantize``
int8/float8 storage with a scale per token and head. Attention does not
read through pages or quantised storage yet.
"""
