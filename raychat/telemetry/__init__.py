"""What a run tells the people watching it, and where its time went.

    metrics        the step record, nanochat's log line, and the publisher that fans records to sinks
    sinks          the log line, Ray's gauges, wandb and Ray Train's reports
    metrics_log    the run's metrics.jsonl, and the timeline read from it
    append_writer  the metrics log's writes off the training thread (a bucket: a new part each time)
    ledger         where the run's time went (goodput)
    console        the driver's console: the run's lines bare, Ray's forwarded as Ray prints them
"""
