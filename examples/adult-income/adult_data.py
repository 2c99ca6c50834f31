"""UCI Adult (census income) loader for the adult-income example: numpy only.

The two files are the UCI originals (``adult.data`` = train, ``adult.test`` = test): comma + space
separated, no header, ``?`` for missing; ``adult.test`` starts with the junk line
``|1x3 Cross validator`` and its labels end with a ``.``.

Encoding:

- the 8 categorical columns become one small integer id each (``ids``, uint64, shape (n, 8)), from a
  vocabulary built on the TRAIN split only: id 0 = missing (``?``) or a value never seen in train,
  ids 1..V = the train values in sorted order. There is no per-column offset: the distributed
  system's per-slot feature prefix keeps the slots apart.
- the 5 continuous columns PERSIA uses (``fnlwgt`` is dropped, as PERSIA's ``Linear(5, 16)`` implies)
  become ``dense`` (float32, shape (n, 5)). By default (``dense_transform="standard"``) every column
  is standardised with the TRAIN mean and std; ``"log_standard"`` first applies ``log1p`` to
  capital-gain and capital-loss (it measured worse: test AUC about -0.005 for the reference model and
  for a logistic regression), ``"raw"`` keeps PERSIA's unnormalised values (about -0.007).
- the label ``>50K`` is 1.0, ``<=50K`` is 0.0 (``labels``, float32, shape (n, 1)).
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CATEGORICAL",
    "CONTINUOUS",
    "COLUMNS",
    "DENSE_TRANSFORMS",
    "UNKNOWN_ID",
    "AdultSplit",
    "find_data_dir",
    "vocabulary",
    "vocab_sizes",
    "load_split",
    "batches",
]

#: The 15 columns of adult.data / adult.test, in file order (``sex`` is called ``gender`` here).
COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education_num", "marital_status", "occupation",
    "relationship", "race", "gender", "capital_gain", "capital_loss", "hours_per_week",
    "native_country", "income",
)
#: The 8 id-type slots, in slot order.
CATEGORICAL = (
    "workclass", "education", "marital_status", "occupation", "relationship", "race", "gender",
    "native_country",
)
#: The 5 continuous columns, in ``dense`` column order (PERSIA's example uses these five).
CONTINUOUS = ("age", "education_num", "capital_gain", "capital_loss", "hours_per_week")
#: Continuous columns that get ``log1p`` under ``dense_transform="log_standard"`` (heavy-tailed).
LOG_COLUMNS = ("capital_gain", "capital_loss")
DENSE_TRANSFORMS = ("standard", "log_standard", "raw")
DEFAULT_DENSE_TRANSFORM = "standard"
#: Id for ``?`` and for test values absent from the train split.
UNKNOWN_ID = 0

_FILES = {"train": "adult.data", "test": "adult.test"}
_COL = {name: i for i, name in enumerate(COLUMNS)}
_PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclass
class AdultSplit:
    """One encoded split. Row i of the three arrays is the same person."""

    ids: np.ndarray  # uint64 (n, 8): one id per slot in CATEGORICAL order
    dense: np.ndarray  # float32 (n, len(CONTINUOUS))
    labels: np.ndarray  # float32 (n, 1): 1.0 for >50K

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def find_data_dir() -> pathlib.Path:
    """Where adult.data / adult.test live.

    ``$ADULT_DATA_DIR`` if set (it must be a directory), else the first of
    ``<project>/examples/adult-income/data`` and ``<project>/../shared/data/adult`` that holds an
    ``adult.data`` (an empty ``data/`` folder does not shadow the shared copy).

    Raises:
        FileNotFoundError: none of them exists; the message lists every place looked at.
    """
    env = os.environ.get("ADULT_DATA_DIR")
    if env:
        path = pathlib.Path(env)
        if path.is_dir():
            return path
        raise FileNotFoundError(f"ADULT_DATA_DIR={env!r} is not a directory")
    candidates = [
        _PROJECT_ROOT / "examples" / "adult-income" / "data",
        _PROJECT_ROOT.parent / "shared" / "data" / "adult",
    ]
    for path in candidates:
        if (path / _FILES["train"]).is_file():
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"UCI Adult data (adult.data, adult.test) not found; set ADULT_DATA_DIR or put it in one of: {looked}"
    )


@dataclass(frozen=True)
class _Raw:
    """One parsed file, before encoding (cached; never handed out)."""

    categorical: tuple[tuple[str, ...], ...]  # per CATEGORICAL slot, the raw strings
    continuous: np.ndarray  # float64 (n, len(CONTINUOUS)), untransformed
    labels: np.ndarray  # float32 (n, 1)


@functools.lru_cache(maxsize=8)
def _read(path: str) -> _Raw:
    with open(path, encoding="ascii") as f:
        lines = f.read().splitlines()
    # adult.test starts with "|1x3 Cross validator"; both files end with a blank line.
    rows = [line.split(", ") for line in lines if line and not line.startswith("|")]
    for i, r in enumerate(rows):
        if len(r) != len(COLUMNS):
            raise ValueError(f"{path}: data row {i} has {len(r)} fields, expected {len(COLUMNS)}")
    cols = list(zip(*rows, strict=True))
    continuous = np.array([cols[_COL[name]] for name in CONTINUOUS], dtype=np.float64).T
    income = [v.rstrip(".") for v in cols[_COL["income"]]]
    unknown = set(income) - {">50K", "<=50K"}
    if unknown:
        raise ValueError(f"{path}: unexpected labels {sorted(unknown)}")
    labels = np.array([v == ">50K" for v in income], dtype=np.float32).reshape(-1, 1)
    continuous.setflags(write=False)
    labels.setflags(write=False)
    return _Raw(tuple(cols[_COL[name]] for name in CATEGORICAL), continuous, labels)


def _file(split: str, data_dir: os.PathLike | None) -> str:
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    base = pathlib.Path(data_dir) if data_dir is not None else find_data_dir()
    return str((base / _FILES[split]).resolve())


def vocabulary(data_dir: os.PathLike | None = None) -> dict:
    """Per slot, the train values in id order: ``vocabulary()[slot][i]`` has id ``i + 1``."""
    vocab = _train_stats(_file("train", data_dir))[0]
    return {name: sorted(vocab[name], key=vocab[name].get) for name in CATEGORICAL}


def vocab_sizes(data_dir: os.PathLike | None = None) -> tuple[int, ...]:
    """Per slot, the number of distinct ids (the train values + the unknown id 0)."""
    vocab = _train_stats(_file("train", data_dir))[0]
    return tuple(len(vocab[name]) + 1 for name in CATEGORICAL)


@functools.lru_cache(maxsize=8)
def _train_stats(train_path: str):
    """Vocabulary (per slot, value -> id) and per-transform (mean, std), all from the train split."""
    raw = _read(train_path)
    vocab = {}
    for name, values in zip(CATEGORICAL, raw.categorical, strict=True):
        known = sorted(set(values) - {"?"})
        vocab[name] = {v: i + 1 for i, v in enumerate(known)}
    stats = {}
    for transform in DENSE_TRANSFORMS:
        x = _transform(raw.continuous, transform)
        std = x.std(axis=0)
        stats[transform] = (x.mean(axis=0), np.where(std > 0, std, 1.0))
    return vocab, stats


def _transform(x: np.ndarray, transform: str) -> np.ndarray:
    x = np.array(x, dtype=np.float64)
    if transform == "log_standard":
        for name in LOG_COLUMNS:
            j = CONTINUOUS.index(name)
            x[:, j] = np.log1p(x[:, j])
    return x


def load_split(
    split: str, data_dir: os.PathLike | None = None, *, dense_transform: str = DEFAULT_DENSE_TRANSFORM
) -> AdultSplit:
    """Load and encode ``"train"`` (adult.data) or ``"test"`` (adult.test).

    The vocabulary and the continuous statistics always come from the train split, so both splits
    encode the same way. ``dense_transform`` is one of ``DENSE_TRANSFORMS`` (see the module doc).
    Returns fresh arrays (safe to mutate).
    """
    if dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"dense_transform must be one of {DENSE_TRANSFORMS}, got {dense_transform!r}")
    raw = _read(_file(split, data_dir))
    vocab, stats = _train_stats(_file("train", data_dir))

    n = len(raw.labels)
    ids = np.empty((n, len(CATEGORICAL)), dtype=np.uint64)
    for j, name in enumerate(CATEGORICAL):
        lookup = vocab[name].get
        ids[:, j] = [lookup(v, UNKNOWN_ID) for v in raw.categorical[j]]
    dense = _transform(raw.continuous, dense_transform)
    if dense_transform != "raw":
        mean, std = stats[dense_transform]
        dense = (dense - mean) / std
    return AdultSplit(ids=ids, dense=np.ascontiguousarray(dense, dtype=np.float32), labels=raw.labels.copy())


def batches(
    split_obj: AdultSplit, batch_size: int, *, shuffle_seed: int | None = None, drop_last: bool = False
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(ids, dense, labels)`` batches of ``batch_size`` rows.

    In file order (views) when ``shuffle_seed`` is None, else in the order of
    ``np.random.default_rng(shuffle_seed).permutation(n)`` (copies). The last, short batch is yielded
    unless ``drop_last``.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n = len(split_obj)
    order = None if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        end = min(start + batch_size, n)
        if order is None:
            sl = slice(start, end)
        else:
            sl = order[start:end]
        yield split_obj.ids[sl], split_obj.dense[sl], split_obj.labels[sl]
