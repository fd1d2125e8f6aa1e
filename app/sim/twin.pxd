# The compiled build's declaration of Twin (app/native.py): its fields are declared on its base (pdd.pxd).

from app.sim.work cimport PrefillJob, Seq
from app.sim.jobs cimport Job
from app.sim.baselines cimport BaselinePipelines

cdef class Twin(BaselinePipelines):
    pass
