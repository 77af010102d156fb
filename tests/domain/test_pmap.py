"""The persistent map under a sandbox's commands and requests."""

from __future__ import annotations

import msgspec
from sandhold.domain.host import Host
from sandhold.domain.pmap import EMPTY, SMALL, PMap, enc_hook, from_wire, wire
from sandhold.domain.sandbox import Sandbox

from tests.domain.history import RUNNING, given_sandbox
from tests.domain.test_long_lived import _ran
from tests.domain.test_long_lived_saves import _saved


def test_set_returns_a_new_map_and_leaves_the_old_one_as_it_was() -> None:
    one = EMPTY.set("a", 1)
    two = one.set("b", 2)
    three = two.set("a", 10)
    assert dict(one) == {"a": 1}
    assert dict(two) == {"a": 1, "b": 2}
    assert dict(three) == {"a": 10, "b": 2}
    assert EMPTY == {} and len(EMPTY) == 0


def test_iteration_keeps_the_order_keys_were_first_added_in() -> None:
    keys = [f"k{i}" for i in range(200, 0, -1)]  # not sorted, not hash order
    m: PMap[str, int] = EMPTY
    for i, key in enumerate(keys):
        m = m.set(key, i)
    m = m.set(keys[5], -1)  # replacing keeps its place
    assert list(m) == keys
    assert list(m.values())[5] == -1
    assert list(PMap(m.items())) == keys


def test_it_reads_and_compares_as_a_dict_does() -> None:
    m = PMap({"x": 1, "y": 2})
    assert m == {"x": 1, "y": 2} and m == {"y": 2, "x": 1}
    assert m != {"x": 1} and m != PMap({"x": 1, "y": 3})
    assert m["x"] == 1 and m.get("z") is None and m.get("z", 0) == 0
    assert "y" in m and "z" not in m
    assert {**m} == {"x": 1, "y": 2}


def test_a_map_grown_past_a_dict_reads_the_same() -> None:
    grown: PMap[int, str] = EMPTY
    for i in range(SMALL + 5):
        grown = grown.set(i, str(i))
        expected = {k: str(k) for k in range(i + 1)}
        assert grown == expected and list(grown.items()) == list(expected.items())
        assert list(grown.values()) == list(expected.values()) and len(grown) == i + 1
    assert grown.set(0, "zero")[0] == "zero" and grown[0] == "0"


def test_a_stored_state_decodes_through_its_wire_twin_to_the_same_state() -> None:
    """The read model (JSON) and checkpoints (msgpack) decode a sandbox's maps
    straight into typed records, then into maps: the state read back equals the
    one written, its maps are maps again, large ones included."""
    state = given_sandbox(*RUNNING, *_ran(40), *_saved(3))
    assert len(state.commands) > SMALL and 0 < len(state.saves) < SMALL
    for encoder, decoder in (
        (msgspec.json.Encoder(enc_hook=enc_hook), msgspec.json.Decoder),
        (msgspec.msgpack.Encoder(enc_hook=enc_hook), msgspec.msgpack.Decoder),
    ):
        back = from_wire(decoder(wire(Sandbox)).decode(encoder.encode(state)))
        assert type(back) is Sandbox and back == state
        assert isinstance(back.saves, PMap) and isinstance(back.commands, PMap)
        assert list(back.commands) == list(state.commands)  # the order it was written in
        maybe = decoder(wire(Sandbox | None))
        assert from_wire(maybe.decode(encoder.encode(None))) is None
    assert wire(Sandbox) is wire(Sandbox)  # one twin per type
    assert wire(Host) is Host  # no maps: decoded as it is
