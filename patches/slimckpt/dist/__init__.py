"""Ranks together: how every rank of a job ends a collective step the same way, and which rank is gone.

1. `outcome`: run a step on every rank, gather what failed where, raise the same error everywhere.
2. `heartbeat`: each process beats in the job's store; a rank that stops beating is named.
3. `lost_rank`: a collective that lost a rank (killed, or stalled past the group's timeout) becomes one
   error naming the rank, raised on every rank left.
"""
