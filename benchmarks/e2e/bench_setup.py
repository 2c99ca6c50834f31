"""What both sides of bench_e2e share: the synthetic Criteo-like data, the model, the settings."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("synthetic_data", ROOT / "examples" / "synthetic" / "synthetic_data.py")
synthetic = importlib.util.module_from_spec(_spec)
sys.modules["synthetic_data"] = synthetic
_spec.loader.exec_module(synthetic)  # type: ignore[union-attr]

N_SLOTS, N_DENSE, DIM = 26, 13, 16
SLOTS = tuple(f"s{i}" for i in range(N_SLOTS))
HIDDEN = (512, 256, 128)
EMBEDDING_LR = 0.1
DENSE_LR = 1e-3


def settings() -> tuple[int, int, int]:
    """(batch size, timed batches, warm-up batches) from the environment."""
    return (int(os.environ.get("BENCH_BATCH_SIZE", "1024")), int(os.environ.get("BENCH_BATCHES", "100")),
            int(os.environ.get("BENCH_WARMUP", "5")))


def make_batches(n: int, batch_size: int, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Generated before timing starts, so generation speed never enters a measurement."""
    return [synthetic.make_batch_arrays(i, batch_size, seed) for i in range(n)]


def mlp(torch):  # noqa: ANN001, ANN201
    layers, width = [], N_SLOTS * DIM + N_DENSE
    for h in HIDDEN:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
