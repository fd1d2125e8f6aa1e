cdef class KeyChain:
    cdef public tuple segs
    cdef public object n

cdef class _Group:
    cdef public object gid, line
    cdef public list pieces

cdef class RunLRU:
    cdef public object capacity, order, total, _gid
    cdef public dict lines
