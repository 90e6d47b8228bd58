"""raychat: pretrain nanochat-style GPT models on a Ray cluster.

Sub-packages, lowest first: corpus (shards on disk), tokenizer, data (the feed of one rank), model,
optim, checkpoint, evaluation (bits per byte, CORE), ray_glue (where raychat meets Ray), telemetry
(metrics, the run's log, goodput), elastic (leases, resizes, save cadence, memory replicas), worker
(what each Ray Train worker runs), run (the driver), report. Modules beside them:

    common     where files live, and the one-line RaychatError
    storage    one seam for every read and write: local disk, NFS or a bucket
    faults     transient faults retried within a budget, the rest raised once
    records    typed records that cross a process boundary or land in a file
    config     TrainConfig and the command line built from it
    scaling    depth -> horizon, batch size, learning rates; the schedules
    plan       the resolved plan of a run (`python -m raychat.plan`)
    memory     how much memory a rank needs, before the run starts
    train      `python -m raychat.train`: the command line over raychat.run.driver
    sample     `python -m raychat.sample`: text from a run's checkpoint
    evaluate   `python -m raychat.evaluate core`: a checkpoint's CORE score (raychat.evaluation)
    export     `python -m raychat.export --to nanochat`
    status     `python -m raychat.status`: where a run stands, from Ray Train's state API
"""

__version__ = "0.1.0"
