"""One attention problem, validated: shapes, dtype and options, independent of any variant.

Every check here runs before anything is launched and raises ValueError with the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .masks import Band, BlockSparse
from .philox import dropout_threshold, split_seed
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

    def oracle_kwargs(self) -> dict:
        return dict(causal=self.causal, scale=self.scale, dropout_p=self.dropout_p, seed=self.seed,
                    offset=self.offset, window=self.window, block_mask=self.block_mask)

    def flops(self, direction: str = "forward") -> float:
        """DESIGN.md FLOP count: 4 B H Nq Nk d forward (halved for causal), backward 2.5x."""
        f = 4.0 * self.B * self.Hq * self.Nq * self.Nk * self.d * (0.5 if self.causal else 1.0)
        return {"forward": f, "backward": 2.5 * f, "both": 3.5 * f}[direction]


def _shape(x, what):
    try:
        return tuple(int(n) for n in x.shape)
    except AttributeError:
        raise ValueError(f"{what} must be an array with a .shape, got {type(x).__name__}") from None


def _window(window):
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be (left, right) with ints or None, got {window!r}") from None
    for side in (left, right):
        if side is not None and (isinstance(side, bool) or not float(side).is_integer()):
            raise ValueError(f"window sides must be ints or None, got {window!r}")
    return (None if left is None else int(left), None if right is None else int(right))


def make_problem(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0, window=None,
                 block_mask=None) -> Problem:
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
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    dropout_p = float(dropout_p)
    dropout_threshold(dropout_p)          # raises for p outside [0, 1)
    split_seed(seed)                      # raises for seeds outside [0, 2**64)
    if not 0 <= int(offset) < 2**32:
        raise ValueError(f"offset must be in [0, 2**32), got {offset}")
    if block_mask is not None:
        if not isinstance(block_mask, BlockSparse):
            raise ValueError(f"block_mask must be sandbox.masks.BlockSparse, got {type(block_mask).__name__}")
        block_mask.validate(Hq, Nq, Nk)
    if max(Nq, Nk) >= 2**29:
        raise ValueError(f"sequence lengths must be < 2**29, got Nq={Nq}, Nk={Nk}")
    return Problem(B, Hq, Hkv, Nq, Nk, d, dtype, bool(causal), _window(window), scale, dropout_p,
                   int(seed), int(offset), block_mask)
