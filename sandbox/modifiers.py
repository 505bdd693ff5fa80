"""Score and mask modifiers (issue 18): user code that changes the attention scores where they exist.

A `ScoreMod` maps each score to a new one; a `MaskMod` says which (query, key) pairs are visible.
Each is declared once, in the forms the backends need:

- a NumPy form that the oracle runs on whole arrays: `numpy(s, b, h, i, j, **buffers)` for a score
  modifier, `numpy(b, h, i, j, **buffers)` for a mask. The index arguments are int64 arrays that
  broadcast against each other (b of shape (B, 1, 1, 1), h (1, H, 1, 1), i (1, 1, n, 1), j (1, 1, 1,
  Nk)) and s is float64 of the broadcast shape; write the function with NumPy operations and fancy
  indexing, and it works on any of those shapes;
- a scalar form: the same computation on scalars, `scalar(s, b, h, i, j, *buffers)` with the
  buffers positional in declaration order, written with `math` and array indexing only, so that
  Numba compiles it into the Numba kernels (`cuda.jit(device=True)`);
- a CUDA C expression in the same names (`s`, `b`, `h`, `i`, `j`, each buffer as a pointer, and its
  sizes as `<name>_shape0`, `<name>_shape1`, ...), kept as text for the CUDA C kernels, which
  compile it into their module (the module cache is keyed by that text; `cuda_function()`). A score
  modifier's text may also use `fi`, `fj`: i and j as floats, which the kernels form once per row and
  column of a tile (an int-to-float conversion per element runs at quarter rate, on the pipe the
  softmax's exponentials need), `fa_tanh(x)`, the hardware tanh, `fa_sech2(x)` = 1 - tanh^2 x with
  a small relative error, and `fa_tanh_e(x)`, tanh from fa_sech2's exp(-2|x|) to an absolute 1.2e-5
  (kernels_cu/tc_mods.cuh). The text
  "s" is the identity: the kernels compile no score modifier for it (sinks alone).

A score modifier of the form mod(s) = post * core(pre * s) with host numbers pre, post > 0 (the
soft-cap: cap * tanh(s / cap)) may also give `cuda_factored=(core text, pre, post)`: the forward kernels
then fold pre into the score's scale and post into the softmax's (one FFMA per element already), so
an element pays for core alone, two instructions fewer for the soft-cap in a softmax that is bound by
its instruction count (docs/ARCHITECTURE.md). fa2-tc's backward keeps the `cuda` text; the wgmma2 backward
compiles the core and `cuda_factored_grad` (the core's derivative) where given, the factors as kernel
arguments instead of buffer loads. The fuzzer checks both directions against the NumPy forms like any other.
A copy made with dataclasses.replace keeps every form it is not given: replace the factored ones with the
text (or set them to None), or the kernels run the old core.

A score modifier of the form mod(s) = s + slope(b, h) * (j - i) (ALiBi) may instead give
`cuda_distance_slope`, the CUDA C expression of slope in b, h and the buffers: the forward kernels then
start the S accumulator at the bias (in raw-score units, slope / |scale| times the distance) and the
GEMM adds q.k to it, one FFMA per element where the generic text costs three after the GEMM (the
Hopper rungs' wgmma backward seeds its S^T the same way; fa2-tc's backward compiles the `cuda` text,
and so does every kernel where |scale| is below the kernels' floor, scale 0 included). The fuzzer
checks both forms against the NumPy one as before.

The backward needs d mod / d s, supplied the same ways (`grad`, `scalar_grad`, `cuda_grad`); a
modifier without them is forward-only, and a backward with it is refused (ValueError).

Semantics (docs/ARCHITECTURE.md "Score and mask modifiers"): the score modifier sees the scaled
score s = scale * q.k, as flex attention's score_mod does, and the softmax runs on its output:
    P = softmax_j(mod(scale * q_i . k_j, b, h, i, j)) over the visible keys
i and j are raw positions (0 .. Nq-1, 0 .. Nk-1), not bottom-right aligned: a modifier that needs the
alignment of the built-in causal mask adds Nk - Nq itself. A mask modifier is ANDed with causal,
window and block_mask. The backward is dS_raw = dS_mod * mod'(s).

Attention sinks are a score modifier with a per-head logit `sink[h]` that joins the softmax
denominator but has no value row: lse_i = log(sum_j exp(s_ij) + exp(sink_h)), P_ij = exp(s_ij - lse_i),
so out = sum_j P_ij v_j (a row that sees no key has out = 0 and lse = sink_h). The kernels' backward
is unchanged, since it recomputes P from lse; the sink logit's own gradient is
d loss / d sink_h = -sum_{b, i} exp(sink_h - lse_bhi) * D_bhi (`sink_grad`).

Buffers are captured arrays (bool, int or float), copied when the modifier is made. A host array (NumPy,
a list, a CPU tensor) is kept as NumPy. A device array (a torch CUDA tensor, a CuPy array) stays on its GPU
as a `DeviceBuffer`: the copy is made there, on the caller's stream, and the CUDA C kernels and the GPU tile
classifier read it in place, so a mask built on the GPU each step (a model's padding mask, per-batch document
ids) never waits for the device or crosses to the host. The NumPy and scalar forms (the oracle, the CPU and
Numba variants) read a host copy, made on first use (that waits for the device). A device buffer is not
checked for non-finite values (that would wait too), and integers wider than 32 bits are range-checked on
the way to int32 (one wait; give int32 to avoid it). The Numba kernels receive buffers as device arrays
(floats as float32, integers as int32); kernels are compiled per modifier *code* (its scalar functions and
buffer count), not per buffer values, so alibi(slopes) with new slopes reuses its kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import math
import re
import weakref
from typing import Callable

import numpy as np

MAX_BUFFERS = 4                    # captured arrays per modifier (the Numba kernels pass a fixed number)
RESERVED = ("s", "b", "h", "i", "j", "fi", "fj")
FACTOR_RANGE = (2.0 ** -64, 2.0 ** 64)    # a factored form's pre and post (ScoreMod.cuda_factored)
LOG2E = 1.4426950408889634


def _factored(value, where):
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"{where}: cuda_factored must be a tuple (core CUDA text, pre, post), got {value!r}")
    core, pre, post = value
    _text(core, f"{where}: cuda_factored core")
    pre, post = _real(pre, f"{where}: cuda_factored pre"), _real(post, f"{where}: cuda_factored post")
    for v, nm in ((pre, "pre"), (post, "post")):
        if not (FACTOR_RANGE[0] <= v <= FACTOR_RANGE[1]):
            raise ValueError(f"{where}: cuda_factored {nm} must lie in [2^-64, 2^64] (> 0: the kernels take the "
                             f"row max of core(pre s) for that of post core(pre s); bounded: the kernels get |scale| "
                             f"pre and post log2 e as float32), got {v}")
    return (core, pre, post)


def _callable(value, what, optional=False):
    if value is None and optional:
        return None
    if not callable(value):
        raise TypeError(f"{what} must be callable, got {value!r} ({type(value).__name__})")
    return value


_SCALAR_FORMS_OK = weakref.WeakSet()     # scalar forms already checked: a modifier made per call (a packed batch's
                                         # document mask, a model's dense mask) skips inspect.signature's ~50 us


def _scalar_form(value, what, optional=False):
    """A scalar form: callable, with named positional parameters only. Numba's CUDA inliner refuses
    *args and **kwargs (NotImplementedError "Stararg not supported in inliner"); the CUDA simulator
    runs plain Python and would accept them, so the rule is checked here, on every machine."""
    if _callable(value, what, optional) is None:
        return None
    try:
        if value in _SCALAR_FORMS_OK:
            return value
    except TypeError:                        # not weakly referenceable, or unhashable: checked every time
        pass
    try:
        params = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):          # a builtin or a Numba dispatcher: nothing to read
        return value
    star = [("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name for p in params
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if star:
        raise TypeError(f"{what}: the Numba CUDA kernels call it with one positional argument per index and "
                        f"buffer; {star[0]} is not supported there (name each parameter)")
    try:
        _SCALAR_FORMS_OK.add(value)
    except TypeError:
        pass
    return value


def _text(value, what):
    if not isinstance(value, str) or not value.strip():
        raise TypeError(f"{what} must be a non-empty string of CUDA C, got {value!r}")
    return value


class DeviceBuffer:
    """A captured buffer that lives on a GPU: a C-contiguous CuPy copy in the kernels' type (bool, int32 or
    float32), made on the caller's stream from the array the modifier was given (module docstring). `array`
    is what the CUDA C kernels read; `host()` is the NumPy copy the NumPy and scalar forms read (made once,
    on first use: it waits for the device); `stand_in()` a zero array of the same shape and type, for
    questions about shapes alone (the tile table's extent), which need no copy. The copy is ordered after the
    maker's stream only: a call on another stream must order itself after it (torch's wait_stream), as for any
    tensor handed across streams."""

    __slots__ = ("array", "shape", "dtype", "ndim", "size", "nbytes", "device", "_host")

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.ndim, self.size, self.nbytes = array.ndim, array.size, array.nbytes
        self.device = array.device.id
        self._host = None

    def host(self) -> np.ndarray:
        if self._host is None:
            import cupy as cp
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.deviceSynchronize()     # the copy ran on the maker's stream, which may not be ours
                arr = self.array.get()
            arr.setflags(write=False)
            self._host = arr
        return self._host

    def stand_in(self) -> np.ndarray:
        return np.broadcast_to(np.zeros((), self.dtype), self.shape)

    def __repr__(self):
        return f"DeviceBuffer(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def is_device_array(value) -> bool:
    """A torch CUDA tensor, a CuPy array or another __cuda_array_interface__ array (no import of either)."""
    top = type(value).__module__.split(".")[0]
    if top == "torch":
        return bool(getattr(value, "is_cuda", False))
    return top == "cupy" or hasattr(value, "__cuda_array_interface__")


def device_buffer(value, what: str = "buffer") -> DeviceBuffer:
    """A DeviceBuffer of a device array, to capture once and hand to many modifiers (a buffers dict takes it as
    it is): flash-attn's ALiBi slopes, read by one new ScoreMod per call (sandbox/flash_attn.py)."""
    return _device_buffer(value, what, "value")


