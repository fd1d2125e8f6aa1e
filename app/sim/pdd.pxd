# The compiled build's field declarations for pdd.py (app/native.py): Twin's state (app/sim/twin.py), declared
# on its base so the pipelines' methods read it directly too (tests/unit/test_native.py checks the list).

from app.sim.work cimport PrefillJob, Seq
from app.sim.jobs cimport Gaps, Job

cdef class PDDPipelines:
    cdef public object config, mode, loop, cluster, block, window, block_bytes, routing, handoff, P, R, M, intra, wan
    cdef public object ow, wan_facts, wan_backlog, pending, serving_overhead_s, overhead_per_in_flight_s, decoder_overhead_s, outages, replicas, pulls, candidates, rooms, index
    cdef public object _load, keymaker, _cluster_facts, sessions, results, progress, finished, delayed_turns, warm_roles
    cdef public Gaps gaps
    cdef public object _arrivals, _rid
