# The compiled build's field declarations for work.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks).


cdef class Lease:
    cdef public object key, hit, held, pinned, divergences

cdef class PrefillJob:
    cdef public object owner, left, ctx, need, cb, admitted
    cdef public Lease lease

cdef class Seq:
    cdef public object owner, ctx, n, need, cb, state, join, fin, t_first, log0, prefills_first, inst
    cdef public Lease lease

cdef class StepLog:
    cdef public object n, idx, worst, trim_at

cdef class Host:
    cdef public object members, busy