def _device_buffer(value, owner, name, copy: bool = True) -> DeviceBuffer:
    """A DeviceBuffer copy of a device array, on the caller's stream (no wait, but for integers wider than
    32 bits, whose range is checked before they become int32). copy=False: the array itself where it is
    C-contiguous in the kernels' type (it stays alive with the buffer; the caller keeps it unchanged)."""
    from . import arrays
    with arrays.caller_stream(value):
        view = arrays._to_device(value, f"{owner}: buffer {name!r}")
        import cupy as cp
        if str(view.dtype) == "bfloat16":
            view = arrays.to_float32(view, cp)
        kind = view.dtype.kind
        if kind not in "biuf":
            raise TypeError(f"{owner}: buffer {name!r} must be bool, int or float, got dtype {view.dtype}")
        if view.size == 0 or view.ndim == 0:
            raise ValueError(f"{owner}: buffer {name!r} must be a non-empty array (shape {view.shape})")
        target = np.bool_ if kind == "b" else _KERNEL_DTYPES[kind]
        if kind in "iu" and view.dtype.itemsize >= 4 and view.dtype != np.int32:
            lo, hi = int(view.min()), int(view.max())              # waits for the device
            if lo < -2**31 or hi >= 2**31:
                raise ValueError(f"{owner}: buffer {name!r} does not fit in int32, which the CUDA kernels take")
        if not copy and view.flags.c_contiguous and view.dtype == target:
            return DeviceBuffer(view)
        return DeviceBuffer(cp.array(view, dtype=target, order="C", copy=True))


def host_buffers(buffers: dict, stand_ins: bool = False) -> dict:
    """The buffers as the NumPy and scalar forms take them: NumPy arrays (a DeviceBuffer's host copy, or with
    `stand_ins` its zero stand-in, which costs nothing and answers questions of shape)."""
    return {name: (arr if isinstance(arr, np.ndarray) else arr.stand_in() if stand_ins else arr.host())
            for name, arr in buffers.items()}


def _buffers(buffers, owner) -> dict:
    """Captured arrays, by name: identifiers other than s, b, h, i, j; bool, int or float, not empty. A device
    array becomes a DeviceBuffer (module docstring), anything else a read-only NumPy copy."""
    if buffers is None:
        return {}
    if not isinstance(buffers, dict):
        raise TypeError(f"{owner}: buffers must be a dict name -> array, got {type(buffers).__name__}")
    if len(buffers) > MAX_BUFFERS:
        raise ValueError(f"{owner}: at most {MAX_BUFFERS} buffers, got {len(buffers)}")
    out = {}
    for name, value in buffers.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
            raise ValueError(f"{owner}: buffer name {name!r} must be an identifier other than {RESERVED}")
        if isinstance(value, DeviceBuffer):           # a copy of a modifier (dataclasses.replace): already a copy
            out[name] = value
            continue
        if is_device_array(value):
            out[name] = _device_buffer(value, owner, name)
            continue
        arr = np.array(value)            # a copy: later changes to the caller's array do not leak in
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"{owner}: buffer {name!r} must be bool, int or float, got dtype {arr.dtype}")
        if arr.size == 0 or arr.ndim == 0:
            raise ValueError(f"{owner}: buffer {name!r} must be a non-empty array (shape {arr.shape})")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError(f"{owner}: buffer {name!r} has non-finite values")
        arr.setflags(write=False)
        out[name] = arr
    return out


def _name(name, kind):
    if not isinstance(name, str) or not name:
        raise TypeError(f"{kind} name must be a non-empty str, got {name!r}")
    return name


