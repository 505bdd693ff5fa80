"""Philox4x32 (NumPy) against the Random123 known-answer vectors, and the dropout-mask contract."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from sandbox import dropout_mask
from sandbox.philox import dropout_threshold, philox4x32

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, expected words)
KAT_10 = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT_10)
def test_known_answer_vectors(counter, key, expected):
    got = philox4x32([np.array([c]) for c in counter], key, rounds=10)[0]
    assert tuple(int(x) for x in got) == expected


def test_rounds_are_validated():
    with pytest.raises(ValueError, match="rounds"):
        philox4x32([0, 0, 0, 0], (0, 0), rounds=8)


def test_seven_rounds_differ_from_ten():
    c = [np.arange(8, dtype=np.uint32)] * 4
    assert not np.array_equal(philox4x32(c, (1, 2), 7), philox4x32(c, (1, 2), 10))


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.integers(1, 13),
       st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.floats(0, 0.99))
def test_mask_is_independent_of_the_shape_it_is_cut_from(B, H, Nq, Nk, seed, offset, p):
    """Element (b, h, i, j) depends only on (seed, offset, b, h, i, j): a wider matrix agrees on the overlap."""
    small = dropout_mask((B, H, Nq, Nk), p, seed, offset)
    wide = dropout_mask((B, H, Nq + 2, Nk + 5), p, seed, offset)
    assert np.array_equal(small, wide[:, :, :Nq, :Nk])


def test_keep_rate_and_threshold_edges():
    m = dropout_mask((2, 3, 64, 64), 0.3, seed=123)
    assert abs(m.mean() - 0.7) < 0.02
    assert dropout_mask((1, 1, 4, 4), 0.0, seed=9).all()
    assert dropout_threshold(0.5) == 2**31
    assert dropout_threshold(np.nextafter(1.0, 0)) == 2**32 - 1
    for bad in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            dropout_threshold(bad)


def test_heads_and_offsets_draw_different_streams():
    a = dropout_mask((1, 2, 16, 16), 0.5, seed=1, offset=0)
    b = dropout_mask((1, 2, 16, 16), 0.5, seed=1, offset=1)
    assert not np.array_equal(a, b) and not np.array_equal(a[0, 0], a[0, 1])
