// exact_tiles.cuh: shared pieces of the exact-tier (fp32, CUDA-core) tiled kernels: row loads into
// padded shared memory, warp reductions and the dropout pass (tile classes and band ranges:
// tiles.cuh). Included by fa1_exact.cu and fa2_exact.cu.
#pragma once
#include "common.cuh"
#include "philox.cuh"
#include "tiles.cuh"

#define PAD 4          // row padding (floats): keeps float4 rows 16-byte aligned and spreads banks
// Occupancy target: 256 threads per SM, i.e. 2 blocks of 4 warps or 1 of 8, leaving 255 registers
// a thread. Without it NVRTC 13.0 aimed at 3 blocks of 128 threads (168 registers) and spilled the
// forward's accumulators (seen on the GPU image).
#define MIN_BLOCKS (WARPS <= 4 ? 2 : 1)

// ---- device helpers

// rows [row0, row0 + ROWS) of a [N, d] matrix (row stride srow, unit stride along d) into
// dst[ROWS][D + PAD], zero-filling rows >= N and columns >= d.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_rows(float* dst, const float* __restrict__ src, long long srow,
                                          int row0, int N, int d) {
    for (int e = threadIdx.x; e < ROWS * D; e += THREADS) {
        const int r = e / D, c = e % D;
        dst[r * (D + PAD) + c] = (row0 + r < N && c < d) ? src[(long long)(row0 + r) * srow + c] : 0.0f;
    }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

// Dropout is applied in a separate, deliberately non-unrolled pass over a tile already in shared
// memory. Inlined into the unrolled register loops, 32 Philox copies kept those loops from
// unrolling and m, l, acc went to local memory; called out of line, the call saved registers to
// the stack (both seen in the compile report as spills).
template <int R>
__device__ __forceinline__ float keep_scale(const Dropout& drop, int bh, int i, int j) {
    const uint4 w = dropout_words<R>(drop, bh, i, j >> 2);
    return dropout_factor(drop, word_of(w, j & 3));
}

// The dropout axis "packed" (vs "replay", the contract's default): the forward stores the keep
// mask bit-packed, bits[(bh * Nq + i) * words + j / 32] bit j % 32, and the backward reads it
// instead of running Philox again. Costs Nq * Nk / 8 bytes per head of HBM; saves the backward's
// Philox. The forward writes one 32-bit word per warp-row with a ballot (32 consecutive keys).
#define PACKED_PARAMS unsigned* __restrict__ drop_bits, int drop_words, int drop_packed
#define PACKED_FROM_PARAMS PackedMask{drop_bits, drop_words, drop_packed}
#define PACKED_ARGS drop_bits, drop_words, drop_packed

struct PackedMask {
    unsigned* bits;
    int words;                  // ceil(Nk / 32)
    int packed;                 // 0: replay from (seed, offset); 1: store (forward) / read (backward)

    __device__ __forceinline__ float read(const Dropout& drop, int bh, int Nq, int i, int j) const {
        const unsigned w = bits[((long long)bh * Nq + i) * words + (j >> 5)];
        return (w >> (j & 31)) & 1u ? drop.inv_keep : 0.0f;
    }
};

// Keep factor of (i, j) in the backward: replayed or read from the stored mask.
template <int R>
__device__ __forceinline__ float keep_scale_bwd(const Dropout& drop, const PackedMask& pm, int bh, int Nq, int i, int j) {
    return pm.packed ? pm.read(drop, bh, Nq, i, j) : keep_scale<R>(drop, bh, i, j);
}

// Forward dropout of one element held by a lane, j = jw + lane: scales *pp by the keep factor and,
// when packing, the warp stores the 32 keep bits of keys jw .. jw + 31 (every lane must call).
template <int R>
__device__ __forceinline__ void dropout_fwd(float* pp, const Dropout& drop, const PackedMask& pm, int bh,
                                            int Nq, int Nk, int i, int jw, int lane) {
    const int j = jw + lane;
    const bool live = *pp != 0.0f;
    const float z = (live || pm.packed) ? keep_scale<R>(drop, bh, i, j) : 0.0f;
    if (live) *pp *= z;
    if (pm.packed) {
        const unsigned word = __ballot_sync(0xffffffffu, z != 0.0f);
        if (lane == 0 && i < Nq && jw < Nk) pm.bits[((long long)bh * Nq + i) * pm.words + (jw >> 5)] = word;
    }
}
