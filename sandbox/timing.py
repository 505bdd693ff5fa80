"""Timing method (used by `python -m sandbox run` and bench/):

- GPU: CUDA events around each call on the current stream; `warmup` untimed calls first (the first
  includes the NVRTC/Numba compile); between repetitions the L2 cache is flushed by writing a
  buffer twice its size (outside the timed region); then a spin kernel keeps the GPU busy while
  the host runs ahead to record the start event and enqueue the call, so Python-side overhead
  (validation, allocation, launch) is hidden and the events bracket GPU work only. The spin lasts
  `spin_us` or 1.5x the host time of the last warm-up call plus 100 us, whichever is longer (a
  fixed 300 us spin let 0.9 ms of host work into block-sparse timings, measured 2026-11-22); the
  median of `reps` is reported with the 10th and 90th percentiles.
- Simulator (no GPU): wall-clock of the Python simulation, reported as such; not a GPU figure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .device import cupy_or_none


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    clock: str          # "cuda-events" or "wall (simulator)"


def _l2_flusher(cp):
    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]
    buf = cp.empty(max(2 * int(l2), 1 << 20), dtype=cp.uint8)
    return lambda: buf.fill(0)


_SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}"""


def _spinner(cp, spin_us):
    kernel = cp.RawKernel(_SPIN_SRC, "spin")
    rate_khz = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"]
    cycles = np.int64(spin_us * rate_khz / 1e3)
    return lambda: kernel((1,), (1,), (cycles,))


def time_fn(fn, warmup: int = 3, reps: int = 20, flush_l2: bool = True, spin_us: float = 300.0) -> Timing:
    cp = cupy_or_none()
    if cp is None:
        fn()
        samples = []
        for _ in range(max(1, reps // 4)):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return _summary(samples, "wall (simulator)")
    flush = _l2_flusher(cp) if flush_l2 else (lambda: None)
    host_s = 0.0
    for _ in range(max(1, warmup)):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        host_s = time.perf_counter() - t0      # enqueue time of one call (the GPU was idle before it)
        cp.cuda.Device().synchronize()
    spin_us = max(spin_us, 1.5 * host_s * 1e6 + 100.0) if spin_us > 0 else 0.0
    spin = _spinner(cp, min(spin_us, 50_000.0)) if spin_us > 0 else (lambda: None)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(reps):
        flush()
        spin()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop))
    return _summary(samples, "cuda-events")


def _summary(samples, clock):
    s = np.asarray(samples)
    return Timing(float(np.median(s)), float(np.percentile(s, 10)), float(np.percentile(s, 90)), len(s), clock)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
