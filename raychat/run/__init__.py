"""One training run on Ray.

    driver         the driver library shared by raychat.train and tune.sweep
    cluster_address  which Ray a command joins: RAY_ADDRESS checked first, else a local instance
    lease          one driver per run: the lease epoch and its heartbeat
    worker_setup   a worker's set-up: model, optimizer, loader, checkpoint, sinks
    loop           the step loop
    step           one optimizer step in plain PyTorch
    validation     validation bits per byte and the sample prompts
    core_metric    the CORE metric in a run (raychat.evaluation)
    checkpointing  what each rank saves and reads back
    cadence        when to save
    elastic        coordination with Ray Train across failures and resizes
    coordinator    the run's actor: its attempts, resize requests, replica holders, final report
    replicas       the memory tier: each rank's state sent to peer memory, and restored from it
    holders        the actors that keep those replicas, one per node
    metrics        the log line, and the publisher that fans records out to its sinks
    metrics_log    the run's metrics.jsonl, and the timeline read from it
    append_writer  the metrics log's writes off the training thread (a bucket: a new part each time)
    nccl_transport which link NCCL chose between nodes, said once at start
    ledger         where the run's time went (goodput)
    console        the driver's console
    quiet          Ray's chatter silenced
    runtime_env    the environment workers get
    ray_internals  every private Ray API the above use
"""
