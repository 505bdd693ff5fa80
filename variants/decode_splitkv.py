"""decode-splitkv: split-KV decoding (Flash-Decoding) as a registered variant, kernels_cu/decode_splitkv.cu.

Seed: Flash-Decoding (split the keys, merge the splits by log-sum-exp) over the FA2 paper's online
softmax (Sec. 2.3.1, 3.1) with FA1's split-K warp partition (FA2 Sec. 3.3) and GQA heads packed into
the rows of one tile (the kernel's header says why CUDA-core dot products). The variant is the
kernel's contiguous form for the public API: a few query rows (Nq <= 16) against K and V of any
length, every batch entry with all Nk keys; causal and window bottom-right aligned as everywhere.
The paged cache, per-sequence lengths and the in-place append are sandbox.decode's, which runs the
same kernel (`decode.splitkv`) and keeps the launch code; this module adds the registration, the
compile units (every instantiation, so the compile gate covers them) and the envelope: Nq <= 16 is
the capability `max_query_rows` (the registry refuses more, and the fuzz strategy draws within it).
Forward only. Status: compile-checked on the CPU; GPU results in bench/results/<gpu>/decode.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from sandbox import arrays, decode
from sandbox.registry import Capabilities, Variant, register


# ---- config

@dataclass(frozen=True)
class DecodeConfig:
    """No parameters: the row tile and the split count follow from the problem (decode.row_tile,
    decode.plan_splits)."""


# ---- launch

class DecodeSplitKV:
    def configure(self):
        return DecodeConfig()

    def to_backend(self, x, name="array"):
        return arrays.to_device(x, name)

    def compile_units(self, config):
        return decode.compile_units()

    def tuned(self, config, unit=None):
        """Held to no spills: every unit (head dim 256's ROWS = 16 kernel spilled 16-72 bytes on sm_80
        until the transposed reduction; none on sm_80 or sm_90 since)."""
        return True

    def forward(self, p, q, k, v, config):
        decode.check_kv_alignment(k, "k")
        decode.check_kv_alignment(v, "v")
        return decode.splitkv(q, k, v, None, p.Nk, p.scale, decode.relative_band(p.causal, p.window),
                              uniform_len=p.Nk)          # every sequence has Nk keys: no lengths array


register(Variant(
    name="decode-splitkv", family="fa2", backend="cuda",
    description="split-KV decoding: keys split over the grid, GQA rows packed per K/V head, log-sum-exp merge",
    impl=DecodeSplitKV(),
    caps=Capabilities(backward=False, causal=True, window=True, block_sparse=False, dropout=False, gqa=True,
                      dtypes=tuple(decode.KERNEL_CTYPE), head_dims=decode.KERNEL_HEAD_DIMS,
                      max_query_rows=decode.KERNEL_MAX_NQ),
    seed_ref="Flash-Decoding (split-KV + log-sum-exp merge) over FA2 Sec. 2.3.1 / 3.1, FA1 split-K warps (FA2 Sec. 3.3)",
    tags=("decode",),
))
