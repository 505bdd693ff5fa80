"""fa3-ws, fa3: the warp-specialized Hopper rungs, kernels_cu/fa3_ws.cu (sm_90a).

Seed: FA3 paper (Shah et al. 2024) Sec. 3.1 (warp specialization: a producer warpgroup issuing TMA
copies into a circular buffer of shared-memory slots guarded by mbarriers, consumer warpgroups on
wgmma, registers moved to the consumers with setmaxnreg; Algorithm 1) and Sec. 3.2 (intra-warpgroup
overlap of the softmax with the GEMMs; Algorithm 2).
  fa3-ws   TMA + warp specialization: the rung above fa3-wgmma (whose copies are cp.async by every
           thread, with two block-wide barriers per tile)
  fa3      the same with the overlap: S_{j+1} = Q K_{j+1}^T and O += P_j V_j in flight together, the
           softmax of S_{j+1} under the second; `pingpong`: the two consumer warpgroups also take turns
           issuing their GEMMs, one's softmax under the other's (inter-warpgroup, FA3 Sec. 3.1);
           `softmax_turns`: they take turns at the softmax instead, so that two softmaxes never run at once
           (on at d = 128, "auto": 1-13% faster there, bench/results/h100/2026-11-27-session-17.md)
Forward parameters: Bc (`block_c`), consumer warpgroups (`consumers`, Br = 64 x consumers; "auto": 3 at
d <= 64 without modifiers or with those that stay spill-free there (three_consumers), else 2,
WsConfig.for_head_dim; fa3 at d <= 64 with a score modifier's text and no mask modifier or dropout: 3 without the
overlap, serial_three), ring
slots (`stages`), `overlap`, `philox_rounds`, `exp2_fma` (every k-th column block's softmax exp2 by a
polynomial on the FMA pipe instead of MUFU.EX2: a rung that measured slower at every k on the H100, kept
with its tests and its bench row; kernels_cu/tc_softmax.cuh, bench/results/h200/2026-11-26-session-6.md).
Tensor maps: sandbox/tma.py (built per array on the host, passed by value through loader.PackedLaunch).
The backward: `bwd_kernel` (fa3_wgmma.BWD_KERNEL; "auto" is wgmma2 at d <= 128, modifiers included, else
fa2-tc's mma.sync backward with its defaults).
Features and envelope: as fa3-wgmma (fa2-tc's features; fp16, bf16; d a multiple of 8 up to 256, padded
to D = 64, 128, 192 or 256; Bc "auto": FA3's key tile per head dim, 128 / 112 / 80; the backward runs every
head dim, fa2-tc's wide kernel past d = 128; sm_90 GPUs only). At D = 256 the default tile is FA3's: Br = 128 (two consumer warpgroups at
240 registers, O alone 128 of them), Bc = 80, two ring slots (Q 64 KB + 2 x (K, V) 160 KB of 227 KB). Arrays whose strides TMA cannot describe (not 16-byte multiples, zero strides of
broadcast dims) are copied to contiguous ones first; the torch plan path then takes the generic path.
Score and mask modifiers: as fa3-wgmma (tc_mods.cuh compiled into the forward module, the mask
modifier's tile classes in the table both roles walk; the backward as fa3-wgmma's: wgmma2 with every modifier
up to d = 128).
Status and speed: bench/results/h100/.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from sandbox import arrays, loader, stream_counters, tma
from sandbox.device import SMEM_PER_BLOCK_OPTIN, sm_count
from sandbox.launch import COUNTERS, LaunchPlan, _cached, cuda_options, dropout_args, f32, i32, mask_args
from sandbox.loader import CompileUnit, PackedLaunch, Slot, get_kernel
from sandbox.masks import UNBOUNDED, Band, mean_visible_keys
from sandbox.registry import Param, Variant, philox_rounds_param, register

from .fa2_tc import CTYPE, ITEMSIZE, TCConfig, _dropout_slots, forward_scale_log2
from .fa2_tc import ModKernel, score_text, seeds_bias
from .fa3_wgmma import ARCHS, AUTO_BC, BWD_KERNEL, CAPS, FA3Wgmma, d_pad, forward_tiles, has_mods, register_errors

SMEM_LIMIT = SMEM_PER_BLOCK_OPTIN["sm_90"]


# ---- config

AUTO_CONSUMERS_D = 64      # consumers="auto": three consumer warpgroups (Br = 192) at this padded head dim
AUTO_PERSISTENT_D = 128    # persistent="auto": the persistent grid at this padded head dim
SHORT_KEYS = 3072          # ... and at D = 64 where a query row sees at most this many keys on average (short_walk)
AUTO_TURNS_D = 128         # softmax_turns="auto": the consumers take turns at the softmax at this padded head dim
AUTO_TURNS_BIAS_NK = 8192  # ... and at D = 64 with modifiers, but not for a distance bias (ALiBi) from this key length
MUFU_PIPE_GROUP = 2        # mufu_pipe: n8 blocks per group of the pipelined softmax (kernels_cu/fa3_ws.cu pipe_full)


@functools.lru_cache(maxsize=256)
def short_walk(Nq: int, Nk: int, causal: bool, window) -> bool:
    """Whether a query row of this shape sees at most SHORT_KEYS keys on average (causal and window counted;
    block-sparse layouts and mask modifiers are not): the Q tiles' walks are short, so that the persistent
    grid's overlap of one item's start with the last one's end pays at D = 64 (H100, session 9: +1-3% non-causal
    and +6% causal at N = 2k, +1-2% causal at 4k; 1-4% slower on the longer walks of 4k-16k non-causal and 8k-16k
    causal, session 9 call 2)."""
    band = Band.from_options(Nq, Nk, causal, window)
    return mean_visible_keys(Nq, Nk, band.lo, band.hi) <= SHORT_KEYS


def three_consumers(p) -> bool:
    """Whether p's modifiers leave fa3's D = 64 forward spill-free with three consumer warpgroups (160 registers a
    thread; NVRTC 13, sm_90a, session 23): sinks (with or without dropout) and a distance bias seeded into S
    (ALiBi) without dropout; not a score modifier's text (the soft-cap: 392-412 bytes of spill), a mask modifier,
    or a distance bias with dropout (364-380 bytes)."""
    if p.mask_mod is None and p.score_mod is not None and not score_text(p):
        return not (seeds_bias(p) and p.dropout_p > 0)
    return False


SERIAL_WAVES = 16          # serial_three: from this many Q tiles (Br = 192) per SM


def serial_three(p) -> bool:
    """Whether fa3's forward at D = 64 runs p on three consumer warpgroups without the intra-warpgroup overlap (fa3-ws's
    loop) on the persistent grid (_resolve): a score modifier's text (the soft-cap, a relative bias; sinks beside it
    allowed), no mask modifier, no dropout, and at least SERIAL_WAVES Q tiles per SM (132 SMs assumed without a GPU).
    The overlapped loop spills such a build at three consumers (412-556 bytes) and runs two; the loop without the
    overlap spills 0-16 bytes at three (persistent), and measured faster than fa3's two-consumer overlapped loop on
    large problems (H100, fp16, causal, B N = 16k, 32 heads, ~21 tiles per SM, N = 2k / 4k / 8k / 16k: soft-cap 2% /
    2% / 9% / 7%, relative bias 0% / 4% / 8% / 9%; bench/results/h100/2026-11-27-session-24.md, call 7) but slower on
    small ones, where the persistent grid has little to balance (call 13: the soft-cap causal +31% / +13% / +6.5% /
    +2% / -0.3% at 0.7 / 1.5 / 2.7 / 5.3 / 10.7 tiles per SM, non-causal +10% / +8% at 2.7 / 5.3; a review run had
    non-causal -10% at 21). Unmeasured with dropout or a mask modifier: those keep the overlapped loop."""
    return serial_modifiers(p) and _q_tiles_192(p) >= SERIAL_WAVES * (sm_count() or 132)


def serial_modifiers(p) -> bool:
    """serial_three's conditions on p's modifiers alone (whatever its size): a score modifier's text, no mask modifier,
    no dropout (the builds that rule launches: tests/test_modifiers_hopper.py's spill gate)."""
    return score_text(p) and p.mask_mod is None and p.dropout_p == 0


def _q_tiles_192(p) -> int:
    """Problem p's Q tiles at D = 64's Br = 192 (three consumer warpgroups), over every batch and head."""
    return -(-p.Nq // (64 * 3)) * p.B * p.Hq


def _fills_the_gpu(p) -> bool:
    """Whether problem p has more Q tiles (at D = 64's Br = 192) than the GPU has SMs (True without a GPU): below,
    a persistent grid has nothing to balance. (Until session 10 each call also zeroed its item counter: host
    time per call at B = 1, N = 128 went 40 -> 57 us from torch in session 9's `bench host`; the kernel now
    leaves the stream's counter at zero.)"""
    sms = sm_count()
    return sms is None or _q_tiles_192(p) > sms


def row_shift(p, block_r: int) -> int:
    """fa3_ws.cu's row_shift: the rows by which the Q tiles start above row 0, so that the one partial tile
    (Nq not a multiple of Br) is the first, not the last. Where the band bounds a row's keys from above
    (causal, a window's right side) the last tile sees the most keys, so a partial last tile idles warpgroups
    for the longest walk: at d = 64 (Br = 192), causal, bottom-aligned tiles do 5-6% less tile work at N = 2k-4k
    and 1.5% at 8k-16k. 0 without such a bound, and with a block-sparse layout or a mask modifier (their tile
    tables are top-aligned). Score modifiers and sinks take it: the kernel runs the first Q tile, rows < 0
    included, on its partial path, which keeps those rows from the modifier (a buffer indexed by i)."""
    if p.band.hi >= UNBOUNDED or p.block_mask is not None or p.mask_mod is not None:
        return 0
    return -p.Nq % block_r


# q_prescale: the modifier's scale c (|scale| pre) for which Q times c, rounded to the dtype, stays exact up to one
# rounding: c <= 1 (no overflow past the input's own range); fp16 from 2^-10 (a q below 2^-14 / c = 1/16 becomes
# subnormal, rounded to an absolute 2^-25 / c <= 3e-5 in q's units, where fp16's own relative rounding is 2^-11 q),
# bf16 (fp32's exponent range) from 2^-32. The soft-cap at cap 50, d = 128: c = 2^-9.1.
PRESCALE_RANGE = {"float16": (2.0 ** -10, 1.0), "bfloat16": (2.0 ** -32, 1.0)}


def prescales(p, config, mods) -> bool:
    """Whether fa3's forward multiplies Q by the score modifier's scale in shared memory (q_prescale, kernels_cu/fa3_ws.cu
    prescale_q): a module that compiles a score modifier's text, a factor within PRESCALE_RANGE[dtype]."""
    if not config.q_prescale or mods is None or "-DFA_SCORE_MOD=1" not in mods.options or p.dtype not in PRESCALE_RANGE:
        return False
    lo, hi = PRESCALE_RANGE[p.dtype]
    c = f32(abs(p.scale) * p.score_mod.forward_scales()[0])       # modifier_args' mod_scale, as the kernel gets it
    return lo <= float(c) <= hi


@functools.lru_cache(maxsize=256)
def _resolve(config: "WsConfig", D: int, mods: bool, short: bool = False, score_text: bool = False,
             long_bias: bool = False, three: bool = False, serial: bool = False) -> "WsConfig":
    """WsConfig.for_head_dim's "auto"s, cached (a forward resolves them on every call: no dataclass copy per call)."""
    explicit_turns = config.softmax_turns != "auto" and bool(config.softmax_turns)
    if (serial and mods and D == AUTO_CONSUMERS_D and config.overlap and config.consumers == "auto"
            and config.persistent is not False and not config.pingpong and not explicit_turns
            and not config.p_smem and not config.trace):
        # serial_three: three consumers without the overlap on the persistent grid (the per-tile grid measured
        # slower than the overlapped two, session 24 call 7); not with trace=True: the loop trace records the
        # overlapped loop (bench/loop_trace.py)
        return dataclasses.replace(config, consumers=3, overlap=False, softmax_turns=False, persistent=True)
    three = three and mods                  # modifiers that leave three consumers spill-free (three_consumers)
    plain = not config.pingpong and not explicit_turns and (not mods or three)
    consumers = config.consumers if config.consumers != "auto" else (3 if D == AUTO_CONSUMERS_D and plain else 2)
    turns = config.softmax_turns
    if turns == "auto":
        turns = ((D == AUTO_TURNS_D or D == AUTO_CONSUMERS_D and mods and not score_text and not long_bias)
                 and consumers == 2
                 and config.overlap and not config.pingpong)
    c = dataclasses.replace(config, consumers=consumers, persistent=config.persistent != "auto" and bool(config.persistent),
                            softmax_turns=bool(turns))
    # modifiers: persistent with two consumer warpgroups, or three where they stay spill-free (a soft-cap's build
    # spills with three, more so persistent)
    may_persist = not config.pingpong and (not mods or consumers == 2 or (three and consumers == 3))
    if config.persistent == "auto" and may_persist and (D == AUTO_PERSISTENT_D or (D == AUTO_CONSUMERS_D and short)):
        on = dataclasses.replace(c, persistent=True)
        c = on if on.forward_smem(D) <= SMEM_LIMIT else c        # two Q buffers beside stages=3 do not fit
    return c


@dataclass(frozen=True)
class WsConfig:
    block_c: object = "auto"
    consumers: object = "auto"                           # 1, 2, 3 or "auto" (for_head_dim)
    stages: int = 2
    overlap: bool = True
    philox_rounds: int = 10
    pingpong: bool = False
    bwd: TCConfig = field(default_factory=TCConfig)     # fa2-tc's backward config (its defaults; rowdot)
    bwd_kernel: str = "auto"                             # fa3_wgmma.BWD_KERNEL: auto, mma, wgmma, wgmma2
    exp2_fma: int = 0                                    # every k-th column block's exp2 on the FMA pipe (0: none)
    persistent: object = "auto"                          # one block per SM walking the Q tiles (kernels_cu/fa3_ws.cu);
                                                         # False, True or "auto" (for_head_dim)
    trace: bool = False                                  # FA_TRACE: block 0's loop phase clocks (read_trace)
    softmax_turns: object = "auto"                       # FA_SOFTMAX_TURNS: the consumers take turns at the softmax;
                                                         # False, True or "auto" (for_head_dim)
    mufu_pipe: bool = False                              # FA_MUFU_PIPE: a score-modified full tile's softmax pipelined
    q_prescale: bool = False                             # FA_Q_PRESCALE: Q times the modifier's scale in shared memory
                                                         # (where prescales() allows), no FMUL per score
    p_smem: bool = False                                 # FA_P_SMEM: the overlapped loop's P_j in shared memory, the
                                                         # A operand of O += P_j V_j from there (fa3 only)

    def for_head_dim(self, D: int, mods: bool = False, short: bool = False, score_text: bool = False,
                     long_bias: bool = False, three: bool = False, serial: bool = False) -> "WsConfig":
        """The config with its "auto"s resolved for padded head dim D, as measured on the H100
        (bench/results/h100/2026-11-26-session-8.md, -session-9.md). consumers: 3 at D = 64 (Br = 192, 0.88-1.00x
        SDPA cuDNN non-causal), else 2. persistent: on at D = 128 (0-8% faster there); at D = 64 only where the
        problem's walks are `short` (short_walk: 1-6% faster there, 1-4% slower on longer ones). With ping-pong
        (two warpgroups, its own schedule) neither changes. With `mods` (score / mask modifiers compiled in)
        consumers stay 2 unless `three` (below; three spill a soft-cap's build at 160 registers a thread and
        measured 7-47% slower than two with soft-cap, ALiBi and a document mask at d = 64, N = 4k causal, when the
        Q tiles of modified problems were top-aligned), and persistent follows the
        same rule as without, with two consumers only: at N = 4k causal it measured 3-13% faster than the
        non-persistent grid for the same three modifiers at d = 64 and 128 (session 12, call 1). Three consumers
        at D = 128 (Bc 64, no spills) measured 2% slower plain causal and 17% slower with a soft-cap at N = 4k
        (session 15, call 5). softmax_turns: on at D = 128 with two consumers and no ping-pong (1-3% faster
        non-causal, 2-13% causal, 0-4% with modifiers; at D = 64 slower than three consumers: session 17), and at
        D = 64 with modifiers (two consumers) unless `score_text`, a score modifier compiled as text (FA_SCORE_MOD:
        the soft-cap, a relative bias): N = 4k causal, ALiBi 5%, a document mask 5%, sinks 1-8% faster, the soft-cap
        5% slower and a relative bias 0-1% (session 18, call 3), and unless `long_bias`, a distance bias seeded into S
        (ALiBi) with Nk >= AUTO_TURNS_BIAS_NK: N = 2k-16k causal, turns made ALiBi 4-5% faster at 2k-4k but 8% slower
        at 8k and 12% at 16k; document masks and sinks 0-9% faster at every N (session 19, call 6; measured with
        Nq = Nk, causal: the rule's use of Nk alone for other shapes is unmeasured). `three` (with `mods`): modifiers
        whose D = 64 build stays spill-free with three consumers (three_consumers: sinks, a distance bias without
        dropout) take three, as plain attention does, and may take the persistent grid: with bottom-aligned Q tiles
        (row_shift, session 23) ALiBi ran +3-9% over plain causal at N = 2k-16k with three consumers on the
        persistent grid against +10-17% with two, and sinks +0-6% against +8-14% (H100, call 3 of
        bench/results/h100/2026-11-27-session-23.md). `serial` (with `mods`, fa3 at D = 64, consumers "auto", no
        ping-pong, softmax turns, p_smem, trace or persistent=False asked for): a score modifier's text without a mask
        modifier or dropout on a problem of at least SERIAL_WAVES Q tiles per SM (serial_three) runs on three consumers
        without the overlap, fa3-ws's loop, on the persistent grid: 0-9% faster than the overlapped two there
        (session 24)."""
        if self.consumers != "auto" and self.persistent != "auto" and self.softmax_turns != "auto":
            return self
        return _resolve(self, D, mods, short, score_text, long_bias, three, serial)

    def _n(self) -> int:
        if self.consumers == "auto":
            raise ValueError("consumers='auto' depends on the head dim: resolve it with for_head_dim(D) first")
        return self.consumers

    @property
    def block_r(self) -> int:
        return 64 * self._n()

    @property
    def threads(self) -> int:
        return 128 * (self._n() + 1)

    def bc(self, D: int, dropout: bool = False) -> int:
        return AUTO_BC[D] if self.block_c == "auto" else self.block_c

    @property
    def register_cap(self) -> int:
        """A consumer thread's registers: setmaxnreg's claim (240 with two consumers, 160 with three), or
        with one consumer the 255 that two warpgroups of one block per SM allow."""
        return {1: 255, 2: 240, 3: 160}[self._n()]

    def forward_name(self, dtype: str, D: int, dropout: bool, mods: bool = False) -> str:
        c = self.for_head_dim(D, mods)
        return (f"fa3_ws_forward<{CTYPE[dtype]}, {D}, {c.bc(D)}, {c.consumers}, {c.stages}, "
                f"{'true' if self.overlap else 'false'}, {'true' if self.pingpong else 'false'}, "
                f"{'true' if c.persistent else 'false'}, {c.philox_rounds}, "
                f"{'true' if dropout else 'false'}>")

    def forward_smem(self, D: int, dropout: bool = False, mods: bool = False) -> int:
        """Q (two buffers when persistent), the STAGES K and V slots, with p_smem a [64][Bc] P tile per consumer,
        the mbarriers (Q full / empty per buffer, four per slot), the two item slots, 1024 bytes of alignment slack
        (kernels_cu/fa3_ws.cu)."""
        c = self.for_head_dim(D, mods)
        qbufs = 2 if c.persistent else 1
        p_tiles = ITEMSIZE * c.block_r * self.bc(D) if self.p_smem else 0
        return (ITEMSIZE * D * (qbufs * c.block_r + 2 * self.stages * self.bc(D)) + p_tiles + 8 * (4 + 4 * self.stages)
                + 8 + 1024)

    def unit(self, dtype: str, D: int, mods=None, prescale: bool = False) -> CompileUnit:
        """Both dropout switches in one module; with `mods` (fa2_tc.ModKernel: the modifiers compiled in)
        the one switch it names. `prescale`: FA_Q_PRESCALE (prescales(), with a score modifier's text only)."""
        drops = (False, True) if mods is None else (mods.dropout,)
        names = tuple(self.forward_name(dtype, D, drop, mods is not None) for drop in drops)
        emu = (f"-DFA_EXP2_EMU={self.exp2_fma}",) if self.exp2_fma else ()
        emu += ("-DFA_TRACE",) if self.trace else ()
        text = mods is not None and "-DFA_SCORE_MOD=1" in mods.options      # a score modifier's text compiled in
        turns = self.for_head_dim(D, mods is not None, score_text=text).softmax_turns
        emu += ("-DFA_SOFTMAX_TURNS",) if turns else ()
        pipe = self.mufu_pipe and text                                       # changes nothing else
        emu += (f"-DFA_MUFU_PIPE={MUFU_PIPE_GROUP}",) if pipe else ()
        if prescale and not text:
            raise ValueError("FA_Q_PRESCALE scales the scores a score modifier's text sees: a module without one "
                             "has no such factor")
        emu += ("-DFA_Q_PRESCALE",) if prescale else ()
        emu += ("-DFA_P_SMEM",) if self.p_smem else ()
        return CompileUnit("fa3_ws.cu", names, cuda_options() + emu + (mods.options if mods else ()),
                           {n: self.forward_smem(D, mods=mods is not None) for n in names},
                           label=f"{'fa3' if self.overlap else 'fa3-ws'}[{dtype}, D={D}"
                                 f"{f', exp2_fma={self.exp2_fma}' if self.exp2_fma else ''}{', trace' if self.trace else ''}"
                                 f"{', softmax_turns' if turns else ''}{', mufu_pipe' if pipe else ''}"
                                 f"{', q_prescale' if prescale else ''}{', p_smem' if self.p_smem else ''}"
                                 f"{mods.label if mods else ''}]",
                           archs=ARCHS)

    def envelope_errors(self, D: int, mods: bool = False) -> list[str]:
        c = self.for_head_dim(D, mods)
        smem = c.forward_smem(D)
        errs = [f"shared memory {smem} B exceeds {SMEM_LIMIT} B"] if smem > SMEM_LIMIT else []
        errs += register_errors(D, c.bc(D), c.register_cap, f"a consumer thread with consumers={c.consumers}")
        if c.pingpong and (c.consumers != 2 or not c.overlap):
            errs.append(f"pingpong=True takes turns between two consumer warpgroups of the overlapped loop "
                        f"(consumers=2, variant fa3); got consumers={c.consumers}")
        if c.softmax_turns and (c.pingpong or c.consumers != 2 or not c.overlap):
            errs.append(f"softmax_turns=True takes turns at the softmax between two consumer warpgroups of the overlapped "
                        f"loop (variant fa3), without ping-pong; got consumers={c.consumers}"
                        f"{', pingpong=True' if c.pingpong else ''}{'' if c.overlap else ', no overlap'}")
        if c.p_smem and (not c.overlap or D > 128 or c.bc(D) % 64):
            errs.append(f"p_smem=True keeps P in shared memory for the overlapped loop (variant fa3) with whole 64-key "
                        f"panels, d <= 128; got D = {D}, block_c={c.bc(D)}{'' if c.overlap else ', no overlap'}")
        if c.persistent and (c.pingpong or D > 128):
            errs.append(f"persistent=True double-buffers Q (D <= 128) and walks its tiles without ping-pong; got "
                        f"D = {D}{', pingpong=True' if c.pingpong else ''}")
        return errs


# ---- launch

# ---- the loop trace (trace=True: kernels_cu/fa3_ws.cu FA_TRACE)

TRACE_EVENTS = ("top", "operands", "turn", "s_issued", "pv_issued", "s_done", "softmax_done", "pv_done")
TRACE_SHAPE = (3, 512, len(TRACE_EVENTS))      # [consumer warpgroup][iteration][event], fa3_ws.cu's fa_trace


def _trace_buffers() -> list:
    import cupy as cp
    return [cp.ndarray(TRACE_SHAPE, cp.int64, ptr) for ptr in loader.module_globals("fa3_ws.cu", "-DFA_TRACE", "fa_trace")]


def clear_traces() -> None:
    """Zero the trace of every traced fa3 module loaded on this device (before the launch to be read)."""
    for buf in _trace_buffers():
        buf.fill(0)


def read_trace():
    """The clocks of the last traced launch since clear_traces (the traced module whose buffer holds the most
    entries), as a host int64 array TRACE_SHAPE: clock64() per consumer warpgroup, loop iteration and event
    (TRACE_EVENTS); rows past the block's walk are zero. Synchronises the device (a debugging tool)."""
    import numpy as np
    bufs = [b.get() for b in _trace_buffers()]
    if not bufs:
        raise RuntimeError("no traced fa3 module is loaded: run fa3 with trace=True first")
    return max(bufs, key=lambda a: int(np.count_nonzero(a)))


def _no_sched(xp):
    """The `sched` argument of a non-persistent launch: a device int the kernel never reads (cached)."""
    return _cached(("no-sched",), lambda: xp.zeros(1, dtype=xp.uint32), xp)


class FA3WarpSpecialized(FA3Wgmma):
    """fa3-wgmma's checks, compile units and (fa2-tc's) backward; its own forward launch: tensor maps
    for q, k and v instead of pointers and strides, PackedLaunch on the caller's stream."""

    # spill-free in the compile report (NVRTC 13, sm_90a) at D = 64, 128, 192 and 256: (block_c, consumers,
    # stages), "auto" being Bc = 128 at D <= 128 and, for consumers, 3 at D = 64 without modifiers (or with those
    # three_consumers names), else 2
    # (WsConfig.for_head_dim); consumers=2 (the former default) and stages=3 compiled clean too at D <= 128 but
    # are left to compile on first use (the CI gate's time budget)
    TUNED = {("auto", "auto", 2)}

    def __init__(self, name: str, overlap: bool):
        super().__init__()
        self.name, self.overlap = name, overlap

    # the loop trace (trace=True), as bench/loop_trace.py reads it through the registry
    clear_traces = staticmethod(clear_traces)
    read_trace = staticmethod(read_trace)

    def configure(self, block_c="auto", consumers="auto", stages=2, philox_rounds=10, pingpong=False, bwd_kernel="auto",
                  exp2_fma=0, persistent="auto", trace=False, softmax_turns="auto",
                  mufu_pipe=False, q_prescale=False, p_smem=False):
        return WsConfig(block_c, consumers, stages, self.overlap, philox_rounds, pingpong,
                        TCConfig(philox_rounds=philox_rounds), bwd_kernel, exp2_fma, persistent, trace,
                        softmax_turns, mufu_pipe, q_prescale, p_smem)

    def report_configs(self):
        """The defaults (the tuned table) and ping-pong for fa3: the CI gate."""
        extra = [{"pingpong": True}] if self.overlap else []
        return [{}, *extra]

    def tuned(self, config, unit=None) -> bool:
        if unit is not None and unit.source != "fa3_ws.cu":
            return super().tuned(config, unit)
        return (config.block_c, config.consumers, config.stages) in self.TUNED

    # consumers="auto" resolved per problem (WsConfig.for_head_dim) where a forward enters

    def _resolved(self, p, config):
        D = d_pad(p.d)
        # a mask modifier's empty tiles shorten the band's walks: taken as short (a causal mask given densely, d = 64,
        # N = 4k: 0.92 -> 0.77 ms on the persistent grid, H100, session 13 call 8)
        short = (D == AUTO_CONSUMERS_D and config.persistent == "auto" and _fills_the_gpu(p)
                 and (p.mask_mod is not None or short_walk(p.Nq, p.Nk, p.causal, p.window)))
        long_bias = D == AUTO_CONSUMERS_D and seeds_bias(p) and p.Nk >= AUTO_TURNS_BIAS_NK
        three = D == AUTO_CONSUMERS_D and three_consumers(p)
        serial = D == AUTO_CONSUMERS_D and serial_three(p)
        c = config.for_head_dim(D, has_mods(p), short, score_text(p), long_bias, three, serial)
        # a distance bias on three consumers: the persistent grid at every length (6-12% faster than the per-tile
        # grid at N = 2k-16k causal, H100, session 23 call 3); sinks, and a bias on two consumers, follow plain
        # attention's rule
        if (three and c.consumers == 3 and not short and config.persistent == "auto" and seeds_bias(p)
                and _fills_the_gpu(p)):
            c = config.for_head_dim(D, True, True, score_text(p), long_bias, three)
        return c

    def check(self, problem, config, direction):
        super().check(problem, self._resolved(problem, config), direction)

    def forward(self, p, q, k, v, config):
        """Both with and without modifiers: `launch` takes either (fa2-tc's forward would pick the grid)."""
        config = self._resolved(p, config)
        return self.launch(p, q, k, v, config, self.grid(p, config))

    @staticmethod
    def grid(p, config) -> tuple[int, int]:
        """(ceil(Nq / Br), B * Hq) blocks, one per Q tile; persistent: as many blocks as Q tiles, at most one
        per SM (the GPU's count; uncapped without a GPU), each taking items from the kernel's atomic counter."""
        tiles = -(-p.Nq // config.block_r)
        if not config.persistent:
            return tiles, p.B * p.Hq
        return min(tiles * p.B * p.Hq, sm_count() or tiles * p.B * p.Hq), 1

    def _arguments(self, p, config, maps, out, lse, sched, xp, mods=None):
        """The kernel's arguments up to DROPOUT_PARAMS; MOD_PARAMS (after them) come back separately. `sched`:
        the persistent kernel's item counter (uint32, zero at launch, reset by the kernel's last claim: the
        stream's kept counters, sandbox/stream_counters.py), else any device array (unread)."""
        D, dropout = d_pad(p.d), p.dropout_p > 0
        shift = row_shift(p, config.block_r)
        tiles, tile_heads, mod_rest = forward_tiles(p, config, D, mods, xp, shift)
        return tiles, (*maps, out, lse, sched, tiles, tile_heads, i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d),
                       i32(p.B * p.Hq), i32(shift), f32(forward_scale_log2(p)), *mask_args(p, xp)), D, dropout, mod_rest

    def launch(self, p, q, k, v, config, grid, scratch=()):
        import cupy as xp
        if p.scale < 0:          # the kernels take the row max on raw scores: scale > 0 (tc_softmax.cuh)
            k = arrays.negate(k, xp)
        maps, held = [], []
        bc = config.bc(d_pad(p.d))
        for x, rows in ((q, 64), (k, bc), (v, bc)):
            if tma.usable_strides(x.shape, arrays.element_strides(x)) is None or x.data.ptr % 16:
                x = xp.array(x, copy=True, order="C")    # strides or a base TMA cannot describe: a fresh copy
            maps.append(tma.map_of(x, rows))
            held.append(x)                           # alive until the launch is queued
        out = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=q.dtype)
        lse = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        mods = ModKernel.of(p)     # None without modifiers: the module and arguments without them
        sched = stream_counters.zeroed(xp, 1) if config.persistent else _no_sched(xp)
        tiles, args, D, dropout, mod_rest = self._arguments(p, config, maps, out, lse, sched, xp, mods)
        unit, name = config.unit(p.dtype, D, mods, prescales(p, config, mods)), config.forward_name(p.dtype, D, dropout)
        kernel = PackedLaunch(get_kernel(unit, name).kernel, grid, (config.threads,), unit.dynamic_smem[name],
                              (*args, *dropout_args(p), *mod_rest))
        kernel({}, xp.cuda.get_current_stream())
        return out, lse

    def forward_plan(self, p, config, strides) -> LaunchPlan | None:
        """Tensor maps encoded per call from the pointers (cached by address in sandbox/tma.py). None
        where the generic path must run: a negative scale, strides TMA cannot describe. With modifiers, their
        module, buffers and tile table (a mask modifier's: made now, on the caller's stream, which keys the plan:
        sandbox/fastpath.py mods_key) are resolved here once: the generic path's per-call resolution cost about
        0.6 ms of host time (H100 host, session 13)."""
        import cupy as xp
        if p.scale < 0:
            return None
        config = self._resolved(p, config)
        shapes = {"q": (p.B, p.Hq, p.Nq, p.d), "k": (p.B, p.Hkv, p.Nk, p.d), "v": (p.B, p.Hkv, p.Nk, p.d)}
        if any(tma.usable_strides(shapes[nm], strides[nm]) is None for nm in shapes):
            return None
        rows = {"q": 64, "k": config.bc(d_pad(p.d)), "v": config.bc(d_pad(p.d))}
        maps = tuple(Slot(f"map_{nm}", "map") for nm in ("q", "k", "v"))
        sched = Slot("sched") if config.persistent else _no_sched(xp)
        mods = ModKernel.of(p)     # None without modifiers
        tiles, args, D, dropout, mod_rest = self._arguments(p, config, maps, Slot("out"), Slot("lse"), sched, xp, mods)
        unit, name = config.unit(p.dtype, D, mods, prescales(p, config, mods)), config.forward_name(p.dtype, D, dropout)
        kernel = PackedLaunch(get_kernel(unit, name).kernel, self.grid(p, config),
                              (config.threads,), unit.dynamic_smem[name], (*args, *_dropout_slots(p), *mod_rest))

        dtype = p.dtype       # the closure keeps no Problem: a plan must not hold the modifiers (fastpath.Plan)

        def run(ptr, seed, offset, stream):
            held = []
            for nm in ("q", "k", "v"):
                m = tma.tensor_map(ptr[nm], dtype, shapes[nm], strides[nm], rows[nm])
                ptr[f"map_{nm}"] = m.address
                held.append(m)
            ptr["seed"], ptr["offset"] = seed, offset
            kernel(ptr, stream)

        buffers = {"out": ((p.B, p.Hq, p.Nq, p.d), p.dtype, False), "lse": ((p.B, p.Hq, p.Nq), "float32", False)}
        if config.persistent:
            buffers["sched"] = ((1,), "uint32", COUNTERS)   # the item counter: the stream's, left at zero
        return LaunchPlan(buffers, run, keep=(tiles,) if config.persistent else (tiles, sched))


PARAMS = (
    Param("block_c", ("auto", 64, 80, 112, 128), "auto", "Bc: keys per K/V tile (the n of S = Q K^T's wgmma); auto: "
          "128 up to d = 128, 112 at d <= 192, 80 at d <= 256 (fa3_wgmma.AUTO_BC)"),
    Param("consumers", ("auto", 1, 2, 3), "auto", "consumer warpgroups, 64 query rows each (Br = 64 x consumers); "
          "one more warpgroup produces; auto: 3 at d <= 64 without ping-pong and without modifiers or with "
          "sinks or ALiBi without dropout (spill-free there), else 2 (WsConfig.for_head_dim); fa3 with a score "
          "modifier's text (the soft-cap, a relative bias) at d <= 64, no mask modifier, no dropout, at least 16 Q tiles "
          "per SM: 3 without the overlap (fa3-ws's loop) on the persistent grid, measured 0-9% faster than its "
          "overlapped two there, slower on smaller problems (serial_three; not with persistent=False)"),
    Param("stages", (2, 3), 2, "K/V ring slots in shared memory (TMA runs up to stages - 1 tiles ahead)"),
    philox_rounds_param(), BWD_KERNEL,
    Param("persistent", ("auto", False, True), "auto", "one block per SM taking (Q tile, head) items from an atomic "
          "counter, with two Q buffers: the next item's Q and K / V load under this one's last GEMMs and epilogue "
          "(FA3 Sec. 3.1's persistent kernel and tile scheduler; d <= 128, no ping-pong); auto: on at 64 < d <= 128 "
          "(measured 0-8% faster there, 4-13% with modifiers), at d <= 64 where a query row sees at most 3k keys on "
          "average and the Q tiles outnumber the SMs (1-6% faster there, 1-4% slower on longer rows); with "
          "modifiers only with two consumer warpgroups, or three with sinks (the same rule) or ALiBi (at every "
          "length: 6-12% faster than the per-tile grid); fa3's three consumers without the overlap for a score "
          "modifier's text (consumers, serial_three) always run on it"),
    Param("exp2_fma", (0, 2, 3, 4), 0, "the softmax's exp2 of every k-th column block (n8) on the FMA pipe (a "
          "degree-4 polynomial, kernels_cu/tc_softmax.cuh exp2_fma) instead of MUFU.EX2, the quarter-rate unit a "
          "score modifier's tanh also needs; 0: every exp2 on MUFU"),
    Param("q_prescale", (False, True), False, "with a score modifier compiled as text (the soft-cap, a relative bias), "
          "each consumer warpgroup multiplies its rows of the Q tile by the modifier's scale (|scale| / cap for the "
          "soft-cap) in shared memory once per Q tile, so that no score needs the FMUL before the modifier "
          "(kernels_cu/fa3_ws.cu prescale_q), only where that factor lies in PRESCALE_RANGE for the dtype. Measured "
          "(H100, fp16, causal, session 21): the soft-cap 6% faster at d = 64 (N = 4k-8k), unchanged at d = 128, a "
          "relative bias -4% to +5%; off by default because of one more rounding of q in the input dtype: in the GPU "
          "checks lse's error against the float64 oracle grew 25-550x in fp16 (soft-cap: 3.6e-4 from 5.2e-6, 3.6e-3 "
          "from 1.1e-4 at large logits) and 200-6,100x in bf16, out's up to 3x, all within the tolerance rule. "
          "Without a score modifier's text (or outside the range) it changes nothing"),
)

register(Variant(
    name="fa3-ws", family="fa3", backend="cuda",
    description="Hopper rung 2: TMA copies on mbarriers from a producer warpgroup, wgmma consumers, setmaxnreg; "
                "fa2-tc's backward",
    impl=FA3WarpSpecialized("fa3-ws", overlap=False), params=PARAMS, caps=CAPS,
    seed_ref="FA3 paper Sec. 3.1, Algorithm 1",
    tags=("tc-ladder",),
    # consumers=2: the former default at d = 64, beside "auto" (3 there; 0.90-1.00x cuDNN non-causal on the H100,
    # bench/results/h100/2026-11-26-session-7-d64.md)
    bench_configs=({"stages": 3}, {"consumers": 2}, {"persistent": True}, {"persistent": False})))

register(Variant(
    name="fa3", family="fa3", backend="cuda",
    description="Hopper rung 3: fa3-ws with the softmax of S_j+1 overlapped with O += P_j V_j (intra-warpgroup; "
                "at d <= 64 a score modifier's text on large problems runs fa3-ws's loop on three consumers, "
                "serial_three); fa2-tc's backward",
    impl=FA3WarpSpecialized("fa3", overlap=True), caps=CAPS,
    params=(*PARAMS, Param("pingpong", (False, True), False, "the two consumer warpgroups take turns issuing their "
                           "GEMMs (named barriers), one's softmax under the other's GEMMs (FA3 Sec. 3.1); consumers=2"),
            Param("softmax_turns", ("auto", False, True), "auto", "the two consumer warpgroups take turns at the "
                  "softmax (named barriers), so that one's MUFU work runs beside the other's GEMMs and the two softmaxes "
                  "never share the MUFU pipe; consumers=2, no ping-pong; auto: on at 64 < d <= 128 (measured 1-3% faster "
                  "non-causal, 2-13% causal, 0-4% with modifiers there; 0-11% slower at d = 64 than three consumers), "
                  "and at d <= 64 with modifiers on two consumers unless a score modifier's text is compiled in "
                  "(document masks, ALiBi with dropout; the soft-cap 5% slower with them); ALiBi without dropout "
                  "and sinks run three consumers there, which take no turns"),
            Param("mufu_pipe", (False, True), False, "with a score modifier (not ALiBi's seeded form), a full tile's "
                  "modifier and row max, then its exponentials and row sums, in groups of two n8 blocks tied to the row "
                  "max / sums two groups back, so that the ALU work fills the issue slots between the MUFU ops (tanh, "
                  "exp2); the same result bit for bit; measured 3% (d = 128) and 6% (d = 64) faster with the soft-cap "
                  "at N = 4k causal on the H100; a monotone modifier's row max first (ScoreMod.monotone, the soft-cap's "
                  "default) ties with it at d = 64 and is 4% faster at d = 128; mufu_pipe overrides it where both apply "
                  "(kernels_cu/fa3_ws.cu); time it with "
                  "`python -m bench modifiers --variant fa3:mufu_pipe=true`"),
            Param("p_smem", (False, True), False, "P_j waits for V_j in shared memory (one [64][Bc] tile per consumer "
                  "warpgroup, stmatrix) instead of registers, and O += P_j V_j reads its A operand from there, so that "
                  "the 32 registers P held (Bc = 128) are free through the next tile's softmax: the room a score "
                  "modifier's temporaries need with three consumers at 160 registers a thread (kernels_cu/fa3_ws.cu); "
                  "d <= 128, Bc 64 or 128; the same products, bit for bit; measured slower on the H100 (plain causal 8-11%, the "
                  "soft-cap no faster: bench/results/h100/2026-11-27-session-24.md), kept as a rung"),
            Param("trace", (False, True), False, "record clock64() at eight points of every loop iteration of block 0, "
                  "per consumer warpgroup (kernels_cu/fa3_ws.cu FA_TRACE; read_trace, python -m bench.loop_trace); "
                  "the result is the same; the overlapped loop is kept where fa3 would run a score modifier's text "
                  "without it (serial_three), so that there is a loop to trace")),
    seed_ref="FA3 paper Sec. 3.1-3.2, Algorithms 1 and 2",
    tags=("tc-ladder",),
    bench_configs=({"pingpong": True}, {"persistent": True}, {"persistent": False}, {"consumers": 2}, {"stages": 3}, {"block_c": 64}, {"consumers": 3, "block_c": 64},
                   {"bwd_kernel": "wgmma"}, {"bwd_kernel": "mma"}, {"exp2_fma": 4}, {"softmax_turns": False},
                   {"softmax_turns": True}, {"p_smem": True}),
    # mufu_pipe changes score-modified builds only: bench modifiers times it
    bench_sweep={"block_c": (64, 128), "consumers": (1, 2, 3), "stages": (2, 3)}))
