"""One attention problem, validated: shapes, dtype and options, independent of any variant.

Every check here runs before anything is launched and names the parameter it rejects: a value out
of range is a ValueError, a value of the wrong type (`causal='False'`, `seed=1.5`) is an
OptionTypeError, a TypeError that is also a ValueError (docs/ARCHITECTURE.md "Options and
errors": every rejection is one).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .masks import Band, BlockSparse
from .modifiers import MaskMod, ScoreMod
from .philox import OptionTypeError, as_real, check_offset, check_seed, dropout_threshold, split_seed
from .precision import DTYPES, dtype_name


@dataclass(frozen=True)
class Problem:
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    d: int
    dtype: str
    causal: bool = False
    window: tuple | None = None
    scale: float = 1.0
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    block_mask: BlockSparse | None = field(default=None, compare=False)
    score_mod: ScoreMod | None = field(default=None, compare=False)     # sandbox/modifiers.py
    mask_mod: MaskMod | None = field(default=None, compare=False)

    @property
    def group(self) -> int:
        """Query heads per K/V head (1: MHA, Hq: MQA)."""
        return self.Hq // self.Hkv

    @property
    def band(self) -> Band:
        return Band.from_options(self.Nq, self.Nk, self.causal, self.window)

    @property
    def dropout_threshold(self) -> int:
        return dropout_threshold(self.dropout_p)

    @property
    def seed_words(self) -> tuple[int, int]:
        return split_seed(self.seed)

    def flops(self, direction: str = "forward") -> float:
        """The FLOP count of docs/ARCHITECTURE.md "Benchmarks": 4 B H Nq Nk d forward (halved for
        causal), backward 2.5x."""
        f = 4.0 * self.B * self.Hq * self.Nq * self.Nk * self.d * (0.5 if self.causal else 1.0)
        return {"forward": f, "backward": 2.5 * f, "both": 3.5 * f}[direction]


def _shape(x, what):
    try:
        return tuple(int(n) for n in x.shape)
    except AttributeError:
        raise ValueError(f"{what} must be an array with a .shape, got {type(x).__name__}") from None


def _causal(causal) -> bool:
    """A Python or NumPy bool: a string such as 'False' is truthy and used to turn causal on."""
    if not isinstance(causal, (bool, np.bool_)):
        raise OptionTypeError(f"causal must be a bool, got {causal!r} ({type(causal).__name__})")
    return bool(causal)


def _scale(scale, d: int) -> float:
    """None (1/sqrt(d)) or a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    scale = as_real(scale, "scale")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


WINDOW_SIDE_LIMIT = 2**62   # int64 sanity: a side this long is a bug, not a window


def _window_side(side, window):
    """None (unbounded) or an int (not bool, not float) with |side| < 2**62. Sides longer than the
    sequence are fine: Band.from_options clamps them to unbounded."""
    if side is None:
        return None
    if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
        raise OptionTypeError(f"window sides must be ints or None, got {side!r} ({type(side).__name__}) "
                              f"in window={window!r}")
    if abs(int(side)) >= WINDOW_SIDE_LIMIT:
        raise ValueError(f"window sides must be smaller than 2**62 in magnitude, got window={window!r}")
    return int(side)


def _window(window):
    """None or a pair (left, right) of window sides: a wrong type is an OptionTypeError, a wrong
    length a ValueError, both naming `window`."""
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__iter__"):
        raise OptionTypeError(f"window must be None or (left, right) with ints or None, "
                              f"got {window!r} ({type(window).__name__})")
    sides = tuple(window)
    if len(sides) != 2:
        raise ValueError(f"window must be (left, right) with ints or None, got {window!r}")
    return tuple(_window_side(side, window) for side in sides)


def _modifier(value, kind, name, B, Hq, Nq, Nk):
    """None or a `kind` (ScoreMod / MaskMod) whose buffers fit the problem; a wrong type is an
    OptionTypeError naming the option."""
    if value is None:
        return None
    if not isinstance(value, kind):
        raise OptionTypeError(f"{name} must be a sandbox.modifiers.{kind.__name__} (or None), got "
                              f"{value!r} ({type(value).__name__})")
    value.validate(B, Hq, Nq, Nk)
    return value


def make_problem(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0, window=None,
                 block_mask=None, score_mod=None, mask_mod=None) -> Problem:
    """The validated problem: shapes and dtype first, then every option's type and range."""
    qs, ks, vs = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, N, d); got {qs}, {ks}, {vs}")
    B, Hq, Nq, d = qs
    if ks != vs:
        raise ValueError(f"k and v must have the same shape; got {ks} and {vs}")
    if ks[0] != B or ks[3] != d:
        raise ValueError(f"k/v shape {ks} does not match q shape {qs} in batch or head dim")
    Hkv, Nk = ks[1], ks[2]
    if min(B, Hq, Hkv, Nq, Nk, d) < 1:
        raise ValueError(f"every dimension must be >= 1; got q {qs}, k {ks}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv} (GQA/MQA)")
    dts = {dtype_name(x) for x in (q, k, v)}
    if len(dts) != 1:
        raise ValueError(f"q, k, v must share a dtype; got {sorted(dts)}")
    dtype = dts.pop()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; expected one of {DTYPES}")
    causal, scale, window = _causal(causal), _scale(scale, d), _window(window)
    dropout_p = as_real(dropout_p, "dropout_p")
    dropout_threshold(dropout_p)          # raises for p outside [0, 1)
    seed, offset = check_seed(seed), check_offset(offset)
    if block_mask is not None:
        if not isinstance(block_mask, BlockSparse):
            raise ValueError(f"block_mask must be sandbox.masks.BlockSparse, got {type(block_mask).__name__}")
        block_mask.validate(Hq, Nq, Nk)
    if max(Nq, Nk) >= 2**29:
        raise ValueError(f"sequence lengths must be < 2**29, got Nq={Nq}, Nk={Nk}")
    score_mod = _modifier(score_mod, ScoreMod, "score_mod", B, Hq, Nq, Nk)
    mask_mod = _modifier(mask_mod, MaskMod, "mask_mod", B, Hq, Nq, Nk)
    return Problem(B, Hq, Hkv, Nq, Nk, d, dtype, causal, window, scale, dropout_p, seed, offset, block_mask,
                   score_mod, mask_mod)
