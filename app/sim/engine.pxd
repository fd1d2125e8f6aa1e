# The compiled build's field declarations for engine.py's Instance (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

from app.sim.cache cimport PrefixCache
from app.sim.events cimport Loop
from app.sim.perf cimport DecodeRamp
from app.sim.work cimport Host, Lease, PrefillJob, Seq, StepLog


cdef class Instance:
    cdef public Loop loop
    cdef public PrefixCache cache
    cdef public DecodeRamp ramp
    cdef public Host host
    cdef public StepLog steplog
    cdef public object name, perf, max_seqs, max_batched, capacity, block, kv_blocks, reserved, active
    cdef public object streams, state, prefill_q, admitted_prefills, join_q, n, kv, steps, fin_heap, _order, removals
    cdef public object version, t0, s0, m, step_dt, chunks, cut, busy_s
    cdef public object prefill_tokens, decode_tokens, neighbor_slowdown, pulled_first_step, busy, slow, step_joined
