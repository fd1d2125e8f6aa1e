# The compiled build's field declarations for routing.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

cdef class KeyChain:
    cdef public tuple segs
    cdef public object n

cdef class _Group:
    cdef public object gid, line
    cdef public list pieces

cdef class RunLRU:
    cdef public object capacity, order, total, _gid
    cdef public dict lines

cdef class RunReplicaCache:
    cdef public object held, routed

cdef class Conversation:
    cdef public object segs, blocks

cdef class KeyMaker:
    cdef public object block, _lines
