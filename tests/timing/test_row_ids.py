"""The timing model's packed-key unique of tile rows gives numpy's row-wise unique, order included."""

import numpy as np
import pytest

from tvm_spinn.timing.model import _row_ids


def _numpy(rows):
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


@pytest.mark.parametrize("seed", range(20))
def test_matches_numpy_rowwise_unique(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 200)), int(rng.integers(1, 7))
    low, high = sorted(int(v) for v in rng.integers(-50, 60, size=2))
    rows = rng.integers(low, high + 1, size=(n, k)).astype(rng.choice([np.int32, np.int64, np.uint16]))
    rows = rows[rng.permutation(n)]
    first, inverse = _row_ids(rows)
    ref_first, ref_inverse = _numpy(rows)
    np.testing.assert_array_equal(first, ref_first)
    np.testing.assert_array_equal(inverse, ref_inverse)


def test_rows_too_wide_for_one_key_fall_back_to_numpy():
    rows = np.array([[0, 2 ** 40], [2 ** 40, 0], [0, 2 ** 40], [7, 7]], dtype=np.int64)
    rows = np.tile(rows, (1, 2))  # spans multiply past 2**63
    first, inverse = _row_ids(rows)
    ref_first, ref_inverse = _numpy(rows)
    np.testing.assert_array_equal(first, ref_first)
    np.testing.assert_array_equal(inverse, ref_inverse)


def test_empty_table():
    first, inverse = _row_ids(np.zeros((0, 3), dtype=np.int64))
    assert len(first) == 0 and len(inverse) == 0
