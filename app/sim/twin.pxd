# The compiled build's declaration of Twin (app/native.py): its fields are declared on its base (pdd.pxd).

from app.sim.pdd cimport PDDPipelines

cdef class Twin(PDDPipelines):
    pass
