"""replay.request_events: the request table's event logs and the keys that order them like the derivation."""

import numpy as np

from replay.request_events import isin, number_key


def test_number_keys_order_numbers_as_their_decimal_texts():
    rng = np.random.default_rng(7)
    numbers = np.concatenate([[0, 1, 2, 9, 10, 11, 19, 100, 101, 99, 999, 1000, 10**16, 10**17 - 1],
                              rng.integers(0, 10**12, 2_000)]).astype(np.int64)
    by_key = numbers[np.argsort(number_key(numbers), kind="stable")]
    by_text = np.array(sorted(numbers.tolist(), key=str), dtype=np.int64)
    assert by_key.tolist() == by_text.tolist()  # e.g. 1 < 10 < 100 < 101 < 11 < 19 < 2 < 9 < 99
    assert np.unique(number_key(numbers)).size == np.unique(numbers).size  # distinct numbers, distinct keys


def test_isin_agrees_with_numpy():
    rng = np.random.default_rng(3)
    values, keys = rng.integers(0, 500, 3_000), rng.integers(0, 500, 200)
    assert isin(values, keys).tolist() == np.isin(values, keys).tolist()
    assert not isin(values, keys[:0]).any()
    wide = np.array([0, 1 << 30, 5], dtype=np.int64)  # a span too wide for the dense mask: numpy's own
    assert isin(wide, np.array([1 << 30])).tolist() == [False, True, False]
