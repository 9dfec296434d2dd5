"""Everything that involves other ranks: collectives (``collectives``), the device each rank
loads onto (``devices``) and preemption (``preempt``).

Every helper works with and without a process group (one process: rank 0 of 1). Functions that
run collectives say "must be called on all ranks".
"""
