"""Gateways sharing a data dir: a read model each, and never one file written by two."""

from __future__ import annotations

from pathlib import Path

import pytest
from sandhold.bus.names import Names
from sandhold.gateway.__main__ import read_model_path
from sandhold.gateway.readmodel import ReadModel, ReadModelInUse


def test_each_gateway_instance_has_its_own_read_model_by_default(tmp_path: Path):
    plain = read_model_path(tmp_path)
    assert plain == read_model_path(tmp_path, "gateway") == tmp_path / "gateway/read-model.sqlite"
    one, two = read_model_path(tmp_path, "gateway-1"), read_model_path(tmp_path, "gateway-2")
    assert len({plain, one, two}) == 3
    assert one == tmp_path / "gateway" / "gateway-1" / "read-model.sqlite"
    for bad in ("", "..", "../x", "a/b"):
        with pytest.raises(ValueError):
            read_model_path(tmp_path, bad)


async def test_a_second_writer_of_one_read_model_is_refused(tmp_path: Path):
    path = tmp_path / "gateway" / "read-model.sqlite"
    first = await ReadModel(path, Names("sh")).open()
    try:
        with pytest.raises(ReadModelInUse, match="another gateway"):
            await ReadModel(path, Names("sh")).open()
    finally:
        await first.close()
    again = await ReadModel(path, Names("sh")).open()  # free once the first closed
    await again.close()
