"""A checkpoint dump checks the disk first (persia_nats.services.nn_worker.checkpoint): too little room is
refused before anything is written, naming the path and the bytes needed against the bytes free."""

from __future__ import annotations

import json
import shutil

import pytest
from persia_nats.common import checkpoint as ck
from persia_nats.services.nn_worker.checkpoint import SPACE_MARGIN, bytes_needed, check_free_space


def fake_checkpoint(root, number: int, size: int) -> None:
    """A final checkpoint whose manifest lists one file of ``size`` bytes (only its size is read here)."""
    ckpt = root / ck.checkpoint_name(number)
    ckpt.mkdir(parents=True)
    manifest = {"format": ck.FORMAT, "number": number, "created": 0.0,
                "files": {"ps/shard.npy": {"size": size, "sha256": "0" * 64}}}
    (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))


def test_the_estimate_is_the_newest_checkpoints_size_with_a_margin(tmp_path):
    assert bytes_needed(tmp_path, 1000) == int(1000 * SPACE_MARGIN)  # none yet: the dense part alone
    fake_checkpoint(tmp_path, 1, 10_000)
    fake_checkpoint(tmp_path, 2, 50_000)
    assert bytes_needed(tmp_path, 1000) == int(50_000 * SPACE_MARGIN)


def test_a_dump_the_disk_cannot_hold_is_refused_naming_path_and_bytes(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    check_free_space(tmp_path, 1)
    with pytest.raises(ck.CheckpointError, match=rf"{tmp_path}: a checkpoint needs about {free * 2} bytes .* but "
                                                 r"\d+ are free; nothing was written"):
        check_free_space(tmp_path, free * 2)
    assert list(tmp_path.iterdir()) == []
