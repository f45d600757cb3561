"""Where Flower keeps its state: a pickle it loads at start, so never a place another user
can write (`workers/observe/flower.flower_db`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from genfleet.workers.observe.flower import flower_db


def test_by_default_the_state_is_in_the_users_private_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no longer the current directory
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

    db = Path(flower_db(None))

    assert db.name == "flower.db" and tmp_path / "state" in db.parents
    assert not (tmp_path / "flower.db").exists()
    for level in (db.parent, db.parent.parent):
        assert stat.S_IMODE(level.stat().st_mode) == 0o700
        assert level.stat().st_uid == os.getuid()


def test_a_db_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is

    with pytest.raises(SystemExit):
        flower_db(str(shared / "flower.db"))


def test_a_planted_or_open_state_file_is_refused(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    (own / "flower.db").write_bytes(b"")
    assert flower_db(str(own / "flower.db")) == str(own / "flower.db")
    (own / "flower.db.dat").write_bytes(b"")
    (own / "flower.db.dat").chmod(0o666)  # anyone may rewrite what Flower unpickles

    with pytest.raises(SystemExit):
        flower_db(str(own / "flower.db"))
