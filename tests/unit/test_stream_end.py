"""When the stream loader may end the job, and how many copies of the streams it creates."""

from __future__ import annotations

from nats.js import api
from persia_nats.services.data_loader.stream import earlier_acknowledged, stream_replicas

WQ = api.RetentionPolicy.WORK_QUEUE.value


def test_the_ack_floor_just_below_the_marker_ends_it():
    assert earlier_acknowledged(256, 255, None, None)
    assert not earlier_acknowledged(256, 254, None, None)


def test_a_lagging_floor_is_settled_by_the_work_queue_having_nothing_before_the_marker():
    # a nats-server restarted mid-training restored the floor at 118; every batch up to 255 was acked and removed
    assert earlier_acknowledged(256, 118, WQ, 256)
    assert not earlier_acknowledged(256, 118, WQ, 200)  # batch 200 is still in the stream


def test_only_a_work_queue_removes_acknowledged_messages():
    assert not earlier_acknowledged(256, 118, api.RetentionPolicy.LIMITS.value, 256)
    assert not earlier_acknowledged(256, 118, None, 256)


def test_auto_replicas_are_three_in_a_cluster_and_one_on_a_lone_server():
    assert stream_replicas(0, {"cluster": "persia", "server_name": "nats1"}) == 3
    assert stream_replicas(0, {"server_name": "nats"}) == 1
    assert stream_replicas(0, {"cluster": ""}) == 1


def test_a_set_replica_count_is_taken_as_it_is():
    assert stream_replicas(1, {"cluster": "persia"}) == 1
    assert stream_replicas(5, {}) == 5
