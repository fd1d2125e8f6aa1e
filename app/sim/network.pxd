# The compiled build's field declarations for network.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

cdef class Link:
    cdef public object loop, model, bw, vt, t_last, heap, version, _order, bytes, transfers, wan, down, pull_s, pull_s_per_byte

cdef class PullSlots:
    cdef public object loop, free, waiting, smallest_first, tickets
