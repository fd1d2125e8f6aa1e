# The compiled build's field declarations for perf.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

cdef class Roofline:
    cdef public object flops_s, bytes_s, flops_per_token, attn_flops, active_bytes, total_bytes, kv_bytes, overhead_s

cdef class DecodeRamp:
    cdef public object p0, p1, q0, q1, split, head
