"""pipeline.wire.dirpin: a pinned data directory is told apart from whatever its path leads to
later (moved away, a link or another folder at its name), in one line that says how to go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.wire.dirpin import DirPin, real_parent
from pipeline.wire.errors import DataDirMovedError


def test_a_pin_holds_while_the_path_leads_to_the_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    pin = DirPin.take(str(data))
    (data / "inside").mkdir()  # what is in it changes nothing
    assert pin.moved() == ""
    pin.check()


@pytest.mark.parametrize("how, now", [
    ("moved", "it leads to nothing now (No such file or directory)"),
    ("a link", "it leads to another folder now ({elsewhere})"),
    ("a link above", "it leads to another folder now ({elsewhere}/data)"),
    ("another folder", "another folder is there now"),
])
def test_a_path_that_leads_elsewhere_stops_the_run_naming_it(tmp_path: Path, how: str, now: str) -> None:
    top, elsewhere = tmp_path / "top", tmp_path / "elsewhere"
    data = top / "data"
    data.mkdir(parents=True)
    (elsewhere / "data").mkdir(parents=True)
    pin = DirPin.take(str(data))
    if how == "a link above":
        top.rename(tmp_path / "top.orig")
        top.symlink_to(elsewhere)
    else:
        data.rename(top / "data.orig")
    if how == "a link":
        data.symlink_to(elsewhere)
    elif how == "another folder":
        data.mkdir()
    assert pin.moved() == now.format(elsewhere=elsewhere)
    with pytest.raises(DataDirMovedError) as caught:
        pin.check()
    said = str(caught.value)
    assert "\n" not in said and f"the data directory {data} is not the folder this run started in" in said
    assert f"Put the folder back at {data} and the same command continues" in said


def test_a_folder_put_back_is_the_pinned_one_again(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    pin = DirPin.take(str(data))
    data.rename(tmp_path / "away")
    assert pin.moved()
    (tmp_path / "away").rename(data)
    assert pin.moved() == ""


def test_the_real_parent_resolves_the_folders_above_and_not_the_name(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert real_parent(str(tmp_path / "link" / "data")) == str(tmp_path / "real" / "data")
    assert real_parent(str(tmp_path / "link")) == str(tmp_path / "link")  # the name itself: never followed
