"""PERSIA's ``persia.utils``: seeding, YAML files and a free port, for training and data-loader scripts."""

from __future__ import annotations

import os
import random
import socket
from typing import Any

import numpy as np
import yaml

__all__ = ["dump_yaml", "find_free_port", "load_yaml", "setup_seed"]


def setup_seed(seed: int) -> None:
    """Seed ``random``, NumPy and torch, and ask torch for deterministic algorithms, as PERSIA's does.

    Unlike PERSIA, an operation with no deterministic kernel warns instead of raising (``warn_only``): on a
    GPU, PERSIA's strict mode stops the job at the first such kernel, or at the first matmul when the user
    has not set ``CUBLAS_WORKSPACE_CONFIG`` as PERSIA's CI does. Embedding rows are seeded by their id on the
    PS whatever the seed, as in PERSIA.
    """
    np.random.seed(seed)
    random.seed(seed)
    try:
        import torch
    except ImportError:  # a data loader's environment may have no torch; it seeds what it has
        return
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def load_yaml(filepath: str | os.PathLike[str]) -> Any:
    """The YAML document at ``filepath``; FileNotFoundError names the path when it is missing."""
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"filepath {filepath} not found!")
    with open(filepath) as f:
        return yaml.safe_load(f)


def dump_yaml(content: Any, filepath: str | os.PathLike[str]) -> None:
    """Write ``content`` to ``filepath`` as YAML."""
    with open(filepath, "w") as f:
        yaml.safe_dump(content, f)


def find_free_port() -> int:
    """A TCP port free on this host now (another process may still take it before you bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port
