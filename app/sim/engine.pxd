# The compiled build's field declarations for engine.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

cdef class Lease:
    cdef public object key, hit, held, pinned, divergences

cdef class PrefillJob:
    cdef public object owner, left, ctx, need, lease, cb, admitted

cdef class Seq:
    cdef public object owner, ctx, n, need, lease, cb, state, join, fin, t_first, log0, inst

cdef class Host:
    cdef public object members, busy

cdef class Instance:
    cdef public object loop, name, perf, max_seqs, max_batched, capacity, block, cache, kv_blocks, reserved, active
    cdef public object streams, state, prefill_q, admitted_prefills, join_q, n, kv, steps, fin_heap, _order, removals
    cdef public object log_n, mono_i, mono_v, trim_at, version, t0, s0, m, ramp, step_dt, chunks, cut, busy_s
    cdef public object prefill_tokens, decode_tokens, host, neighbor_slowdown, busy, slow, step_joined
