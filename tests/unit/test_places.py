"""checkpoint/places.py: every place of a run and its root derived once from the settings, and a place that cannot
work refused in one line before anything is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint.errors import CheckpointError
from checkpoint.places import LOCAL, MIRROR, PEER, SHARED, Places, tier_root
from checkpoint.policy import When
from checkpoint.settings import Settings


def test_the_places_of_a_run_nearest_first(tmp_path):
    s = Settings(checkpoint_dir=str(tmp_path / "ck"), experiment="exp", local_dir=str(tmp_path / "shm"),
                 local_every=2, when=When(every_steps=4), peer=True, mirror_dir=str(tmp_path / "mirror"))
    places = Places.of(s)
    assert [p.kind for p in places.ordered] == [LOCAL, PEER, SHARED, MIRROR]
    assert places.shared.root == tmp_path / "ck" / "exp" and places.mirror.root == tmp_path / "mirror" / "exp"
    local = tier_root(tmp_path / "shm", "exp", str(tmp_path / "ck" / "exp"))
    assert places.local.root == local and places.local.rank_dir(3) == local / "rank-00003"
    assert places.peer.rank_dir(1) == local / "peer" / "rank-00001"
    assert [p.root for p in places.whole_steps] == [places.shared.root, places.mirror.root]
    assert not list(tmp_path.iterdir())  # nothing made


def test_only_the_shared_place_by_default(tmp_path):
    places = Places.of(Settings(checkpoint_dir=str(tmp_path)))
    assert places.ordered == [places.shared] and places.shared.root == Path(tmp_path) / "default"


def test_two_shared_folders_get_two_local_folders(tmp_path):
    """Two runs of one experiment name on a node, another --checkpoint-dir each, never share a local folder."""
    a = Places.of(Settings(checkpoint_dir=str(tmp_path / "a"), local_dir=str(tmp_path / "shm")))
    b = Places.of(Settings(checkpoint_dir=str(tmp_path / "b"), local_dir=str(tmp_path / "shm")))
    assert a.local.root != b.local.root and a.local.root.parent == b.local.root.parent


@pytest.mark.parametrize("changes, says", [
    ({"peer": True}, "^peer=True needs local_dir"),
    ({"local_dir": "s3://bucket/x"}, "must be a folder on each node"),
    ({"local_dir": "{ck}"}, "^local_dir must differ from checkpoint_dir"),
    ({"local_dir": "{shm}", "local_every": 3, "when": When(every_steps=10)},
     "^when.every_steps=10 must be a multiple of local_every=3"),
    ({"local_dir": "{shm}", "local_keep": 0}, "^local_every must be at least 0 and local_keep at least 1"),
    ({"mirror_dir": "{ck}"}, "is the checkpoint_dir itself"),
])
def test_a_place_that_cannot_work_is_one_line(tmp_path, changes, says):
    fill = {"ck": str(tmp_path / "ck"), "shm": str(tmp_path / "shm")}
    changes = {k: v.format(**fill) if isinstance(v, str) else v for k, v in changes.items()}
    with pytest.raises(CheckpointError, match=says) as e:
        Places.of(Settings(checkpoint_dir=fill["ck"], **changes))
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())
