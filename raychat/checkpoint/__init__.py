"""Checkpoints in the run's storage.

    format     the directory, its manifest, listing, lineage and pruning
    meta       CheckpointMeta: the typed record in meta.json
    shardfile  one rank's safetensors file, written as a stream, read by byte range
    sharded    writing: every rank what it owns, rank 0 closes the checkpoint
    reader     reading by byte range, verified as it goes; load_checkpoint for one process
    saver      the asynchronous writer a run saves through
    resume     which checkpoint a restart resumes from, and the one a command reads (find_checkpoint)
    fence      lease epochs: who may write a run, and what a superseded writer left
    stop_note  the note a stopped run leaves
    nanochat   nanochat's checkpoint layout, read to start from its weights
    convert    `python -m raychat.checkpoint.convert`: old single-file checkpoints to sharded ones
"""
