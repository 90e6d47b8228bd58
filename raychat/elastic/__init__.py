"""Fault tolerance: a run that loses workers, nodes or its driver loses as little as it must.

    lease        one driver per run: the lease epoch and its heartbeat
    controller   Ray Train controller callbacks: the save before a planned resize, restarts noted
    coordinator  the run's actor: its attempts, resize requests, replica holders, final report
    signals      rank 0's side: save requests that ride on the step's all-reduce, the restart line
    cadence      when to save (--save-every 0: chosen from measured costs)
    replicas     the memory tier: each rank's state sent to peer memory, and restored from it
    holders      the actors that keep those replicas, one per node
"""