def index_grids(B: int, H: int, rows, Nk: int):
    """(b, h, i, j) int64 index arrays that broadcast to (B, H, len(rows), Nk)."""
    rows = np.asarray(rows, dtype=np.int64)
    return (np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1),
            rows.reshape(1, 1, -1, 1), np.arange(Nk).reshape(1, 1, 1, Nk))


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score modifier in its NumPy, scalar (Numba) and CUDA C forms, with its derivative.

    Compared and hashed by identity. `check(B, Hq, Nq, Nk)`, if given, raises ValueError for a
    problem the buffers do not fit (a per-head table with the wrong head count). `sink`, if not
    None, is a per-head logit in the softmax denominator (module docstring)."""

    name: str
    numpy: Callable
    scalar: Callable
    cuda: str
    grad: Callable | None = None
    scalar_grad: Callable | None = None
    cuda_grad: str | None = None
    buffers: dict = dataclasses.field(default_factory=dict)
    sink: np.ndarray | None = None
    check: Callable | None = None
    params: dict = dataclasses.field(default_factory=dict)     # for repr only
    # (core text, pre, post): mod(s) = post * core(pre * s), pre and post in FACTOR_RANGE; a copy made with
    # dataclasses.replace(mod, cuda=...) keeps it: replace both (the forward compiles the factored text; so
    # does a copy's cuda_grad beside cuda_factored_grad, which the wgmma2 backward compiles)
    cuda_factored: tuple | None = None
    # CUDA text of slope(b, h, buffers) where mod(s) = s + slope * (j - i): the forward seeds S with the bias
    # (module docstring); a replace() of cuda keeps it, as cuda_factored
    cuda_distance_slope: str | None = None
    # the core's derivative, core'(s), beside cuda_factored: mod'(s) = post pre core'(pre s); with it the wgmma2
    # backward (kernels_cu/fa3_bwd2.cu FA_SCORE_FACTORED) compiles the core and its derivative, the factors
    # travelling as kernel arguments instead of buffer loads per element
    cuda_factored_grad: str | None = None
    # the forward's compiled form (cuda_factored's core where given, else cuda) is a non-decreasing function of the
    # score for each (batch, head), reading neither i nor j (the soft-cap; a per-head cap too): fa3's forward then
    # takes a full tile's row max on the raw scores and applies the modifier to it, so that the exponentials need not
    # wait for the modifier's last element (kernels_cu/tc_mods.cuh mod_row_max). Checked on the NumPy form when made
    # (_check_monotone); a false claim the check misses moves the softmax's reference point only, which cancels
    # between P and l, until P overflows. A replace() of cuda or cuda_factored keeps it: reset it there unless the
    # new text is monotone too (the check reads the NumPy form, not the CUDA text)
    monotone: bool = False

    def __post_init__(self):
        _name(self.name, "ScoreMod")
        where = f"ScoreMod {self.name!r}"
        if self.cuda_factored is not None:
            object.__setattr__(self, "cuda_factored", _factored(self.cuda_factored, where))
        if self.cuda_factored_grad is not None:
            _text(self.cuda_factored_grad, f"{where}: cuda_factored_grad")
            if self.cuda_factored is None:
                raise ValueError(f"{where}: cuda_factored_grad is the derivative of cuda_factored's core: give both")
        if self.cuda_distance_slope is not None:
            _text(self.cuda_distance_slope, f"{where}: cuda_distance_slope")
            if self.cuda_factored is not None:
                raise ValueError(f"{where}: give cuda_factored or cuda_distance_slope, not both (each is a whole "
                                 "forward form of the modifier)")
        _callable(self.numpy, f"{where}: numpy")
        _scalar_form(self.scalar, f"{where}: scalar")
        _text(self.cuda, f"{where}: cuda")
        grads = (self.grad, self.scalar_grad, self.cuda_grad)
        if any(g is not None for g in grads) and any(g is None for g in grads):
            raise ValueError(f"{where}: give the derivative in all three forms (grad, scalar_grad, cuda_grad) "
                             "or in none")
        _callable(self.grad, f"{where}: grad", optional=True)
        _scalar_form(self.scalar_grad, f"{where}: scalar_grad", optional=True)
        if self.cuda_grad is not None:
            _text(self.cuda_grad, f"{where}: cuda_grad")
        _callable(self.check, f"{where}: check", optional=True)
        object.__setattr__(self, "buffers", _buffers(self.buffers, where))
        if self.sink is not None:
            object.__setattr__(self, "sink", _sink_logits(self.sink, where))
        if not isinstance(self.monotone, bool):
            raise TypeError(f"{where}: monotone must be a bool, got {self.monotone!r}")
        if self.monotone:
            text = self.cuda_factored[0] if self.cuda_factored is not None else self.cuda
            if re.search(r"\b(i|j|fi|fj)\b", re.sub(r"/\*.*?\*/", " ", text, flags=re.S)):   # /* */ comments aside
                # fa3's forward applies a monotone modifier to a full tile's row max (i = j = 0 there), which only a
                # text that reads neither index may take; the NumPy check below cannot see the CUDA text
                raise ValueError(f"{where}: monotone=True, but its compiled text {text!r} names i, j, fi or fj: "
                                 "monotone means a function of the score (and of b, h) alone")
            _check_monotone(self, where)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"ScoreMod({self.name}{', ' + args if args else ''}{', +sinks' if self.sink is not None else ''})"

    @property
    def has_grad(self) -> bool:
        return self.grad is not None

    def with_sinks(self, logits) -> "ScoreMod":
        """This modifier plus attention sinks (a per-head logit in the softmax denominator)."""
        return dataclasses.replace(self, sink=logits, name=f"{self.name}+sinks")

    def apply(self, s, b, h, i, j):
        """The NumPy form on broadcastable arrays -> float64 array of the broadcast shape."""
        with np.errstate(over="ignore", invalid="ignore"):
            out = self.numpy(s, b, h, i, j, **host_buffers(self.buffers))
        return np.broadcast_to(np.asarray(out, dtype=np.float64), np.broadcast_shapes(np.shape(s), np.shape(out)))

    def derivative(self, s, b, h, i, j):
        """d mod / d s, NumPy form; ValueError if the modifier has none (forward-only)."""
        if self.grad is None:
            raise ValueError(f"score_mod {self.name!r} has no derivative (grad): it is forward-only, "
                             "so no backward can run with it")
        with np.errstate(over="ignore", invalid="ignore"):
            out = self.grad(s, b, h, i, j, **host_buffers(self.buffers))
        return np.broadcast_to(np.asarray(out, dtype=np.float64), np.broadcast_shapes(np.shape(s), np.shape(out)))

    def sink_logits(self, H: int) -> np.ndarray:
        """float64 (1, H, 1, 1): the sink logit per query head; -inf everywhere without sinks."""
        if self.sink is None:
            return np.full((1, H, 1, 1), -np.inf)
        return np.broadcast_to(self.sink.astype(np.float64), (H,)).reshape(1, H, 1, 1)

    def validate(self, B: int, Hq: int, Nq: int, Nk: int) -> None:
        if self.sink is not None and self.sink.shape[0] not in (1, Hq):
            raise ValueError(f"score_mod {self.name!r}: sink logits have shape {self.sink.shape}; "
                             f"need (1,) or (Hq,) = ({Hq},)")
        if self.check is not None:
            self.check(B, Hq, Nq, Nk)
        if self.monotone:
            _check_monotone(self, f"score_mod {self.name!r}", B, Hq, Nq, Nk)

    @property
    def is_identity(self) -> bool:
        """Its CUDA text is `s`: the scores pass unchanged (sinks alone), so the tensor-core kernels
        compile no score modifier and keep their fast path (cuda_defines)."""
        return " ".join(self.cuda.split()) == "s"

    @property
    def kernel_key(self) -> tuple:
        """What a compiled kernel depends on: the scalar code, the buffer count, sinks or not."""
        return (self.scalar, self.scalar_grad, len(self.buffers), self.sink is not None)

    def cuda_function(self) -> str:
        """The CUDA C device functions `score_mod` and `score_mod_grad` (module docstring's names)."""
        body = [_cuda_fn("score_mod", "float s, ", self.cuda, self.buffers, floats=True)]
        if self.cuda_grad is not None:
            body.append(_cuda_fn("score_mod_grad", "float s, ", self.cuda_grad, self.buffers, floats=True))
        return "\n".join(body)

    @property
    def cuda_key(self) -> str:
        """A module-cache key from the modifier's CUDA text (and its buffers' names and types)."""
        core = self.cuda_factored[0] if self.cuda_factored is not None else ""
        slope = self.cuda_distance_slope or ""
        core_grad = self.cuda_factored_grad or ""
        mono = "\0monotone" if self.monotone else ""
        return hashlib.sha256((self.cuda_function() + core + "\0" + slope + "\0" + core_grad + mono).encode()
                              ).hexdigest()[:16]


    @property
    def backward_factored(self) -> bool:
        """Whether a backward can compile the factored form (core and its derivative, cuda_factored_grad)."""
        return self.cuda_factored is not None and self.cuda_factored_grad is not None and self.has_grad

    def backward_factors(self) -> tuple[float, float, float]:
        """(pre, post log2 e, post pre) of the factored form, as fa3_bwd2's FA_SCORE_FACTORED arguments: the score
        enters the core as scale pre s, P = 2^(post log2 e core - lse), and mod' = post pre core'."""
        _, pre, post = self.cuda_factored
        return pre, post * LOG2E, post * pre

    def forward_scales(self) -> tuple[float, float]:
        """(pre, post) of the factored form, (1, 1) without one: the forward kernel multiplies the score
        by |scale| * pre before the compiled text and the softmax takes post * log2 e as its factor."""
        return self.cuda_factored[1:] if self.cuda_factored is not None else (1.0, 1.0)


# scores where a claim of monotone is checked: both signs, from far below any soft-cap to near fp32's largest value
# (a NumPy form computed in float32 stays finite)
_MONOTONE_PROBE = np.concatenate([-np.logspace(-6, 38, 300)[::-1], [0.0], np.logspace(-6, 38, 300)])
_MONOTONE_SLACK = 1e-12               # a step down of this relative size is the NumPy form's rounding, not a decrease
_MONOTONE_SEEN: dict = {}             # checks passed, keyed by content (host buffers) and problem shape
_MONOTONE_SEEN_OBJ: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # the same for device buffers, by object


def _monotone_key(mod: "ScoreMod"):
    """A content key for a modifier whose buffers are all host arrays (the built-in soft-cap made anew on every
    flash_attn_func call checks once), None with a device buffer (checked once per object)."""
    if not all(isinstance(arr, np.ndarray) for arr in mod.buffers.values()):
        return None
    return (mod.numpy, tuple((n, a.dtype.str, a.shape, a.tobytes()) for n, a in mod.buffers.items()))


def _check_monotone(mod: "ScoreMod", where: str, B: int = 1, H: int = 1, Nq: int = 4, Nk: int = 4) -> None:
    """ValueError unless the NumPy form is non-decreasing in s on _MONOTONE_PROBE (up to _MONOTONE_SLACK) for every
    batch b < B and head h < H, and the same at the index points (i, j) in {0, 1, 3, Nq - 1} x {0, 1, 2, Nk - 1}
    (those below Nq, Nk): a modifier that reads i or j (or a buffer by them) is not monotone in the kernels' sense
    (ScoreMod.monotone) even where each of its rows is; one that reads b or h is, where it is non-decreasing for
    each, since the kernels apply it to each row's max with the row's own b and h. Called when the modifier is made
    (B = H = 1) and by validate() for each problem shape (once per shape: cached)."""
    key = _monotone_key(mod)
    shape = (B, H, Nq, Nk)
    seen = _MONOTONE_SEEN.get(key, ()) if key is not None else _MONOTONE_SEEN_OBJ.get(mod, ())
    if shape in seen:
        return
    Nq, Nk = max(Nq, 1), max(Nk, 1)
    pts = sorted({(i, j) for i in (0, 1, 3, Nq - 1) for j in (0, 1, 2, Nk - 1) if i < Nq and j < Nk})
    s = _MONOTONE_PROBE[:, None, None]
    h = np.arange(H)[None, :, None]
    i, j = (np.array([p[k] for p in pts])[None, None, :] for k in (0, 1))
    buffers = host_buffers(mod.buffers)
    for b in range(B):
        try:
            with np.errstate(all="ignore"):
                out = np.broadcast_to(np.asarray(mod.numpy(s, np.int64(b), h, i, j, **buffers), dtype=np.float64),
                                      (s.shape[0], H, len(pts)))
                lo, hi = out[:-1, :, 0], out[1:, :, 0]
                down = hi < lo - _MONOTONE_SLACK * np.maximum(np.abs(lo), np.abs(hi))
        except (IndexError, ValueError, TypeError, ArithmeticError) as e:
            raise ValueError(f"{where}: monotone=True, but its NumPy form failed on the check's scores and indices "
                             f"(batch {b}, heads < {H}, i < {Nq}, j < {Nk}): {e}") from None
        if np.isnan(out).any() or down.any():
            raise ValueError(f"{where}: monotone=True, but its NumPy form decreases (or is NaN) somewhere in s "
                             f"(batch {b}, heads < {H})")
        if not (out == out[:, :, :1]).all():
            raise ValueError(f"{where}: monotone=True, but its NumPy form depends on the index (i, j): monotone means "
                             "a function of the score (and of b, h) alone, the same for every i, j")
    if key is not None:
        if len(_MONOTONE_SEEN) > 1024:
            _MONOTONE_SEEN.clear()
        _MONOTONE_SEEN.setdefault(key, set()).add(shape)
    else:
        _MONOTONE_SEEN_OBJ.setdefault(mod, set()).add(shape)


@dataclasses.dataclass(frozen=True, eq=False)
class MaskMod:
    """A mask modifier: visible iff predicate(b, h, i, j, **buffers), in NumPy, scalar and CUDA C forms.

    Compared and hashed by identity; `check(B, Hq, Nq, Nk)` as for ScoreMod."""

    name: str
    numpy: Callable
    scalar: Callable
    cuda: str
    buffers: dict = dataclasses.field(default_factory=dict)
    check: Callable | None = None
    params: dict = dataclasses.field(default_factory=dict)
    # (this mask, problem, block_r, block_c, xp) -> int8 table [Bm, Hm, ceil(Nq/Br), ceil(Nk/Bc)] of band AND block
    # mask AND this mask, for a mask that knows its tiles without testing every element (document(sorted_ids=True));
    # it may call a tile PARTIAL that is EMPTY, FULL or TILE_BAND, never the other way round; None from it, or no
    # function: variants/mask_tiles.py tests every element on the GPU. A copy made with dataclasses.replace(mask,
    # numpy=..., cuda=...) keeps it: clear it there (tile_classes=None) unless the rule still holds
    tile_classes: Callable | None = None

    def __post_init__(self):
        _name(self.name, "MaskMod")
        where = f"MaskMod {self.name!r}"
        _callable(self.numpy, f"{where}: numpy")
        _scalar_form(self.scalar, f"{where}: scalar")
        _text(self.cuda, f"{where}: cuda")
        _callable(self.check, f"{where}: check", optional=True)
        _callable(self.tile_classes, f"{where}: tile_classes", optional=True)
        object.__setattr__(self, "buffers", _buffers(self.buffers, where))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"MaskMod({self.name}{', ' + args if args else ''})"

    def visible(self, B: int, H: int, rows, Nk: int, stand_ins: bool = False) -> np.ndarray:
        """bool (Bm, Hm, len(rows), Nk), Bm in {1, B}, Hm in {1, H}: the axes the predicate does not
        depend on stay 1 (its NumPy form's broadcast shape says which). `stand_ins`: device buffers are
        read as zeros of their shape (host_buffers), for the shape alone, with no host copy."""
        b, h, i, j = index_grids(B, H, rows, Nk)
        out = np.asarray(self.numpy(b, h, i, j, **host_buffers(self.buffers, stand_ins)))
        if out.dtype != np.bool_:
            raise TypeError(f"mask_mod {self.name!r}: the NumPy form must return booleans, got {out.dtype}")
        full = np.broadcast_shapes(out.shape, (1, 1, len(np.atleast_1d(rows)), Nk))
        if len(full) != 4 or full[0] not in (1, B) or full[1] not in (1, H):
            raise ValueError(f"mask_mod {self.name!r}: the NumPy form returned shape {out.shape}, which does "
                             f"not broadcast to (B, H, n, Nk) = ({B}, {H}, {len(rows)}, {Nk})")
        return np.broadcast_to(out, full)

    def validate(self, B: int, Hq: int, Nq: int, Nk: int) -> None:
        if self.check is not None:
            self.check(B, Hq, Nq, Nk)

    @property
    def kernel_key(self) -> tuple:
        return (self.scalar, len(self.buffers))

    def cuda_function(self) -> str:
        return _cuda_fn("mask_mod", "", self.cuda, self.buffers, result="bool")

    @property
    def cuda_key(self) -> str:
        return hashlib.sha256(self.cuda_function().encode()).hexdigest()[:16]


_C_TYPES = {"b": "unsigned char", "i": "int", "u": "int", "f": "float"}


def _cuda_fn(fname, first, expr, buffers, result="float", floats=False, indices="int b, int h, int i, int j"):
    """A __device__ function of (s,) b, h, i, j, (with `floats`: fi, fj, the positions as floats) and
    the buffers (pointers plus their shapes); `indices` replaces the index parameters."""
    args = [f"{first}{indices}" + (", float fi, float fj" if floats else "")]
    for name, arr in buffers.items():
        args.append(f"const {_C_TYPES[arr.dtype.kind]}* __restrict__ {name}")
        args += [f"int {name}_shape{a}" for a in range(arr.ndim)]
    return (f"__device__ __forceinline__ {result} {fname}({', '.join(args)}) {{\n"
            f"    return {expr};\n}}\n")


def _sink_logits(logits, where):
    arr = np.array(logits, dtype=np.float64).reshape(-1) if np.ndim(logits) <= 1 else None
    if arr is None or arr.size == 0:
        raise ValueError(f"{where}: sink logits must be a non-empty 1-D array (one per head, or one)")
    if not np.isfinite(arr).all():
        raise ValueError(f"{where}: sink logits must be finite")
    arr.setflags(write=False)
    return arr


def _heads_check(owner, arrays):
    """A check that each named array's first axis is 1 or Hq."""
    def check(B, Hq, Nq, Nk):
        for what, arr in arrays.items():
            if arr.shape[0] not in (1, Hq):
                raise ValueError(f"{owner}: {what} has {arr.shape[0]} heads on its first axis; need 1 or Hq={Hq}")
    return check


def _real(value, what):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


# ---- built-in score modifiers

def _softcap_np(s, b, h, i, j, cap):
    return cap[0] * np.tanh(s / cap[0])


def _softcap_grad_np(s, b, h, i, j, cap):
    # sech^2 x as 4 e / (1 + e)^2, e = exp(-2 |x|): 1 - tanh^2 x cancels to exactly 0 in float64 from
    # |x| ~ 19 on, which made the tolerance of a gradient through saturated scores 0 (kernels_cu/tc_mods.cuh)
    e = np.exp(-2.0 * np.abs(s / cap[0]))
    return 4.0 * e / (1.0 + e) ** 2


def _softcap_scalar(s, b, h, i, j, cap):
    return cap[0] * math.tanh(s / cap[0])


def _softcap_grad_scalar(s, b, h, i, j, cap):
    e = math.exp(-2.0 * abs(s / cap[0]))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


def softcap(cap) -> ScoreMod:
    """Gemma 2's logit soft-capping: cap * tanh(s / cap), cap > 0."""
    cap = _real(cap, "softcap: cap")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap}")
    # CUDA: cap[1] = 1 / cap (a multiply, not an IEEE division per element). The derivative is fa_sech2, not
    # 1 - tanh^2: an approximate tanh's absolute error (2^-11) is larger than sech^2 itself where tanh
    # saturates (kernels_cu/tc_mods.cuh). The forward compiles the factored form: fa_tanh(s) (MUFU.TANH, one
    # op; libdevice's tanhf is a branchy exp / division / polynomial sequence) with 1 / cap folded into the
    # score's scale and cap into the softmax's, 2 FMULs per element fewer than the text (cap is a host number
    # there, so each cap reuses one module: the values travel as kernel arguments). The text, which the
    # backward compiles beside the derivative, uses the same fa_tanh, so that the backward's P is the
    # forward's: fa_tanh_e (tanh from fa_sech2's own exponential, one MUFU op for both) measured no faster
    # in wgmma2's backward on the H100, and its tanh differs from MUFU.TANH's by up to 4.9e-4, cap times
    # that in P's exponent (bench/results/h100/2026-11-26-session-7.md). The wgmma2 backward compiles the
    # factored form too (cuda_factored_grad, the core's derivative fa_sech2(s)): the text's cap[0] and cap[1]
    # were two global loads per element there, which ptxas cannot hoist across the loop's wgmma fences; with
    # the caps as literals the d = 128 backward ran 15% faster on the H100 (session 11). There the pair
    # fa_tanh(s) / fa_sech2(s) also compiles FA_TANH_CORE: in a tile whose |scale s / cap| stay within 0.5, sech^2 is
    # 1 - tanh^2 from the tanh P needs anyway (kernels_cu/fa3_bwd2.cu; 25-29% faster on the H100, session 19).
    factored = FACTOR_RANGE[0] <= cap <= FACTOR_RANGE[1]
    return ScoreMod("softcap", _softcap_np, _softcap_scalar, "cap[0] * fa_tanh(s * cap[1])",
                    _softcap_grad_np, _softcap_grad_scalar, "fa_sech2(s * cap[1])",
                    buffers={"cap": np.array([cap, 1.0 / cap])}, params={"cap": cap},
                    cuda_factored=("fa_tanh(s)", 1.0 / cap, cap) if factored else None,
                    cuda_factored_grad="fa_sech2(s)" if factored else None, monotone=True)


