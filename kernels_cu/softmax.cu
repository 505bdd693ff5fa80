// softmax.cu: row-wise softmax over a batch of fp32 vectors, three ways (lecture 003, Algorithms
// 1-3), one thread block per row.
//
//   softmax_naive   Algorithm 1: d = sum_j exp(x_j); y_j = exp(x_j) / d. Two passes over x; exp
//                   overflows once x_j > ~88 (inf / inf = NaN): the reason for the next two.
//   softmax_safe    Algorithm 2: m = max_j x_j; d = sum_j exp(x_j - m); y_j = exp(x_j - m) / d.
//                   Three passes over x.
//   softmax_online  Algorithm 3: one pass keeps the running max m and the running sum d, rescaled
//                   by exp(m_old - m_new) when the max grows; a second pass writes y. Two passes:
//                   the lecture's 1.3x over the safe version comes from the memory traffic saved.
// The (m, d) pairs of the threads are merged with the same rescaling rule, so the online kernel
// never reads x a third time. Every pass reads UNROLL independent elements per thread per step
// (memory-level parallelism, and one rescale per step in the online loop instead of one per
// element; the per-element recurrence was latency-bound: 0.6x the safe kernel at n = 1k on the
// H200). Rows of length 0 are not launched (the host checks).
#include "common.cuh"

#define SM_THREADS 256
#define UNROLL 4
#define STEP (UNROLL * SM_THREADS)

// v[k] = x[j0 + k * SM_THREADS], -inf past the end of the row (exp(-inf) = 0 adds nothing)
__device__ __forceinline__ void load_step(const float* __restrict__ xr, long long j0, long long n, float (&v)[UNROLL]) {
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
        const long long j = j0 + k * SM_THREADS;
        v[k] = j < n ? __ldg(xr + j) : NEG_INF;
    }
}

// y = exp(x - m) * inv_d over the row (m = 0 for the naive kernel)
__device__ __forceinline__ void write_pass(const float* __restrict__ xr, float* __restrict__ yr, long long n,
                                           float m, float inv_d) {
    for (long long j0 = threadIdx.x; j0 < n; j0 += STEP) {
        float v[UNROLL];
        load_step(xr, j0, n, v);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const long long j = j0 + k * SM_THREADS;
            if (j < n) yr[j] = expf(v[k] - m) * inv_d;
        }
    }
}

__device__ __forceinline__ void online_merge(float& m, float& d, float m2, float d2) {
    const float mn = fmaxf(m, m2);
    if (mn == NEG_INF) return;                       // both empty
    d = d * expf(m - mn) + d2 * expf(m2 - mn);
    m = mn;
}

extern "C" __global__ void __launch_bounds__(SM_THREADS)
softmax_naive(const float* __restrict__ x, float* __restrict__ y, long long n) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * n;
    float d = 0.0f;
    for (long long j0 = threadIdx.x; j0 < n; j0 += STEP) {       // pass 1: d = sum exp(x)
        float v[UNROLL];
        load_step(xr, j0, n, v);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) d += expf(v[k]);
    }
    d = block_reduce<SM_THREADS>(d, false, scratch);
    write_pass(xr, y + blockIdx.x * n, n, 0.0f, 1.0f / d);        // pass 2
}

extern "C" __global__ void __launch_bounds__(SM_THREADS)
softmax_safe(const float* __restrict__ x, float* __restrict__ y, long long n) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * n;
    float m = NEG_INF;
    for (long long j0 = threadIdx.x; j0 < n; j0 += STEP) {       // pass 1: m = max x
        float v[UNROLL];
        load_step(xr, j0, n, v);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) m = fmaxf(m, v[k]);
    }
    m = block_reduce<SM_THREADS>(m, true, scratch);
    float d = 0.0f;
    for (long long j0 = threadIdx.x; j0 < n; j0 += STEP) {       // pass 2: d = sum exp(x - m)
        float v[UNROLL];
        load_step(xr, j0, n, v);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) d += expf(v[k] - m);
    }
    d = block_reduce<SM_THREADS>(d, false, scratch);
    write_pass(xr, y + blockIdx.x * n, n, m, 1.0f / d);           // pass 3
}

extern "C" __global__ void __launch_bounds__(SM_THREADS)
softmax_online(const float* __restrict__ x, float* __restrict__ y, long long n) {
    __shared__ float sm[32], sd[32];
    const float* xr = x + blockIdx.x * n;
    float m = NEG_INF, d = 0.0f;
    for (long long j0 = threadIdx.x; j0 < n; j0 += STEP) {       // pass 1: running max and rescaled sum
        float v[UNROLL];
        load_step(xr, j0, n, v);
        float mc = v[0];
#pragma unroll
        for (int k = 1; k < UNROLL; ++k) mc = fmaxf(mc, v[k]);
        const float mn = fmaxf(m, mc);
        if (mn == NEG_INF) continue;                               // nothing seen yet
        float add = 0.0f;
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) add += expf(v[k] - mn);
        d = d * expf(m - mn) + add;                                // exp(-inf) = 0 on the first step
        m = mn;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), d2 = __shfl_xor_sync(0xffffffffu, d, o);
        online_merge(m, d, m2, d2);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { sm[warp] = m; sd[warp] = d; }
    __syncthreads();
    m = lane < SM_THREADS / 32 ? sm[lane] : NEG_INF;
    d = lane < SM_THREADS / 32 ? sd[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), d2 = __shfl_xor_sync(0xffffffffu, d, o);
        online_merge(m, d, m2, d2);
    }
    write_pass(xr, y + blockIdx.x * n, n, m, 1.0f / d);           // pass 2
}
