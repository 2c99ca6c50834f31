"""Tests for examples/adult-income/adult_data.py (UCI Adult loader).

The tests on the real files skip when the data cannot be found (``adult_data.find_data_dir``).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

_EXAMPLE_DIR = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adult-income"

N_TRAIN, N_TEST = 32_561, 16_281
POS_TRAIN, POS_TEST = 7_841, 3_846


@pytest.fixture(scope="module")
def ad():
    """The example's adult_data module, loaded by path (the folder name has a hyphen)."""
    spec = importlib.util.spec_from_file_location("adult_income_adult_data", _EXAMPLE_DIR / "adult_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data_dir(ad):
    try:
        return ad.find_data_dir()
    except FileNotFoundError as e:
        pytest.skip(f"UCI Adult data not available: {e}")


@pytest.fixture(scope="module")
def train(ad, data_dir):
    return ad.load_split("train", data_dir)


@pytest.fixture(scope="module")
def test(ad, data_dir):
    return ad.load_split("test", data_dir)


def _raw_rows(path: pathlib.Path):
    """The data rows of one file as lists of strings, parsed independently of the loader."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("|"):
            rows.append([f.strip() for f in line.split(",")])
    return rows


# ---- real data -----------------------------------------------------------------------------------


def test_row_counts(train, test):
    """Test the UCI row counts: 32,561 train and 16,281 test."""
    assert len(train) == N_TRAIN
    assert len(test) == N_TEST


def test_label_positive_rates(train, test):
    """Test the >50K rates, 24.08% and 23.62% (within 0.01%), and the exact counts."""
    assert int(train.labels.sum()) == POS_TRAIN
    assert int(test.labels.sum()) == POS_TEST
    assert abs(train.labels.mean() - 0.2408) < 1e-4
    assert abs(test.labels.mean() - 0.2362) < 1e-4
    assert set(np.unique(train.labels)) == {0.0, 1.0}


def test_dtypes_and_shapes(ad, train, test):
    """Test ids uint64 (n, 8), dense float32 (n, 5), labels float32 (n, 1), all C-contiguous."""
    assert len(ad.CATEGORICAL) == 8 and ad.CATEGORICAL[6] == "gender"
    for split, n in ((train, N_TRAIN), (test, N_TEST)):
        assert split.ids.dtype == np.uint64 and split.ids.shape == (n, 8)
        assert split.dense.dtype == np.float32 and split.dense.shape == (n, len(ad.CONTINUOUS))
        assert split.labels.dtype == np.float32 and split.labels.shape == (n, 1)
        assert split.ids.flags.c_contiguous and split.dense.flags.c_contiguous
        assert np.isfinite(split.dense).all()


def test_ids_decode_to_the_file_values_in_both_splits(ad, data_dir, train, test):
    """Test that every id maps back, through the train vocabulary, to the value in the file."""
    vocab = ad.vocabulary(data_dir)
    sizes = ad.vocab_sizes(data_dir)
    file_col = {name: i for i, name in enumerate(ad.COLUMNS)}
    for split, fname in ((train, "adult.data"), (test, "adult.test")):
        rows = _raw_rows(data_dir / fname)
        for j, name in enumerate(ad.CATEGORICAL):
            assert sizes[j] == len(vocab[name]) + 1
            assert int(split.ids[:, j].max()) < sizes[j]
            table = np.array(["<unknown>"] + vocab[name], dtype=object)
            decoded = table[split.ids[:, j].astype(np.int64)]
            expected = np.array([r[file_col[name]] for r in rows], dtype=object)
            known = np.isin(expected, vocab[name])
            assert (decoded[known] == expected[known]).all(), name
            assert (split.ids[~known, j] == ad.UNKNOWN_ID).all(), name


def test_question_mark_maps_to_unknown_and_is_not_in_the_vocabulary(ad, data_dir, train, test):
    """Test that '?' is id 0 in both splits and never a vocabulary entry."""
    vocab = ad.vocabulary(data_dir)
    for name in ad.CATEGORICAL:
        assert "?" not in vocab[name]
        assert vocab[name] == sorted(vocab[name])
    workclass = ad.CATEGORICAL.index("workclass")
    # 1,836 train and 963 test rows have workclass '?'.
    assert int((train.ids[:, workclass] == 0).sum()) == 1836
    assert int((test.ids[:, workclass] == 0).sum()) == 963
    gender = ad.CATEGORICAL.index("gender")
    assert vocab["gender"] == ["Female", "Male"]
    assert set(np.unique(train.ids[:, gender])) == {1, 2}


def test_train_dense_is_standardised_and_test_uses_train_stats(ad, data_dir, train, test):
    """Test train dense mean ~0 / std ~1, and test = (raw - train mean) / train std."""
    np.testing.assert_allclose(train.dense.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(train.dense.std(axis=0), 1.0, atol=1e-3)
    raw_train = ad.load_split("train", data_dir, dense_transform="raw").dense.astype(np.float64)
    raw_test = ad.load_split("test", data_dir, dense_transform="raw").dense.astype(np.float64)
    expected = (raw_test - raw_train.mean(axis=0)) / raw_train.std(axis=0)
    np.testing.assert_allclose(test.dense, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(test.dense.mean(axis=0)).max() > 1e-4  # not re-standardised on test


def test_raw_and_log_transforms(ad, data_dir):
    """Test "raw" keeps the file's numbers and "log_standard" log1p's the capital columns first."""
    rows = _raw_rows(data_dir / "adult.data")
    file_col = {name: i for i, name in enumerate(ad.COLUMNS)}
    raw = ad.load_split("train", data_dir, dense_transform="raw").dense
    for j, name in enumerate(ad.CONTINUOUS):
        assert raw[0, j] == float(rows[0][file_col[name]])
    logd = ad.load_split("train", data_dir, dense_transform="log_standard").dense
    np.testing.assert_allclose(logd.mean(axis=0), 0.0, atol=1e-4)
    gain = ad.CONTINUOUS.index("capital_gain")
    x = np.log1p(raw[:, gain].astype(np.float64))
    np.testing.assert_allclose(logd[:, gain], (x - x.mean()) / x.std(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        ad.load_split("train", data_dir, dense_transform="minmax")


def test_load_split_returns_fresh_arrays(ad, data_dir):
    """Test that mutating a loaded split does not leak into the next load (cache safety)."""
    a = ad.load_split("test", data_dir)
    a.ids[:] = 99
    a.dense[:] = 99
    a.labels[:] = 99
    b = ad.load_split("test", data_dir)
    assert b.ids.max() < 99 and b.dense.max() < 99 and b.labels.max() == 1.0


def test_unknown_split_name_is_rejected(ad, data_dir):
    with pytest.raises(ValueError):
        ad.load_split("valid", data_dir)


# ---- batches -------------------------------------------------------------------------------------


def _tracked(ad, n):
    """A split whose ids column 0 is the row number, to follow rows through batches."""
    ids = np.repeat(np.arange(n, dtype=np.uint64)[:, None], 8, axis=1)
    dense = np.arange(n * 5, dtype=np.float32).reshape(n, 5)
    labels = (np.arange(n) % 2).astype(np.float32).reshape(n, 1)
    return ad.AdultSplit(ids=ids, dense=dense, labels=labels)


@pytest.mark.parametrize("shuffle_seed", [None, 0, 7])
def test_batches_cover_every_row_exactly_once(ad, shuffle_seed):
    """Test that the batches, in file or shuffled order, hold every row once with rows aligned."""
    split = _tracked(ad, 1000)
    seen, sizes = [], []
    for ids, dense, labels in ad.batches(split, 128, shuffle_seed=shuffle_seed):
        rows = ids[:, 0].astype(np.int64)
        np.testing.assert_array_equal(dense[:, 0], rows * 5)
        np.testing.assert_array_equal(labels[:, 0], rows % 2)
        assert ids.dtype == np.uint64 and dense.dtype == np.float32 and labels.shape[1] == 1
        seen.append(rows)
        sizes.append(len(rows))
    order = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(order), np.arange(1000))
    assert sizes == [128] * 7 + [104]
    if shuffle_seed is None:
        np.testing.assert_array_equal(order, np.arange(1000))
    else:
        assert not np.array_equal(order, np.arange(1000))


def test_batches_shuffle_is_deterministic_per_seed(ad):
    split = _tracked(ad, 500)

    def order(seed):
        return np.concatenate([b[0][:, 0] for b in ad.batches(split, 64, shuffle_seed=seed)])

    np.testing.assert_array_equal(order(3), order(3))
    assert not np.array_equal(order(3), order(4))


def test_batches_drop_last(ad):
    split = _tracked(ad, 1000)
    sizes = [len(b[2]) for b in ad.batches(split, 128, shuffle_seed=1, drop_last=True)]
    assert sizes == [128] * 7
    assert [len(b[2]) for b in ad.batches(split, 100, drop_last=True)] == [100] * 10
    with pytest.raises(ValueError):
        next(ad.batches(split, 0))


def test_real_train_batches_cover_all_rows(ad, train):
    """Test one shuffled pass over the real train split: 255 batches of 128 (last 49), all rows once."""
    n_rows, n_batches, pos = 0, 0, 0.0
    for _ids, _dense, labels in ad.batches(train, 128, shuffle_seed=0):
        n_rows += len(labels)
        n_batches += 1
        pos += float(labels.sum())
    assert (n_rows, n_batches, int(pos)) == (N_TRAIN, 255, POS_TRAIN)


# ---- synthetic files: parsing rules, unseen values, data-dir lookup -------------------------------

_TRAIN_TEXT = (
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, "
    "United-States, <=50K\n"
    "50, ?, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, 0, 13, "
    "United-States, >50K\n"
    "38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, Black, Female, 0, 0, 40, "
    "Cuba, <=50K\n"
    "\n"
)
_TEST_TEXT = (
    "|1x3 Cross validator\n"
    "25, Private, 226802, 11th, 7, Never-married, Machine-op-inspct, Own-child, Black, Male, 0, 0, 40, "
    "United-States, <=50K.\n"
    "44, Self-emp-inc, 160323, Bachelors, 13, Married-civ-spouse, ?, Husband, White, Female, 7688, 0, 40, "
    "Cuba, >50K.\n"
    "\n"
)


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "adult.data").write_text(_TRAIN_TEXT)
    (tmp_path / "adult.test").write_text(_TEST_TEXT)
    return tmp_path


def test_synthetic_files_parse_junk_line_blank_lines_and_label_dots(ad, tiny_dir):
    """Test that the '|' banner and blank lines are skipped and '>50K.' reads as positive."""
    tr = ad.load_split("train", tiny_dir)
    te = ad.load_split("test", tiny_dir)
    assert len(tr) == 3 and len(te) == 2
    np.testing.assert_array_equal(tr.labels[:, 0], [0, 1, 0])
    np.testing.assert_array_equal(te.labels[:, 0], [0, 1])


def test_unseen_test_values_map_to_unknown(ad, tiny_dir):
    """Test that test values absent from train ('11th', 'Self-emp-inc', ...) and '?' get id 0."""
    vocab = ad.vocabulary(tiny_dir)
    assert vocab["workclass"] == ["Private", "State-gov"]  # '?' excluded, sorted
    te = ad.load_split("test", tiny_dir)
    col = {name: j for j, name in enumerate(ad.CATEGORICAL)}
    assert te.ids[0, col["workclass"]] == 1  # Private
    assert te.ids[1, col["workclass"]] == 0  # Self-emp-inc: unseen in train
    assert te.ids[0, col["education"]] == 0  # 11th: unseen in train
    assert te.ids[1, col["occupation"]] == 0  # '?'
    assert te.ids[1, col["native_country"]] == 1  # Cuba, same id as in train
    assert ad.load_split("train", tiny_dir).ids[2, col["native_country"]] == 1


def test_find_data_dir_honours_env_var(ad, tiny_dir, monkeypatch):
    monkeypatch.setenv("ADULT_DATA_DIR", str(tiny_dir))
    assert ad.find_data_dir() == tiny_dir
    assert len(ad.load_split("train")) == 3
    monkeypatch.setenv("ADULT_DATA_DIR", str(tiny_dir / "missing"))
    with pytest.raises(FileNotFoundError):
        ad.find_data_dir()


def test_find_data_dir_lists_where_it_looked(ad, tmp_path, monkeypatch):
    monkeypatch.delenv("ADULT_DATA_DIR", raising=False)
    monkeypatch.setattr(ad, "_PROJECT_ROOT", tmp_path / "project")
    with pytest.raises(FileNotFoundError) as err:
        ad.find_data_dir()
    message = str(err.value)
    assert str(tmp_path / "project" / "examples" / "adult-income" / "data") in message
    assert str(tmp_path / "shared" / "data" / "adult") in message
