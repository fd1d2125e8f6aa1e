# The compiled build's field declarations for jobs.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

from app.sim.engine cimport Instance
from app.sim.work cimport Lease, Seq


cdef class Session:
    cdef public object divs, stream, conv, busy, waiting

cdef class Job:
    cdef public object rid, req, sess, gen, pipe, keys, full, t_first, t_last, gap, done
    cdef public Instance p, d, r, md
    cdef public Lease pl, dl, rl
    cdef public object pulls, seq, relay
    cdef public object relay_tokens, t_relay_last, handed, wan, wan_planned, wan_place, gap_predicted, t_prev, off
    cdef public object after, warm, catch_up, row

cdef class Gaps:
    cdef public object correction, keys, pending, ow
