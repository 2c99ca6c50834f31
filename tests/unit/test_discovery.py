"""The pure parts of persia_nats.common.discovery: names, versions, metadata parsing, JSON safety."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from nats.micro.service import NAME_REGEX, SEMVER_REGEX
from persia_nats.common import discovery


@pytest.mark.parametrize(("role", "name"), [
    ("embedding-parameter-server", "persia-ps"), ("ps", "persia-ps"), ("persia-ps", "persia-ps"),
    ("embedding-worker", "persia-embedding-worker"), ("nn-worker", "persia-nn-worker"), ("nn", "persia-nn-worker"),
    ("data.loader", "persia-data-loader"),
])
def test_service_names_are_valid_micro_names(role, name):
    assert discovery.service_name(role) == name and NAME_REGEX.match(name)


def test_version_is_semver():
    assert SEMVER_REGEX.match(discovery.project_version())


def info(job="j", name="persia-ps", **meta):
    return {"id": "x", "name": name, "version": "0.1.0",
            "metadata": {"job": job, "role": "embedding-parameter-server", "replica_index": "1",
                         "replica_size": "2", "instance": "ps-1", **meta}}


def test_instances_are_parsed_and_filtered_by_job_and_name():
    got = discovery._instance(info(), "j", "persia-ps")
    assert got is not None and (got["replica_index"], got["replica_size"], got["instance"]) == (1, 2, "ps-1")
    assert discovery._instance(info(job="other"), "j", "persia-ps") is None
    assert discovery._instance(info(name="persia-embedding-worker"), "j", "persia-ps") is None
    assert discovery._instance(info(name="someone-else"), "j", None) is None
    assert discovery._instance(info(replica_index="one"), "j", None) is None
    assert discovery._instance({"name": "persia-ps", "metadata": None}, "j", None) is None
    assert discovery._instance(info(replica_size="?"), "j", None)["replica_size"] is None


def test_stats_data_is_plain_json():
    data = discovery._json_safe({"a": np.int64(3), "b": np.float32(0.5), "c": math.nan, "d": (1, "x"),
                                 "e": {1: True}, "f": object})
    assert json.loads(json.dumps(data, allow_nan=False)) == {"a": 3, "b": 0.5, "c": None, "d": [1, "x"],
                                                            "e": {"1": True}, "f": str(object)}


def test_endpoint_names_drop_the_job_prefix():
    assert discovery._endpoint_name("persia.j.ps.0.lookup", "persia.j") == "ps_0_lookup"
    assert discovery._endpoint_name("persia.j.ew.0-ab12.grad", "persia.j") == "ew_0-ab12_grad"
    assert NAME_REGEX.match(discovery._endpoint_name("other.sub$ject", "persia.j"))


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (5.9, "5s"), (65, "1m05s"), (3 * 3600 + 120, "3h02m")])
def test_uptime_format(seconds, text):
    assert discovery.format_uptime(seconds) == text