def _ones_np(s, b, h, i, j, *buffers, **named):
    return np.ones_like(s)


# The scalar forms run in the Numba CUDA kernels, whose inliner takes no *args: one function per
# buffer count (the CUDA simulator, plain Python, accepted *buffers; the GPU's Numba raised
# NotImplementedError "Stararg not supported in inliner", found by the GPU feature fuzz).
def _one_scalar(s, b, h, i, j):
    return 1.0


def _one_scalar_1(s, b, h, i, j, buffer):
    return 1.0


def _alibi_np(s, b, h, i, j, slopes):
    return s + slopes[np.minimum(h, slopes.shape[0] - 1)] * (j - i)


def _alibi_scalar(s, b, h, i, j, slopes):
    return s + slopes[min(h, slopes.shape[0] - 1)] * (j - i)


def alibi(slopes) -> ScoreMod:
    """ALiBi: s + slope_h * (j - i), one slope per query head (or one for all)."""
    slopes = _float_vector(slopes, "alibi: slopes")
    return ScoreMod("alibi", _alibi_np, _alibi_scalar,
                    "s + slopes[min(h, slopes_shape0 - 1)] * (fj - fi)",     # fi, fj: no I2F per element
                    _ones_np, _one_scalar_1, "1.0f", buffers={"slopes": slopes},
                    cuda_distance_slope="slopes[min(h, slopes_shape0 - 1)]",
                    check=_heads_check("alibi", {"slopes": slopes}), params={"heads": slopes.shape[0]})


