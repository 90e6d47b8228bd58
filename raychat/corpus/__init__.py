"""The corpus on disk: parquet shards with one string column 'text', the last shard validation.

    files      the shards' bytes through raychat.storage: footers, row groups by range (imports none)
    index      the on-disk layout, corpus.json, the ordered units the cursor deals          (files)
    check      validation and the summary                                   (index)
    writer     CorpusWriter: documents in, shards out                       (index)
    ingest, sample, fixture: sources that write through CorpusWriter
    download   ClimbMix from the Hub via huggingface_hub                     (index)
    default    what the trainer prepares in an empty data directory         (download, sample)
    cli        `python -m raychat.corpus` (__main__ runs it)
"""
