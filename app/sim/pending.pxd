# The compiled build's field declarations for pending.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

cdef class Warm:
    cdef public object key, waiters

cdef class PendingMDWork:
    cdef public object loop, timeout_s, _warms
