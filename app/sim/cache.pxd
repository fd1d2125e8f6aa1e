# The compiled build's field declarations for cache.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

cdef class PrefixCache:
    cdef public object limit, used, held, block, entries, pinned, evicted_tokens
