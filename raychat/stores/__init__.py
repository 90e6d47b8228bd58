"""The requests raychat makes of a bucket that pyarrow's filesystems do not expose: an exclusive
create (what a run's lease rests on), one whole read of one version, and the endpoint a URI names.

raychat.storage reads and writes everything else through pyarrow (as Ray Train and Ray Data do); it
turns to the module for the location's scheme (`bucket_api`) only for these. Each module offers
the same functions, so Storage never asks which store it is on beyond that lookup:

    create_exclusive(location, path, data, shown) -> bool   # False: something is there already
    read_whole(location, path, shown) -> bytes             # FileNotFoundError when it is not there
    endpoint(location) -> (host, port) | None              # the endpoint_override, for the pre-flight

GCS needs more of its module than these (raychat.stores.gcs: the filesystem built from the URI's
query, lookups, listings and deletes by prefix, the credentials checked at start), which Storage asks
of gs:// locations alone.
"""

from types import ModuleType
from urllib.parse import urlsplit

from raychat.locations import SafeLocation
from raychat.stores import gcs, s3

APIS = {"s3": s3, "gs": gcs}  # (each imports its client library when first used)


def bucket_api(location: SafeLocation) -> ModuleType | None:
    """raychat.stores.s3 or raychat.stores.gcs for a location in such a bucket, None for anything else
    (local disk, NFS, a store raychat only reads and writes through pyarrow)."""
    return APIS.get(urlsplit(location).scheme)