def alibi_slopes(H: int) -> np.ndarray:
    """The ALiBi paper's slopes for H heads: -2**(-8 k / H), k = 1..H (negative: farther keys lose)."""
    return -(2.0 ** (-8.0 * np.arange(1, H + 1) / H))


def _relative_np(s, b, h, i, j, table):
    dist = table.shape[1] // 2
    return s + table[np.minimum(h, table.shape[0] - 1), np.clip(j - i, -dist, dist) + dist]


def _relative_scalar(s, b, h, i, j, table):
    dist = table.shape[1] // 2
    return s + table[min(h, table.shape[0] - 1), min(max(j - i, -dist), dist) + dist]


def relative_bias(table, max_distance: int) -> ScoreMod:
    """s + table[h, clip(j - i, -max_distance, max_distance) + max_distance]; table (Hq or 1, 2 D + 1)."""
    if isinstance(max_distance, (bool, np.bool_)) or not isinstance(max_distance, (int, np.integer)):
        raise TypeError(f"relative_bias: max_distance must be an int, got {max_distance!r}")
    if max_distance < 0:
        raise ValueError(f"relative_bias: max_distance must be >= 0, got {max_distance}")
    table = np.array(table, dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(f"relative_bias: table must have shape (heads, 2 * max_distance + 1) = "
                         f"(heads, {2 * max_distance + 1}), got {table.shape}")
    return ScoreMod("relative_bias", _relative_np, _relative_scalar,
                    "s + table[min(h, table_shape0 - 1) * table_shape1 + "
                    "min(max(j - i, -(table_shape1 / 2)), table_shape1 / 2) + table_shape1 / 2]",
                    _ones_np, _one_scalar_1, "1.0f", buffers={"table": table},
                    check=_heads_check("relative_bias", {"table": table}),
                    params={"max_distance": int(max_distance)})


def _identity_np(s, b, h, i, j):
    return s


def _identity_scalar(s, b, h, i, j):
    return s


def identity() -> ScoreMod:
    """mod(s) = s: the plain scores (the base of `sinks`)."""
    return ScoreMod("identity", _identity_np, _identity_scalar, "s", _ones_np, _one_scalar, "1.0f")


def sinks(logits) -> ScoreMod:
    """Attention sinks: a learned logit per head in the softmax denominator, with no value row
    (module docstring). Combine with another modifier through `mod.with_sinks(logits)`."""
    mod = identity().with_sinks(logits)
    return dataclasses.replace(mod, name="sinks", params={"heads": mod.sink.shape[0]})


def _float_vector(x, what):
    arr = np.array(x, dtype=np.float64) if not isinstance(x, str) else None
    if arr is None or arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array of numbers")
    return arr


def sink_grad(dout, out, lse, score_mod: ScoreMod) -> np.ndarray:
    """d loss / d sink_h = -sum_{b,i} exp(sink_h - lse_bhi) D_bhi, D = rowsum(dout * out), per query
    head, for loss = sum(out * dout) (float64 [Hq]; a one-logit sink sums over the heads)."""
    dout, out, lse = (np.asarray(x, np.float64) for x in (dout, out, lse))
    H = out.shape[1]
    D = np.sum(dout * out, axis=-1)
    p_sink = np.exp(score_mod.sink_logits(H)[..., 0] - lse)
    g = -np.sum(p_sink * D, axis=(0, 2))
    return g if score_mod.sink.shape[0] == H else g.sum(keepdims=True)


# ---- built-in mask modifiers

def _document_np(b, h, i, j, q_ids, kv_ids):
    return q_ids[b if q_ids.shape[0] > 1 else 0, i] == kv_ids[b if kv_ids.shape[0] > 1 else 0, j]


def _document_scalar(b, h, i, j, q_ids, kv_ids):
    return q_ids[min(b, q_ids.shape[0] - 1), i] == kv_ids[min(b, kv_ids.shape[0] - 1), j]


def document(seq_ids, kv_seq_ids=None, *, sorted_ids: bool = False) -> MaskMod:
    """Document (packed-sequence) mask: query i sees key j iff they carry the same sequence id.
    seq_ids: int (Nq,) or (B, Nq); kv_seq_ids: the keys' (default: seq_ids, for Nq == Nk). Ids on the GPU (a
    torch CUDA tensor, a CuPy array) stay there (DeviceBuffer; int32 ids need no wait, wider ones one).
    sorted_ids=True promises ids that never decrease along the rows (packed sequences): a tile's class then comes
    from its first and last query and key ids (_sorted_document_tiles), O(tiles) instead of a test of every
    element; ids that do decrease would get wrong EMPTY tiles (silently missing scores), so the promise is the
    caller's to keep (sandbox/varlen.py makes such ids from offsets)."""
    if not isinstance(sorted_ids, bool):
        raise TypeError(f"document: sorted_ids must be a bool, got {sorted_ids!r}")
    q_ids = _int_ids(seq_ids, "document: seq_ids")
    if kv_seq_ids is None and is_device_array(q_ids):     # one device copy (and int64 range check) for both roles
        q_ids = _device_buffer(q_ids, "document", "seq_ids")
    kv_ids = q_ids if kv_seq_ids is None else _int_ids(kv_seq_ids, "document: kv_seq_ids")

    def check(B, Hq, Nq, Nk):
        for what, ids, n in (("seq_ids", q_ids, Nq), ("kv_seq_ids", kv_ids, Nk)):
            if ids.shape[0] not in (1, B) or ids.shape[1] != n:
                raise ValueError(f"document: {what} has shape {ids.shape}; need (1 or B={B}, {n})")

    return MaskMod("document", _document_np, _document_scalar,
                   "q_ids[min(b, q_ids_shape0 - 1) * q_ids_shape1 + i] == "
                   "kv_ids[min(b, kv_ids_shape0 - 1) * kv_ids_shape1 + j]",
                   buffers={"q_ids": q_ids, "kv_ids": kv_ids}, check=check,
                   params={"on": "device"} if not isinstance(q_ids, np.ndarray) else
                   {"documents": int(len(np.unique(q_ids)))},
                   tile_classes=_sorted_document_tiles if sorted_ids else None)


@functools.lru_cache(maxsize=None)
def _sorted_tiles_kernel():
    """_sorted_document_tiles's rule on the GPU: one thread per (batch entry, Q tile, K tile)."""
    import cupy as cp
    from .masks import TILE_BAND, TILE_EMPTY, TILE_FULL, TILE_PARTIAL
    return cp.ElementwiseKernel(
        "raw int32 q, raw int32 k, raw int8 band, int32 Nq, int32 Nk, int32 br, int32 bc, int32 nr, int32 nc, "
        "int32 bq, int32 bk", "int8 cls",
        f"""
        const int tile = (int)(i % (nr * nc)), b = (int)(i / (nr * nc)), tr = tile / nc, tc = tile % nc;
        const int* qr = &q[(long long)(bq == 1 ? 0 : b) * Nq];
        const int* kr = &k[(long long)(bk == 1 ? 0 : b) * Nk];
        const int qa = qr[tr * br], qb = qr[min(tr * br + br, Nq) - 1];
        const int ka = kr[tc * bc], kb = kr[min(tc * bc + bc, Nk) - 1];
        const signed char bd = band[tile];
        if (qb < ka || kb < qa || bd == {TILE_EMPTY}) cls = {TILE_EMPTY};
        else if (qa == qb && ka == kb && qa == ka) cls = bd == {TILE_FULL} ? {TILE_FULL} : {TILE_BAND};
        else cls = {TILE_PARTIAL};
        """, "sandbox_sorted_document_tiles")


def _sorted_document_tiles(mask, p, block_r: int, block_c: int, xp):
    """MaskMod.tile_classes of a document mask whose ids never decrease along the rows: [Bm, 1, nr, nc] int8, from
    each tile's first and last query ids (qa, qb) and key ids (ka, kb). Disjoint ranges share no id: EMPTY. One id
    throughout (qa == qb == ka == kb): every element is visible to the document mask, so the tile takes the band's
    class, FULL, or TILE_BAND where the band cuts it (the kernels then test the band alone). Anything else is
    PARTIAL (the element predicate decides), also where an empty sequence leaves a gap that the exact test would
    call EMPTY. With a block mask: None (the element-wise classifier)."""
    if p.block_mask is not None:
        return None
    from .masks import TILE_BAND, TILE_EMPTY, TILE_FULL, TILE_PARTIAL, classify_tiles
    if xp is np:                                                          # [nr, nc]: the band's classes
        band = classify_tiles(p.Nq, p.Nk, block_r, block_c, p.band)[0]
    else:
        from .launch import tile_table
        band = tile_table(p, block_r, block_c, xp)[0][0]

    def ids(buf):
        return buf.array if isinstance(buf, DeviceBuffer) else xp.asarray(buf)
    q, k = ids(mask.buffers["q_ids"]), ids(mask.buffers["kv_ids"])
    if xp is not np:                     # the same rule as one elementwise kernel (one launch instead of ~25)
        nr, nc = band.shape
        Bm = max(q.shape[0], k.shape[0])
        q, k = (xp.ascontiguousarray(x, dtype=xp.int32) for x in (q, k))
        out = xp.empty((Bm, 1, nr, nc), dtype=xp.int8)
        _sorted_tiles_kernel()(q, k, xp.ascontiguousarray(band), np.int32(p.Nq), np.int32(p.Nk), np.int32(block_r),
                               np.int32(block_c), np.int32(nr), np.int32(nc), np.int32(q.shape[0]),
                               np.int32(k.shape[0]), out)
        return out
    r0 = xp.arange(0, p.Nq, block_r)
    c0 = xp.arange(0, p.Nk, block_c)
    qa, qb = q[:, r0][:, :, None], q[:, xp.minimum(r0 + block_r, p.Nq) - 1][:, :, None]   # (Bq, nr, 1)
    ka, kb = k[:, c0][:, None, :], k[:, xp.minimum(c0 + block_c, p.Nk) - 1][:, None, :]   # (Bk, 1, nc)
    one = (qa == qb) & (ka == kb) & (qa == ka)
    cls = xp.where((qb < ka) | (kb < qa) | (band == TILE_EMPTY), TILE_EMPTY,
                   xp.where(one, xp.where(band == TILE_FULL, TILE_FULL, TILE_BAND), TILE_PARTIAL))
    return xp.ascontiguousarray(cls.astype(xp.int8)[:, None])


def _dense_np(b, h, i, j, allowed):
    # a scalar index on an axis of extent 1: the result's shape then says the mask does not depend on it (the
    # tile tables' extents, MaskMod.visible)
    return allowed[b if allowed.shape[0] > 1 else 0, h if allowed.shape[1] > 1 else 0, i, j]


def _dense_scalar(b, h, i, j, allowed):
    return allowed[min(b, allowed.shape[0] - 1), min(h, allowed.shape[1] - 1), i, j]


_DENSE_CUDA = ("allowed[(((long long)min(b, allowed_shape0 - 1) * allowed_shape1 + min(h, allowed_shape1 - 1)) "
               "* allowed_shape2 + i) * allowed_shape3 + j] != 0")


def _dense_check(shape):
    def check(B, Hq, Nq, Nk):
        if shape[0] not in (1, B) or shape[1] not in (1, Hq) or tuple(shape[2:]) != (Nq, Nk):
            raise ValueError(f"dense: the mask has shape {shape}; need (1 or B={B}, 1 or Hq={Hq}, {Nq}, {Nk})")
    return check


def dense(allowed, copy: bool = True) -> MaskMod:
    """A dense boolean mask, (B or 1, H or 1, Nq, Nk), True where query i may see key j: what a model's 4-D
    attention mask (padding, packed documents) says, element by element. The tile classes come from it (empty
    tiles skipped, full ones unchecked), so a padding mask costs a byte load per score of its partial tiles
    only. The kernels read it as bytes (cuda_buffers: a view, no copy). A mask on the GPU (a torch CUDA tensor,
    a CuPy array) stays there: it is copied on the caller's stream, with no wait (DeviceBuffer); with copy=False
    it is read in place where it is C-contiguous (B Nq Nk bytes not doubled), and must not change while the
    modifier lives (sandbox/torch.py's translation of a model's mask: a change makes a new tensor version and so
    a new modifier)."""
    if is_device_array(allowed):
        if str(allowed.dtype) not in ("bool", "torch.bool"):
            raise TypeError(f"dense: the mask must be boolean, got dtype {allowed.dtype}")
        if len(allowed.shape) != 4:
            raise ValueError(f"dense: the mask must be 4-D (B or 1, H or 1, Nq, Nk), got shape {tuple(allowed.shape)}")
        shape = tuple(allowed.shape)
        buf = allowed if copy else _device_buffer(allowed, "dense", "allowed", copy=False)
        return MaskMod("dense", _dense_np, _dense_scalar, _DENSE_CUDA, buffers={"allowed": buf},
                       check=_dense_check(shape), params={"shape": shape, "on": "device"})
    arr = np.asarray(allowed)
    if arr.dtype != np.bool_:
        raise TypeError(f"dense: the mask must be boolean, got dtype {arr.dtype}")
    if arr.ndim != 4 or arr.size == 0:
        raise ValueError(f"dense: the mask must be 4-D (B or 1, H or 1, Nq, Nk), got shape {arr.shape}")

    return MaskMod("dense", _dense_np, _dense_scalar, _DENSE_CUDA, buffers={"allowed": arr},
                   check=_dense_check(arr.shape), params={"shape": tuple(arr.shape), "visible": float(arr.mean())})


def _prefix_np(b, h, i, j, prefix):
    return (j <= i) | (j < (prefix[b] if prefix.shape[0] > 1 else prefix[0]))


def _prefix_scalar(b, h, i, j, prefix):
    return j <= i or j < prefix[min(b, prefix.shape[0] - 1)]


def prefix_lm(prefix_len) -> MaskMod:
    """Prefix-LM: keys before prefix_len are visible to every query, the rest causally (j <= i).
    prefix_len: an int, or one per batch entry."""
    prefix = np.array(prefix_len)
    if prefix.dtype.kind not in "iu" or prefix.ndim > 1:
        raise TypeError(f"prefix_lm: prefix_len must be an int or a 1-D int array, got {prefix_len!r}")
    prefix = prefix.reshape(-1).astype(np.int64)
    if prefix.size == 0 or (prefix < 0).any():
        raise ValueError(f"prefix_lm: prefix_len must be >= 0, got {prefix_len!r}")

    def check(B, Hq, Nq, Nk):
        if prefix.shape[0] not in (1, B):
            raise ValueError(f"prefix_lm: prefix_len has {prefix.shape[0]} entries; need 1 or B={B}")

    return MaskMod("prefix_lm", _prefix_np, _prefix_scalar,
                   "j <= i || j < prefix[min(b, prefix_shape0 - 1)]",
                   buffers={"prefix": prefix}, check=check, params={"prefix_len": prefix.tolist()})


def _int_ids(ids, what):
    if is_device_array(ids):                   # checked and made int32 by _buffers, on the device
        if str(ids.dtype).removeprefix("torch.") not in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                                         "uint32", "uint64"):
            raise TypeError(f"{what} must be integers, got dtype {ids.dtype}")
        if len(ids.shape) not in (1, 2) or math.prod(ids.shape) == 0:
            raise ValueError(f"{what} must have shape (N,) or (B, N), got {tuple(ids.shape)}")
        return ids[None] if len(ids.shape) == 1 else ids
    arr = np.array(ids)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"{what} must have shape (N,) or (B, N), got {np.shape(ids)}")
    if np.abs(arr).max() >= 2**31:
        raise ValueError(f"{what} must fit in int32")
    return arr.astype(np.int64)


