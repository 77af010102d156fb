"""An ordered mapping that is never changed, only replaced.

`evolve` returns a new state per event and never touches the old one (a
decision's resulting state and the cache's must not share a mutable dict). A
dict copied per event made a sandbox with n commands cost O(n²) to fold: ten
thousand commands took 1.6 s here, a hundred thousand would take minutes.
`PMap.set` returns a new map sharing all but O(log n) of the old one (two
hash array mapped tries, `immutables`): one from key to value, one from
insertion number to key, so iteration keeps the order entries were added in,
as a dict's does (a sandbox lists its commands in the order they were queued).
A map of up to `SMALL` entries is a plain dict copied per change: most
sandboxes run a few dozen commands, and for them that is the faster.

Entries are only ever added or replaced: a sandbox's commands and requests
are records that stay. Equality is a Mapping's: a `PMap` equals a dict with
the same items. msgspec encodes it as an object with `enc_hook`, and decodes
a stored state holding maps (the read model's rows, a checkpoint) through its
wire twin (`wire`, `from_wire`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from types import UnionType
from typing import Any, Generic, TypeVar, Union, get_args, get_origin, overload

import immutables
import msgspec

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


# Up to this many entries a map is a plain dict, copied whole per change (for
# a few dozen entries that is faster than the tries, ~0.2 µs against ~0.8).
SMALL = 32
_new = object.__new__


class PMap(Mapping[K, V], Generic[K, V]):
    __slots__ = ("_small", "_items", "_order")

    _small: dict[K, V] | None  # the entries while few (never changed once made)
    _items: immutables.Map[K, V]
    _order: immutables.Map[int, K]

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        # A dict first: its keys keep the order they were first added in (the
        # last value wins), and the tries are then built in one C call each.
        pairs = dict(items)
        if len(pairs) <= SMALL:
            self._small = pairs
        else:
            self._small = None
            self._items = immutables.Map(pairs)
            self._order = immutables.Map(enumerate(pairs))

    @classmethod
    def _large(cls, items: immutables.Map[K, V], order: immutables.Map[int, K]) -> PMap[K, V]:
        new = cls.__new__(cls)
        new._small, new._items, new._order = None, items, order
        return new

    def set(self, key: K, value: V) -> PMap[K, V]:
        """A map with `key` set to `value`; a new key goes last."""
        small = self._small
        if small is not None:
            if len(small) < SMALL or key in small:
                new: PMap[K, V] = _new(PMap)  # (the hot path of every fold: no __init__)
                new._small = {**small, key: value}
                return new
            return PMap({**small, key: value})  # grown out of a dict: to the tries
        order = self._order if key in self._items else self._order.set(len(self._items), key)
        return PMap._large(self._items.set(key, value), order)

    def __getitem__(self, key: K) -> V:
        small = self._small
        return small[key] if small is not None else self._items[key]

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, /, default: V | D) -> V | D: ...
    def get(self, key: K, /, default: Any = None) -> Any:
        small = self._small
        return small.get(key, default) if small is not None else self._items.get(key, default)

    def __contains__(self, key: object) -> bool:
        small = self._small
        return key in small if small is not None else key in self._items

    def __len__(self) -> int:
        small = self._small
        return len(small) if small is not None else len(self._items)

    def __iter__(self) -> Iterator[K]:
        small = self._small
        if small is not None:
            yield from small
            return
        order = self._order
        for i in range(len(order)):
            yield order[i]

    def values(self) -> Any:  # a view of the dict while small: no generator per call
        small = self._small
        return small.values() if small is not None else super().values()

    def items(self) -> Any:
        small = self._small
        return small.items() if small is not None else super().items()

    def __repr__(self) -> str:
        return f"PMap({dict(self.items())!r})"


EMPTY: PMap[Any, Any] = PMap()


def enc_hook(obj: object) -> object:
    """For msgspec encoders of states: a `PMap` is written as a dict."""
    if isinstance(obj, PMap):
        return dict(obj.items())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


# --- decoding straight into typed records ------------------------------------------
#
# A msgspec `dec_hook` is handed a map already decoded as plain dicts, to be
# converted again: a checkpoint holding a million commands was decoded twice,
# the first time into dicts (slower than into structs). A state type's *wire* twin has
# each `PMap[K, V]` field as a `dict[K, V]`, which msgspec decodes straight into
# typed records; `from_wire` then makes the maps in one call each.


_WIRE: dict[type, type] = {}  # wire twin -> the state type it stands for


@cache
def _map_fields(cls: type) -> dict[str, tuple[Any, Any]]:
    return {
        f.name: get_args(f.type) for f in msgspec.structs.fields(cls) if get_origin(f.type) is PMap
    }


def wire(type_: Any) -> Any:
    """`type_` with each struct holding `PMap` fields replaced by its wire twin
    (a union's members too: `Sandbox | None`)."""
    if get_origin(type_) in (Union, UnionType):
        members = tuple(wire(t) for t in get_args(type_))
        return Union[members]  # noqa: UP007 - built from a tuple
    if not (isinstance(type_, type) and issubclass(type_, msgspec.Struct)):
        return type_
    return _twin(type_) if _map_fields(type_) else type_


@cache
def _twin(type_: Any) -> type:
    """The wire twin of a struct with `PMap` fields (one per type)."""
    maps = _map_fields(type_)
    config = type_.__struct_config__
    spec = []
    for f in msgspec.structs.fields(type_):
        kind = f.type
        if f.name in maps:
            key, value = maps[f.name]
            kind = dict[key, value]  # type: ignore[valid-type]
        if f.default is not msgspec.NODEFAULT:
            spec.append((f.name, kind, msgspec.field(default=f.default, name=f.encode_name)))
        elif f.default_factory is not msgspec.NODEFAULT:
            factory = f.default_factory
            spec.append((f.name, kind, msgspec.field(default_factory=factory, name=f.encode_name)))
        else:
            spec.append((f.name, kind, msgspec.field(name=f.encode_name)))
    twin = msgspec.defstruct(
        f"{type_.__name__}Wire",
        spec,
        kw_only=True,
        omit_defaults=config.omit_defaults,
        forbid_unknown_fields=config.forbid_unknown_fields,
        array_like=config.array_like,
        tag=config.tag,
        tag_field=config.tag_field,
    )
    _WIRE[twin] = type_
    return twin


def from_wire(value: Any) -> Any:
    """The state a wire twin decoded stands for (anything else as it is)."""
    of = _WIRE.get(type(value))
    if of is None:
        return value
    fields = msgspec.structs.asdict(value)
    for name in _map_fields(of):
        fields[name] = PMap(fields[name])
    return of(**fields)
