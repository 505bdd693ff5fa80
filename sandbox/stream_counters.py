"""Per-stream device counters that the kernels leave at zero, so that no launch needs a memset.

Two kernels count in global memory: the fused decode merge (one arrival counter per sequence and
row tile: the last block of a tile merges the splits) and the persistent Hopper forward (one item
counter: blocks claim (Q tile, batch, head) items from it). Each launch's last user of a counter
resets it to zero: the decode tile's merging block, the forward's last claim. One buffer of such
counters is kept per (device, stream): launches on one stream run in order, so they never share a
counter while it counts, and any kernel may use the buffer's first n entries; launches on two
streams use two buffers. `cudaStreamPerThread` is one handle for a different stream per host
thread, so there the host thread is part of the key.

A buffer is allocated and zeroed on the stream that counts in it (the torch fast path passes
torch's stream, which need not be CuPy's current one), so its memset is ordered before the first
launch there. A stream being captured into a CUDA graph gets a fresh zeroed buffer per call instead:
the memset becomes part of the graph, and the graph's replays, wherever they run, share no counter
with direct calls. A dropped buffer (grown, or the least recently used of COUNTER_STREAMS streams)
returns to the stream-ordered pool of the stream it was allocated on (CuPy's pool, or torch's where
the caller's path routes CuPy's allocations to torch: sandbox/arrays.py), so no other stream reuses
it while a launch may still count in it. The table is guarded by a lock (host threads may launch at
once). Keys are stream handles: a stream destroyed while a launch still counts and a new stream that
reuses its handle would share a buffer (streams are not destroyed with work in flight in practice).
"""
from __future__ import annotations

import collections
import threading

_COUNTERS: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()
COUNTER_STREAMS = 64
MIN_COUNTERS = 1024
_CUDA_STREAM_PER_THREAD = 2           # cudaStreamPerThread: one handle, a different stream per host thread


def capturing(stream) -> bool:
    """Whether `stream` is being captured into a CUDA graph (True where that cannot be read: fresh zeros are
    always correct)."""
    if stream.ptr in (0, 1):          # the legacy stream cannot be captured
        return False
    try:
        return bool(stream.is_capturing())
    except Exception:                 # unknown: the always-correct fresh buffer
        return True


def zeroed(xp, n: int, stream=None):
    """A device uint32 array of at least n zeros for one launch on `stream` (default: CuPy's current
    stream), which the launch must leave at zero."""
    if stream is None:
        stream = xp.cuda.get_current_stream()
    if capturing(stream):
        return _zeros_on(xp, n, stream)
    key = (xp.cuda.runtime.getDevice(), stream.ptr,
           threading.get_ident() if stream.ptr == _CUDA_STREAM_PER_THREAD else None)
    with _LOCK:
        buf = _COUNTERS.get(key)
        if buf is None or buf.size < n:
            buf = _COUNTERS[key] = _zeros_on(xp, max(n, MIN_COUNTERS, 2 * (0 if buf is None else buf.size)), stream)
        _COUNTERS.move_to_end(key)
        while len(_COUNTERS) > COUNTER_STREAMS:
            _COUNTERS.popitem(last=False)
    return buf


def _zeros_on(xp, n: int, stream):
    """n uint32 zeros allocated and set on `stream` (its memset ordered before the launches there)."""
    if stream.ptr == xp.cuda.get_current_stream().ptr:
        return xp.zeros(n, dtype=xp.uint32)
    with stream:
        return xp.zeros(n, dtype=xp.uint32)


def of_stream(stream) -> list:
    """The buffers kept for `stream` (tests: they must be all zeros between launches)."""
    return [buf for (_, ptr, _), buf in _COUNTERS.items() if ptr == stream.ptr]
