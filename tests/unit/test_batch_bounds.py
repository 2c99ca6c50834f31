"""What one batch may hold, and what a dead letter keeps of it."""

from __future__ import annotations

import numpy as np
import pytest
from persia_nats.common.config import DataLoaderConfig
from persia_nats.common.dead import DEAD_REASON_HEADER, DEAD_SEQ_HEADER, DEAD_SIZE_HEADER, dead_message
from persia_nats.common.errors import BadRequest, ConfigError
from persia_nats.common.messages import BatchBounds, IdFeature

BOUNDS = BatchBounds(max_bytes=1000, max_samples=4, max_distinct_ids=5)


def slot(name: str, ids: list[int], lengths: list[int]) -> IdFeature:
    return IdFeature(name, np.asarray(ids, np.uint64), np.asarray(lengths, np.int32))


def test_repeated_ids_count_once_and_slots_add_up():
    BOUNDS.check([slot("a", [7] * 40, [10, 10, 10, 10])])  # 40 ids, 1 distinct
    BOUNDS.check([slot("a", [1, 2, 3], [1, 1, 1]), slot("b", [1, 2], [1, 1, 0])])
    with pytest.raises(BadRequest, match=r"6 distinct ids .*max_batch_distinct_ids \(5\)"):
        BOUNDS.check([slot("a", [1, 2, 3], [1, 1, 1]), slot("b", [1, 2, 3], [1, 1, 1])])


def test_samples_and_bytes_are_bounded():
    with pytest.raises(BadRequest, match=r"5 samples, more than data_loader_config.max_batch_samples \(4\)"):
        BOUNDS.check([slot("a", [1] * 5, [1] * 5)])
    BOUNDS.check_bytes(1000)
    with pytest.raises(BadRequest, match=r"batch: 1001 bytes, more than data_loader_config.max_batch_bytes"):
        BOUNDS.check_bytes(1001)


def test_a_dead_letter_keeps_its_reason_and_size_but_not_a_large_payload():
    body, headers = dead_message(b"x" * 10, "malformed batch: features: junk", 7, max_payload=10)
    assert body == b"x" * 10 and headers == {DEAD_REASON_HEADER: "malformed batch: features: junk",
                                             DEAD_SEQ_HEADER: "7", DEAD_SIZE_HEADER: "10"}
    body, headers = dead_message(b"x" * 11, "malformed batch: features: junk", 7, max_payload=10)
    assert body == b"" and headers[DEAD_SIZE_HEADER] == "11"
    assert headers[DEAD_REASON_HEADER].startswith("malformed batch: features: junk (payload of 11 bytes not kept")


def test_the_bounds_are_checked_in_the_config():
    with pytest.raises(ConfigError, match="max_batch_samples"):
        DataLoaderConfig(max_batch_samples=65536)
    with pytest.raises(ConfigError, match="dead_max_payload_bytes"):
        DataLoaderConfig(dead_max_bytes=1000, dead_max_payload_bytes=1001)
    with pytest.raises(ConfigError, match="max_batch_distinct_ids"):
        DataLoaderConfig(max_batch_distinct_ids=0)
