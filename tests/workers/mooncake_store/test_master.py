"""The master's lifecycle: started on free ports and ready by condition, stopped, restarted on
the same ports; a binary that cannot start is a clear `MasterUnavailable`."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.mooncake_store import MasterAddress, MasterUnavailable, MooncakeMaster
from workers.mooncake_store.master import master_answers


def test_started_master_answers_and_stops(master: MooncakeMaster) -> None:
    assert master.running()
    assert master_answers(master.address)
    master.stop()
    assert not master.running()
    assert not master_answers(master.address)


def test_killed_master_restarts_on_its_ports(master: MooncakeMaster) -> None:
    address = master.address
    master.kill()
    assert not master_answers(address)
    master.start()
    assert master.address == address
    assert master_answers(address)


def test_binary_that_exits_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho 'cannot bind' >&2\nexit 3\n")
    fake.chmod(0o755)
    m = MooncakeMaster(binary=fake, log_path=tmp_path / "log")
    with pytest.raises(MasterUnavailable, match=r"(?s)exited with 3.*cannot bind"):
        m.start()
    assert not m.running()


def test_address_url_round_trip() -> None:
    a = MasterAddress("10.0.0.5", 50051, 8081)
    assert MasterAddress.parse(a.url) == a
    assert a.metadata_url == "http://10.0.0.5:8081/metadata"
    assert MasterAddress.parse("mooncake://h:1") == MasterAddress("h", 1, 8080)


@pytest.mark.parametrize(
    "text",
    ["redis://h:1", "mooncake://h", "mooncake://h:x", "mooncake://h:1?x=2", "mooncake://h:1/p"],
)
def test_bad_address_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        MasterAddress.parse(text)
