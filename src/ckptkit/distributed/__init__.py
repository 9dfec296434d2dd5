"""Everything that involves other ranks: collectives, the rank-0 write protocol, background
saves, checkpoint folders and preemption.

Every helper works with and without a process group (one process: rank 0 of 1). Functions that
run collectives say "must be called on all ranks".
"""