# ---- checks of the twins (used by sandbox.fuzz)

def twin_errors(mod, B=1, H=2, Nq=5, Nk=6, seed=0, rtol=1e-5) -> list[str]:
    """Where a modifier's scalar form disagrees with its NumPy form (and, for a ScoreMod with a
    derivative, where the NumPy derivative disagrees with a central difference of the NumPy form)
    on a small random problem: a list of messages, empty if they agree."""
    rng = np.random.default_rng(seed)
    b, h, i, j = index_grids(B, H, np.arange(Nq), Nk)
    shape = (B, H, Nq, Nk)
    idx = [np.broadcast_to(x, shape) for x in (b, h, i, j)]
    bufs = list(host_buffers(mod.buffers).values())
    errs = []
    if isinstance(mod, MaskMod):
        vec = np.broadcast_to(mod.visible(B, H, np.arange(Nq), Nk), shape)
        for e in np.ndindex(*shape):
            if bool(mod.scalar(*(int(x[e]) for x in idx), *bufs)) != bool(vec[e]):
                errs.append(f"mask_mod {mod.name!r}: scalar and NumPy forms differ at (b, h, i, j) = {e}")
                break
        return errs
    s = rng.standard_normal(shape) * 3.0
    vec = mod.apply(s, b, h, i, j)
    for e in np.ndindex(*shape):
        got = mod.scalar(float(s[e]), *(int(x[e]) for x in idx), *bufs)
        if not math.isclose(got, vec[e], rel_tol=rtol, abs_tol=rtol):
            errs.append(f"score_mod {mod.name!r}: scalar form {got!r} != NumPy form {vec[e]!r} at {e}")
            break
    if mod.has_grad:
        step = 1e-6
        fd = (mod.apply(s + step, b, h, i, j) - mod.apply(s - step, b, h, i, j)) / (2 * step)
        g = mod.derivative(s, b, h, i, j)
        bad = ~np.isclose(g, fd, rtol=1e-4, atol=1e-6)
        if bad.any():
            errs.append(f"score_mod {mod.name!r}: grad differs from the finite difference of the NumPy form "
                        f"at {np.argwhere(bad)[0].tolist()}")
        for e in np.ndindex(*shape):
            got = mod.scalar_grad(float(s[e]), *(int(x[e]) for x in idx), *bufs)
            if not math.isclose(got, g[e], rel_tol=rtol, abs_tol=rtol):
                errs.append(f"score_mod {mod.name!r}: scalar_grad {got!r} != grad {g[e]!r} at {e}")
                break
    return errs


