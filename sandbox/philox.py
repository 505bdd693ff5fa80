"""Philox4x32 counter-based RNG in NumPy, and the dropout keep-mask contract
(docs/ARCHITECTURE.md "Dropout and the RNG contract").

Philox4x32-R (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the generator
behind cuRAND's Philox and Random123). R = 10 is the standard generator and the contract;
R = 7 is the cheaper variant flash-attn uses, offered as a variant parameter.

The keep decision for element (b, h, i, j) of a (B, H, Nq, Nk) score matrix depends only on
(seed, offset, b, h, i, j):

    key     = (seed & 0xffffffff, seed >> 32)
    counter = (j // 4, i, b * H + h, offset)      # one Philox call covers 4 consecutive columns
    u       = philox(counter, key)[j % 4]          # uint32
    keep    = u >= floor(p * 2**32)

The same generator exists as CUDA C (kernels_cu/philox.cuh) and as a Numba device function
(sandbox/numba_support.py); tests pin all three to the known-answer vectors and to each other.
"""
from __future__ import annotations

import numbers

import numpy as np

PHILOX_M0 = np.uint64(0xD2511F53)  # round multipliers
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint32(0x9E3779B9)  # Weyl key increments (golden ratio, sqrt(3) - 1)
PHILOX_W1 = np.uint32(0xBB67AE85)
SUPPORTED_ROUNDS = (7, 10)


def philox4x32(counter, key, rounds: int = 10) -> np.ndarray:
    """Philox4x32-`rounds` on broadcastable uint32 counter words.

    counter: sequence of 4 arrays (c0, c1, c2, c3); key: (k0, k1). Returns uint32 array [..., 4].
    """
    if rounds not in SUPPORTED_ROUNDS:
        raise ValueError(f"philox rounds must be one of {SUPPORTED_ROUNDS}, got {rounds}")
    c = np.broadcast_arrays(*(np.asarray(x, dtype=np.uint32) for x in counter))
    c = [x.copy() for x in c]
    k0 = np.full(c[0].shape, np.uint32(key[0]), dtype=np.uint32)
    k1 = np.full(c[0].shape, np.uint32(key[1]), dtype=np.uint32)
    for r in range(rounds):
        if r:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        p0 = PHILOX_M0 * c[0].astype(np.uint64)
        p1 = PHILOX_M1 * c[2].astype(np.uint64)
        c = [
            (p1 >> np.uint64(32)).astype(np.uint32) ^ c[1] ^ k0,
            p1.astype(np.uint32),
            (p0 >> np.uint64(32)).astype(np.uint32) ^ c[3] ^ k1,
            p0.astype(np.uint32),
        ]
    return np.stack(c, axis=-1)


class OptionTypeError(TypeError, ValueError):
    """An option of the wrong type (`causal='False'`, `seed=1.5`, `scale='a'`).

    A TypeError; also a ValueError, since docs/ARCHITECTURE.md promises a ValueError for every
    rejected option and callers catch that (a float window side, for one, was a ValueError before
    these checks)."""


def _got(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def as_int(value, name: str) -> int:
    """value as a Python int: an int or NumPy integer, never a bool or a float (a float seed used to
    be truncated silently, and True is an int to Python but never meant as one here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise OptionTypeError(f"{name} must be an int, got {_got(value)}")
    return int(value)


def as_real(value, name: str) -> float:
    """value as a Python float: an int, float or NumPy real, never a bool, a str or a complex."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise OptionTypeError(f"{name} must be a real number, got {_got(value)}")
    return float(value)


def check_seed(seed) -> int:
    """The seed as an int in [0, 2**64): the Philox key is 64 bits."""
    seed = as_int(seed, "seed")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def check_offset(offset) -> int:
    """The offset as an int in [0, 2**32): it is the counter's last 32-bit word."""
    offset = as_int(offset, "offset")
    if not 0 <= offset < 2**32:
        raise ValueError(f"offset must be in [0, 2**32), got {offset}")
    return offset


def split_seed(seed: int) -> tuple[int, int]:
    """The 64-bit seed as the Philox key (low word, high word)."""
    seed = check_seed(seed)
    return seed & 0xFFFFFFFF, seed >> 32


def dropout_threshold(p: float) -> int:
    """floor(p * 2**32), saturated to uint32: an element is kept iff its uint32 draw >= this."""
    p = as_real(p, "dropout_p")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return min(int(np.floor(p * 2.0**32)), 2**32 - 1)


def _is_count(n) -> bool:
    return isinstance(n, numbers.Integral) and not isinstance(n, (bool, np.bool_)) and n >= 0


def _mask_shape(shape) -> tuple[int, int, int, int]:
    """(B, H, Nq, Nk) as four non-negative ints; anything else is a ValueError naming `shape` (a
    2-d shape used to fail inside tuple unpacking with an unclear message)."""
    try:
        dims = () if isinstance(shape, (str, bytes)) else tuple(shape)
    except TypeError:                    # not a sequence at all (an int, None)
        dims = ()
    if len(dims) != 4 or not all(map(_is_count, dims)):
        raise ValueError(f"shape must be (B, H, Nq, Nk), four non-negative ints; got {shape!r}")
    return tuple(int(n) for n in dims)


def dropout_mask(shape, p: float, seed: int, offset: int = 0, rounds: int = 10) -> np.ndarray:
    """Boolean keep-mask of shape (B, H, Nq, Nk) under the RNG contract's counter layout
    (docs/ARCHITECTURE.md "Dropout and the RNG contract")."""
    B, H, Nq, Nk = _mask_shape(shape)
    offset = check_offset(offset)
    key = split_seed(seed)
    threshold = np.uint64(dropout_threshold(p))
    b = np.arange(B, dtype=np.uint32)[:, None, None, None]
    h = np.arange(H, dtype=np.uint32)[None, :, None, None]
    i = np.arange(Nq, dtype=np.uint32)[None, None, :, None]
    j4 = np.arange((Nk + 3) // 4, dtype=np.uint32)[None, None, None, :]
    words = philox4x32((j4, i, b * np.uint32(H) + h, np.uint32(offset)), key, rounds)
    u = words.reshape(B, H, Nq, 4 * j4.size)[..., :Nk]   # word j % 4 of call j // 4 is column j
    return u.astype(np.uint64) >= threshold
