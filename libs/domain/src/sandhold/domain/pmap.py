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
the same items. msgspec encodes and decodes it as an object with `enc_hook`
and `dec_hook` (a stored state: the read model's rows, a checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar, get_args, get_origin, overload

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


def dec_hook(type_: Any, obj: object) -> object:
    """For msgspec decoders of states: `PMap[K, V]` is read from an object."""
    if get_origin(type_) is PMap or type_ is PMap:
        key, value = get_args(type_) or (Any, Any)
        return PMap(msgspec.convert(obj, dict[key, value], dec_hook=dec_hook))  # type: ignore[valid-type]
    raise NotImplementedError(f"cannot decode {type_!r}")
