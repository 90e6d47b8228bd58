"""Typed records for whatever crosses a process boundary or lands in a file another process reads.

The driver's config for the workers, the stop note, the coordinator's attempt record, the final
result and every part of a checkpoint's meta.json are dataclasses mixing in `Record`: written with
`to_dict` (plain values, nested records as nested dicts, the record's version under its version
key) and read back with `from_dict`, which fails in one line naming the record and the field that
is unknown, missing or of the wrong kind (a plain field's value checked against its annotation: a
str where an int is declared, a list where a float is). A typo in a key is then found by the first
test that writes and reads the record, not at run time on a cluster.

A dict without a version key was written before its record existed (raychat kept these as plain
dicts; existing checkpoints hold them): it is read as before, dropping the fields the record no
longer has. Every dict a record writes carries its version and is read strictly; an older version
goes through the record's `upgrade`, a newer one is refused.
"""

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, TypeVar

from raychat.common import RaychatError

R = TypeVar("R", bound="Record")  # typing.Self is 3.11+; raychat runs on 3.10


class RecordError(RaychatError):
    """A record's dict does not fit its class: an unknown or missing field, a value of the wrong kind,
    or a newer version."""


class Record:
    """Mixin for a dataclass that another process reads: `to_dict`/`from_dict` with a version."""

    VERSION: ClassVar[int] = 1
    VERSION_KEY: ClassVar[str] = "version"

    def to_dict(self) -> dict[str, Any]:
        """Plain values (nested records as dicts, tuples as lists) and the version."""
        values = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {**values, self.VERSION_KEY: self.VERSION}

    @classmethod
    def upgrade(cls, values: dict[str, Any], version: int) -> dict[str, Any]:
        """`values` written at an older `version`, as this version's fields (override per record)."""
        return values

    @classmethod
    def from_dict(cls: type[R], values: Any, where: str = "", path: str = "") -> R:
        """The record `to_dict` wrote; RecordError naming the record and the field that does not fit
        (unknown, missing, or a value of another kind than its annotation: see `_fits`).
        `where` (a file, a config name) starts the message; `path` is where a nested record sits in
        the outermost one (CheckpointMeta.cursor.ranks[1])."""
        name = ": ".join(filter(None, (where, path, cls.__name__)))
        if not isinstance(values, dict):
            raise RecordError(f"{name} is not an object (got {type(values).__name__})")
        values = dict(values)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        typed = cls.VERSION_KEY in values
        version = values.pop(cls.VERSION_KEY, 1)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= cls.VERSION:
            raise RecordError(f"{name} has version {version!r}, this raychat reads versions 1 to "
                              f"{cls.VERSION}: upgrade raychat to read it")
        if not typed:  # from before the record existed: its fields that are still ours
            values = {key: value for key, value in values.items() if key in fields}
        if version < cls.VERSION:
            values = cls.upgrade(values, version)
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise RecordError(f"{name} has an unknown field {unknown[0]!r} (its fields: {', '.join(fields)})")
        missing = [key for key, f in fields.items() if key not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise RecordError(f"{name} lacks the field {missing[0]!r}")
        hints, inside = _hints(cls), path or cls.__name__
        for key, value in values.items():
            if not _fits(hints[key], value):
                raise RecordError(f"{name} has the field {key!r} of the wrong kind: expected "
                                  f"{_kind(hints[key])}, got {_kind(type(value))}")
        return cls(**{key: _typed(hints[key], v, where, f"{inside}.{key}") for key, v in values.items()})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fits(hint: Any, value: Any) -> bool:
    """Whether `value` is of the kind a field annotated `hint` holds, at the outer level: int (not
    bool), float (an int too: a whole number as another tool writes it), str, bool, None only where the
    annotation allows it, a list or tuple for list[...]/tuple[...], a dict for dict[...]. A nested
    record checks its own fields (from_dict); other types (a Ray ObjectRef) are not plain and pass."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(member, value) for member in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return value is None
    if value is None:
        return hint is Any
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if (origin or hint) in (list, tuple):
        return isinstance(value, list | tuple)  # to_dict writes tuples as lists; a pickle keeps them
    if (origin or hint) is dict:
        return isinstance(value, dict)
    return True


def _kind(hint: Any) -> str:
    """A type or annotation as the error names it: int, float or None, list, dict, Cursor; a type
    from outside the builtins with its module (numpy.bool_, not a second "bool")."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(_kind(member) for member in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return "None"
    hint = typing.get_origin(hint) or hint
    name = getattr(hint, "__name__", str(hint))
    module = getattr(hint, "__module__", "builtins")
    return name if module in ("builtins", __name__) or module.startswith("raychat") else f"{module}.{name}"


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    return value


def _typed(hint: Any, value: Any, where: str, path: str) -> Any:
    """`value` as a field annotated `hint` holds it: nested records built, lists and tuples rebuilt."""
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict(value, where, path)
    if origin in (types.UnionType, typing.Union):
        # X | None: the one non-None member (the annotations here use no other unions of records)
        members = [a for a in args if a is not type(None)]
        return _typed(members[0], value, where, path) if len(members) == 1 else value
    if origin in (list, tuple) and isinstance(value, list | tuple):
        item = args[0] if args else Any
        items = [_typed(item, v, where, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return {key: _typed(args[1], v, where, f"{path}[{key!r}]") for key, v in value.items()}
    return value