# ---- the CUDA C kernels of the tensor-core tier (kernels_cu/tc_mods.cuh)

# Kernel types of captured buffers (the _cuda_fn signature): NumPy dtype per kind.
_KERNEL_DTYPES = {"b": np.uint8, "i": np.int32, "u": np.int32, "f": np.float32}


def _one_line(text: str, where: str) -> str:
    """CUDA C text for a -D macro: newlines become spaces; a line comment or a preprocessor directive
    would swallow or break the rest of the macro, so they are refused (ValueError)."""
    if "//" in text or "#" in text or "\\" in text:
        raise ValueError(f"{where}: the CUDA C text of a modifier compiled into the tensor-core kernels may not "
                         "hold '//' comments, '#' directives or backslashes (use /* */ comments)")
    return " ".join(text.split())


def cuda_defines(score_mod: "ScoreMod | None", mask_mod: "MaskMod | None", backward: bool = False,
                 seed: bool = True, factored: bool = False) -> tuple:
    """NVRTC -D options that compile the modifiers into a tensor-core kernel module (tc_mods.cuh):
    the switches FA_SCORE_MOD, FA_SCORE_MOD_GRAD (backward; neither for an identity modifier, which
    leaves the kernel's fast path: sinks alone), FA_SCORE_FACTORED (a backward with `factored`, of a modifier
    with cuda_factored_grad: the core and its derivative compiled, ScoreMod.backward_factors the kernel's
    arguments), FA_DIST_BIAS (a forward of a distance bias with `seed`:
    the host says the problem's scale allows it, variants/fa2_tc.seeds_bias), FA_SINKS, FA_MASK_MOD, the device functions
    (FA_MOD_FUNCS) and the buffers as kernel parameters and call arguments (FA_SM_* with prefix sm_,
    FA_MM_* with prefix mm_, so that no buffer name meets a kernel variable). () with neither: the
    module is the one without modifiers. ValueError for a backward through a forward-only modifier."""
    if score_mod is None and mask_mod is None:
        return ()
    opts, funcs = [], []
    if score_mod is not None:
        where = f"score_mod {score_mod.name!r}"
        if backward and not score_mod.has_grad:
            raise ValueError(f"{where} has no derivative (cuda_grad): no backward can run with it")
        if score_mod.cuda_distance_slope is not None and seed and not backward:   # the bias seeds S (tc_mods.cuh)
            opts.append("-DFA_DIST_BIAS=1")
            funcs.append(_cuda_fn("dist_slope", "", _one_line(score_mod.cuda_distance_slope, where), score_mod.buffers,
                                  indices="int b, int h"))
        elif not score_mod.is_identity:      # the identity (sinks alone): no FA_SCORE_MOD, the fast path
            opts.append("-DFA_SCORE_MOD=1")
            # a forward module compiles the factored core where there is one (the host passes the scales); a
            # backward module the whole text (its kernels take |scale| and log2 e as they are), or, with
            # `factored` (a kernel that takes FA_SCORE_FACTORED's arguments, fa3_bwd2) and a modifier whose
            # core has its derivative, the core and core' (the host passes pre, post log2 e and post pre)
            core_bwd = backward and factored and score_mod.backward_factored
            if core_bwd:
                opts.append("-DFA_SCORE_FACTORED=1")
                if " ".join(score_mod.cuda_factored[0].split()) == "fa_tanh(s)" and \
                        " ".join(score_mod.cuda_factored_grad.split()) == "fa_sech2(s)":
                    opts.append("-DFA_TANH_CORE=1")      # sech^2 from the core's tanh where the tile allows (fa3_bwd2.cu)
            text = (score_mod.cuda if backward and not core_bwd or score_mod.cuda_factored is None
                    else score_mod.cuda_factored[0])
            funcs.append(_cuda_fn("score_mod", "float s, ", _one_line(text, where), score_mod.buffers, floats=True))
            if score_mod.monotone and not backward:        # a full tile's row max before the modifier (fa3_ws.cu)
                opts.append("-DFA_SCORE_MONOTONE=1")
            if backward:
                opts.append("-DFA_SCORE_MOD_GRAD=1")
                grad = score_mod.cuda_factored_grad if core_bwd else score_mod.cuda_grad
                funcs.append(_cuda_fn("score_mod_grad", "float s, ", _one_line(grad, where), score_mod.buffers,
                                      floats=True))
        if score_mod.sink is not None:
            opts.append("-DFA_SINKS=1")
        opts += _buffer_macros("SM", "sm_", score_mod.buffers)
    if mask_mod is not None:
        opts.append("-DFA_MASK_MOD=1")
        funcs.append(_cuda_fn("mask_mod", "", _one_line(mask_mod.cuda, f"mask_mod {mask_mod.name!r}"),
                              mask_mod.buffers, result="bool"))
        opts += _buffer_macros("MM", "mm_", mask_mod.buffers)
    opts.append("-DFA_MOD_FUNCS=" + " ".join(" ".join(f.split()) for f in funcs))
    return tuple(opts)


