// common.cuh: element types, visibility masks and reductions shared by every attention kernel.
//
// Masks (docs/ARCHITECTURE.md "Masks"): causal and window arrive folded into one band, visible iff
// lo <= j - i <= hi (bottom-right aligned on the host); block-sparse layouts arrive either as
// the element layout (standard attention) or as a per-tile class table (tiled kernels).
#pragma once
#include <cuda_fp16.h>

#define NEG_INF (-__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f      // exp(x) = exp2(x * LOG2E)

// ---- device helpers

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Element visibility: band (causal + window) AND an optional block-sparse layout.
struct Mask {
    int lo, hi;                         // visible iff lo <= j - i <= hi
    const unsigned char* layout;        // [Hm, nbq, nbk]; unread when layout_heads == 0
    int layout_heads;                   // Hm: 0 (no block-sparse mask), 1 (shared) or H (per query head)
    int bq, bk, nbq, nbk;               // mask block size and layout extent

    __device__ __forceinline__ bool visible(int h, int i, int j) const {
        const int d = j - i;
        if (d < lo || d > hi) return false;
        if (layout_heads == 0) return true;
        const int hm = layout_heads == 1 ? 0 : h;
        return layout[((long long)hm * nbq + i / bq) * nbk + j / bk] != 0;
    }
};

// Kernel arguments that carry a Mask and a Dropout (CuPy passes scalars, not structs).
#define MASK_PARAMS int band_lo, int band_hi, const unsigned char* layout, int layout_heads, \
                    int mask_bq, int mask_bk, int mask_nbq, int mask_nbk
#define MASK_FROM_PARAMS Mask{band_lo, band_hi, layout, layout_heads, mask_bq, mask_bk, mask_nbq, mask_nbk}
#define DROPOUT_PARAMS unsigned drop_threshold, float drop_inv_keep, unsigned long long drop_seed, \
                       unsigned drop_offset
#define DROPOUT_FROM_PARAMS Dropout{drop_threshold, drop_inv_keep, drop_seed, drop_offset}

template <int THREADS>
__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();                    // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? scratch[lane] : (is_max ? NEG_INF : 0.0f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    return v;
}
