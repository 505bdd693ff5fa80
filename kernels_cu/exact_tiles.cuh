// exact_tiles.cuh: shared pieces of the exact-tier (fp32, CUDA-core) tiled kernels: tile classes,
// row loads into padded shared memory, warp reductions, the band's tile ranges and the dropout
// pass. Included by fa1_exact.cu and fa2_exact.cu.
#pragma once
#include "common.cuh"
#include "philox.cuh"

#define TILE_EMPTY 0
#define TILE_FULL 1
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

// Column-tile range [t0, t1] that rows [r0, r1] can see under the band lo <= j - i <= hi.
__device__ __forceinline__ void band_tiles(int r0, int r1, int lo, int hi, int Nk, int BCOLS, int& t0, int& t1) {
    const long long jlo = max(0LL, (long long)r0 + lo), jhi = min((long long)Nk - 1, (long long)r1 + hi);
    t0 = (int)(jlo / BCOLS);
    t1 = jlo > jhi ? t0 - 1 : (int)(jhi / BCOLS);
}

// Row-tile range [t0, t1] that can see columns [c0, c1].
__device__ __forceinline__ void band_row_tiles(int c0, int c1, int lo, int hi, int Nq, int BROWS, int& t0, int& t1) {
    const long long ilo = max(0LL, (long long)c0 - hi), ihi = min((long long)Nq - 1, (long long)c1 - lo);
    t0 = (int)(ilo / BROWS);
    t1 = ilo > ihi ? t0 - 1 : (int)(ihi / BROWS);
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
