"""Process identity from the environment (PERSIA's ``persia.env``), read fresh on every call."""

from common.env import read_env


def get_rank() -> int:
    return read_env().rank


def get_local_rank() -> int:
    return read_env().local_rank


def get_world_size() -> int:
    return read_env().world_size


def get_replica_index() -> int:
    return read_env().replica_index


def get_replica_size() -> int:
    return read_env().replica_size
