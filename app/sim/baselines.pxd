# The compiled build's declaration of BaselinePipelines (app/native.py): its fields are declared on its base (pdd.pxd).

from app.sim.work cimport PrefillJob
from app.sim.jobs cimport Job
from app.sim.pdd cimport PDDPipelines

cdef class BaselinePipelines(PDDPipelines):
    pass
