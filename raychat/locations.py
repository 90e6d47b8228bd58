"""What a location string is: a local path or a URI whose query configures the filesystem, and the
credentials it may carry kept out of every message (`redact`, `SafeLocation`).

A child is joined onto the URI's path, never appended after its `?query` and never through `pathlib`
(which folds `s3://` to `s3:/`). Apart from raychat.storage because every command shows locations,
and only storage opens them.
"""

import re
from pathlib import Path
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from raychat.common import RaychatError


def is_uri(location: str) -> bool:
    return "://" in location


def join_uri(location: str, *names: str) -> str:
    """`location`/`names` for a local path or a URI, keeping a URI's ?query at the end (and a
    SafeLocation's credentials, out of sight)."""
    names = tuple(n.strip("/") for n in names if n.strip("/"))
    if not names:
        return location
    if isinstance(location, SafeLocation):
        return SafeLocation(join_uri(location.unredacted(), *names))
    if not is_uri(location):
        return str(Path(location, *names))
    parts = urlsplit(location)
    path = "/".join([parts.path.rstrip("/"), *names])
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))


# Query parameters that carry credentials (pyarrow's S3 options access_key, secret_key, session_token,
# and their like on other stores), matched anywhere in the name.
SECRET_PARAM = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)
# Query parameters that name a server (pyarrow's endpoint_override, proxy_options, ...): a value may
# carry a user:password@ of its own, which no pyarrow filesystem takes and its errors would print.
ADDRESS_PARAM = re.compile(r"endpoint|proxy|url|uri|host", re.IGNORECASE)
# Such a value's user:password@, up to its last '@' (a password may hold one): group 2.
VALUE_USERINFO = re.compile(r"^((?:[a-zA-Z][\w+.-]*://)?)(.*)@")


def _split(uri: str) -> SplitResult | None:
    """urlsplit, or None for what it cannot parse (a '[' or ']' outside an IPv6 host)."""
    try:
        return urlsplit(uri)
    except ValueError:
        return None


def _hidden_userinfo(uri: str) -> tuple[int, int] | None:
    """Where a URI's own user:password sits when a raw '/', '?' or '#' in it hid it from urlsplit
    (`s3://KEY:ab/cd@bucket/...` parses as host "KEY:ab"): from after "://" to its '@' (the last
    before the first '=': a query value's own '@' comes after that), or None."""
    parts = _split(uri)
    if parts is None:
        return None
    netloc = parts.netloc
    if "@" in netloc or ":" not in netloc:  # a bucket name holds no ':'; a host:port is a guess away
        return None
    start = uri.index("://") + 3
    equals = uri.find("=", start)
    end = uri.rfind("@", start, equals if equals >= 0 else len(uri))
    return (start, end) if end > start else None


def _value_userinfo(name: str, value: str) -> re.Match | None:
    """The user:password@ a server-naming parameter's value carries, if any."""
    return VALUE_USERINFO.match(value) if ADDRESS_PARAM.search(name) or "://" in value else None


def _redact_param(name: str, value: str) -> str:
    if SECRET_PARAM.search(name):
        return "***"
    return VALUE_USERINFO.sub(r"\1***@", value) if _value_userinfo(name, value) else value


def redact(location: str) -> str:
    """`location` safe to print, log or store: a URI's user:password@ (`s3://KEY:SECRET@bucket/...`),
    any credential-like query parameter and a parameter's own user:password@ become `***`, and so
    does a fragment (a raw '#' in a password puts the rest of it there)."""
    if not is_uri(location):
        return location
    if (hidden := _hidden_userinfo(location)) is not None:
        location = location[:hidden[0]] + "***" + location[hidden[1]:]
    parts = _split(location)
    if parts is None:  # nothing of it can be told apart from a secret
        return location.split("://", 1)[0] + "://***"
    if parts.fragment:
        parts = parts._replace(query="***" if parts.query else "", fragment="***")
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, _redact_param(k, v)) for k, v in pairs], safe="*:/@")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class SafeLocation(str):
    """A location whose credentials cannot be printed: its value, and with it every str(), repr,
    f-string, join, `json.dumps` and Ray's run state of it, is the redacted URI. The full URI rides
    along (pickled with it, so a worker can open the bucket) and is read only where a filesystem is
    built (`Storage`) and where a child location is made from it (`join_uri`)."""

    def __new__(cls, uri: str) -> "SafeLocation":
        uri = uri.unredacted() if isinstance(uri, SafeLocation) else uri
        self = super().__new__(cls, redact(uri))
        self._uri = uri
        return self

    def unredacted(self) -> str:
        """The URI with its credentials: for `pyarrow.fs` only, never for a message."""
        return self._uri

    def scrub(self, text: str) -> str:
        """`text` (an error from the filesystem, say) with this location's credentials as `***`."""
        if not is_uri(self._uri):
            return text
        text = text.replace(self._uri, self)
        parts = _split(self._uri)
        if parts is None:
            return text
        secrets = [parts.username, parts.password]
        if (hidden := _hidden_userinfo(self._uri)) is not None:
            secrets += self._uri[hidden[0]:hidden[1]].split(":", 1)
        query = f"{parts.query}#{parts.fragment}" if parts.fragment else parts.query  # a raw '#' cut it
        for name, value in parse_qsl(query):
            if SECRET_PARAM.search(name):
                secrets.append(value)
            elif (inner := _value_userinfo(name, value)) is not None:
                secrets += inner.group(2).split(":", 1)
        for secret in filter(None, secrets):
            text = text.replace(secret, "***").replace(unquote(secret), "***")
        return text


def normalize_location(location: "str | Path") -> SafeLocation:
    """An absolute local path (user and relative paths resolved) or the URI as given, as a
    SafeLocation (which keeps the credentials a URI may carry out of every message)."""
    uri = location.unredacted() if isinstance(location, SafeLocation) else str(location)  # str(): a Path
    if not is_uri(uri):
        return SafeLocation(str(Path(uri).expanduser().resolve()))
    check_uri(uri)
    return SafeLocation(uri if "?" in uri else uri.rstrip("/"))


def check_uri(uri: str) -> None:
    """Refuse, in one line that shows no secret, what no filesystem can open and its errors would
    print: a fragment (a '#' not written %23), a server parameter with a user:password@ of its own."""
    if _split(uri) is None:
        raise RaychatError(f"{redact(uri)}: not a URI raychat can read (a '[' or ']' outside an IPv6 host "
                           "address): write them %5B and %5D")
    if _hidden_userinfo(uri) is not None:
        raise RaychatError(f"{redact(uri)}: the URI's user:password holds a raw '/', '?' or '#', which "
                           "ends it early (and the filesystem's errors would print it): write them %2F, "
                           "%3F and %23")
    parts = urlsplit(uri)
    if parts.fragment:
        raise RaychatError(f"{redact(uri)}: a '#' in a storage URI must be written %23 (a password "
                           "holding one, say): as it is, everything after it is cut off")
    for name, value in parse_qsl(parts.query):
        if _value_userinfo(name, value) is not None and not SECRET_PARAM.search(name):
            raise RaychatError(f"{redact(uri)}: {name} carries a user:password@, which pyarrow's "
                               "filesystems do not take (and their errors would print): give the "
                               "credentials as the URI's own (s3://KEY:SECRET@bucket/...) or its "
                               "access_key and secret_key parameters")
