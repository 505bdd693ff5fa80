"""The per-stream zeroed counters (sandbox/stream_counters.py) that decode's fused merge and the
persistent Hopper forward count in: kept per (device, stream), grown, fresh under graph capture.
Their zero-between-launches contract is checked on the GPU in test_decode_gpu.py and test_hopper.py."""
import numpy as np

from sandbox import stream_counters


def _fake_cupy(streams):
    """Enough of CuPy for stream_counters.zeroed: the current stream (ptr, is_capturing), the device and
    zeros (recorded)."""
    from types import SimpleNamespace
    made = []

    def zeros(n, dtype):
        made.append(n)
        return np.zeros(n, dtype)
    cuda = SimpleNamespace(get_current_stream=lambda: streams[0], runtime=SimpleNamespace(getDevice=lambda: 0))
    return SimpleNamespace(uint32=np.uint32, zeros=zeros, cuda=cuda), made


class _Stream:
    def __init__(self, ptr, capturing=False):
        self.ptr, self.capturing, self.entered = ptr, capturing, 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        return False

    def is_capturing(self):
        if self.capturing is None:
            raise RuntimeError("cannot tell")
        return self.capturing


def test_counters_per_stream_grown_and_fresh_under_capture(monkeypatch):
    """One zeroed buffer per (device, stream), reused by later launches on that stream and grown when
    a launch has more tiles; another stream gets its own; a capturing stream (or one whose state
    cannot be read) gets a fresh zeroed buffer per call, kept nowhere; at most COUNTER_STREAMS kept."""
    import collections
    import threading
    monkeypatch.setattr(stream_counters, "_COUNTERS", collections.OrderedDict())
    cur = [_Stream(1000)]
    xp, made = _fake_cupy(cur)
    a = stream_counters.zeroed(xp, 10)
    assert stream_counters.zeroed(xp, 500) is a and a.size >= 1024 and made == [1024] and a.dtype == np.uint32
    big = stream_counters.zeroed(xp, 3000)
    assert big is not a and big.size >= 3000 and stream_counters.zeroed(xp, 3000) is big
    cur[0] = _Stream(2000)
    assert stream_counters.zeroed(xp, 10) is not big
    for state in (True, None):
        cur[0] = _Stream(3000, capturing=state)
        n = len(stream_counters._COUNTERS)
        assert stream_counters.zeroed(xp, 10) is not stream_counters.zeroed(xp, 10) and len(stream_counters._COUNTERS) == n
    cur[0] = _Stream(0, capturing=None)                 # the legacy stream: never queried, never capturing
    assert stream_counters.zeroed(xp, 10) is stream_counters.zeroed(xp, 10)
    cur[0] = _Stream(stream_counters._CUDA_STREAM_PER_THREAD)     # one handle, a stream per host thread
    mine, theirs = stream_counters.zeroed(xp, 10), []
    t = threading.Thread(target=lambda: theirs.append(stream_counters.zeroed(xp, 10)))
    t.start()
    t.join()
    assert theirs[0] is not mine and stream_counters.zeroed(xp, 10) is mine
    for ptr in range(stream_counters.COUNTER_STREAMS + 5):
        cur[0] = _Stream(10_000 + ptr)
        stream_counters.zeroed(xp, 4)
    assert len(stream_counters._COUNTERS) == stream_counters.COUNTER_STREAMS


def test_a_stream_that_is_not_current_gets_its_buffer_zeroed_on_itself(monkeypatch):
    """The torch fast path passes torch's stream, which need not be CuPy's current one: the buffer is allocated
    and zeroed with that stream entered (its memset ordered before the launches that count in it), the current
    stream untouched; a capturing one gets fresh zeros the same way."""
    import collections
    monkeypatch.setattr(stream_counters, "_COUNTERS", collections.OrderedDict())
    cur = [_Stream(1000)]
    xp, made = _fake_cupy(cur)
    side = _Stream(5000)
    a = stream_counters.zeroed(xp, 10, side)
    assert side.entered == 1 and cur[0].entered == 0 and made == [1024]
    assert stream_counters.zeroed(xp, 10, side) is a and side.entered == 1      # kept: no new allocation
    assert stream_counters.of_stream(side) == [a] and stream_counters.of_stream(cur[0]) == []
    grab = _Stream(6000, capturing=True)
    stream_counters.zeroed(xp, 10, grab)
    assert grab.entered == 1 and stream_counters.of_stream(grab) == []
