# The compiled build's field declarations for events.py's classes (app/native.py): the fields
# its methods assign, no more (tests/unit/test_native.py checks); typed self.* reads skip the attribute lookup.

cdef class Loop:
    cdef public object now, heap, order, events