def _buffer_macros(tag: str, prefix: str, buffers: dict) -> list:
    if not buffers:
        return []
    params, args = [], []
    for name, arr in buffers.items():
        params.append(f"const {_C_TYPES[arr.dtype.kind]}* __restrict__ {prefix}{name}")
        args.append(f"{prefix}{name}")
        for a in range(arr.ndim):
            params.append(f"int {prefix}{name}_shape{a}")
            args.append(f"{prefix}{name}_shape{a}")
    return [f"-DFA_{tag}_PARAMS=, {', '.join(params)}", f"-DFA_{tag}_ARGS=, {', '.join(args)}"]


def cuda_buffers(mod) -> list:
    """The modifier's buffers as the kernels take them (tc_mods.cuh, _cuda_fn): bool as uint8, integers as
    int32 (ValueError past its range), floats as float32; C-contiguous, in declaration order, each
    followed by its shape on the kernel's side."""
    out = []
    for name, arr in mod.buffers.items():
        if isinstance(arr, DeviceBuffer):                # already the kernels' type, checked when captured
            out.append(arr.array.view(np.uint8) if arr.dtype == np.bool_ else arr.array)
            continue
        if arr.dtype.kind in "iu" and arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
            raise ValueError(f"{mod.name}: buffer {name!r} does not fit in int32, which the CUDA kernels take")
        if arr.dtype == np.bool_ and arr.flags.c_contiguous:
            out.append(arr.view(np.uint8))           # the same bytes: no copy of a large (dense) mask per call
        else:
            out.append(np.ascontiguousarray(arr, dtype=_KERNEL_DTYPES[arr.dtype.kind]))
    return out


def sink_vector(score_mod: "ScoreMod | None", H: int) -> np.ndarray:
    """float32 [H]: the sink logit per query head, as the kernels read it (zeros without sinks: unread)."""
    if score_mod is None or score_mod.sink is None:
        return np.zeros(1, np.float32)
    return np.ascontiguousarray(np.broadcast_to(score_mod.sink, (H,)), dtype=np.float32)
