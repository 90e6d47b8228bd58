"""The trainer's embedded default corpus: what `raychat.train` prepares when the data directory is empty.

A few ClimbMix shards when the Hub is allowed (RAYCHAT_OFFLINE unset) and answers, else the offline
sample corpus, so one command trains on a fresh box with or without a network.
"""

import os
from collections.abc import Callable
from pathlib import Path

from raychat.common import RaychatError
from raychat.corpus import download
from raychat.corpus.index import list_shards
from raychat.corpus.sample import write_sample_corpus


def prepare_default_corpus(data_dir: str | Path, log: Callable[[str], None] = print) -> str:
    """Fill an empty data_dir with the default corpus; returns "download" or "sample"."""
    data_dir = Path(data_dir).expanduser().resolve()
    if data_dir.is_dir() and list_shards(data_dir):
        raise RaychatError(f"{data_dir} already holds shards: prepare_default_corpus only fills an empty "
                           "corpus directory; check it with `python -m raychat.corpus check`")
    endpoint = download.hub_endpoint()
    if os.environ.get("RAYCHAT_OFFLINE", "") not in ("", "0"):
        log(f"corpus: RAYCHAT_OFFLINE is set, writing the offline sample corpus to {data_dir}")
    elif not download.hub_installed():
        log("corpus: huggingface_hub is not installed (pip install 'raychat[hub]' to download ClimbMix), "
            f"writing the offline sample corpus to {data_dir}")
    elif not download.reachable(endpoint):
        log(f"corpus: {endpoint} is not reachable, writing the offline sample corpus to {data_dir} "
            "(set RAYCHAT_OFFLINE=1 to skip this check)")
    else:
        log(f"corpus: downloading {download.DEFAULT_SHARDS} ClimbMix train shards + the val shard to "
            f"{data_dir}")
        download.download_shards(data_dir, download.DEFAULT_SHARDS, endpoint=endpoint, log=log)
        return "download"
    summary = write_sample_corpus(data_dir, log=log)
    log(f"corpus: sample corpus of {summary.train_docs + summary.val_docs:,} documents written")
    return "sample"
