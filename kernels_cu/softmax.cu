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
// never reads x a third time. Rows of length 0 are not launched (the host checks).
#include "common.cuh"

#define SM_THREADS 256

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
    float* yr = y + blockIdx.x * n;
    float d = 0.0f;
    for (long long j = threadIdx.x; j < n; j += SM_THREADS) d += expf(xr[j]);
    d = block_reduce<SM_THREADS>(d, false, scratch);
    for (long long j = threadIdx.x; j < n; j += SM_THREADS) yr[j] = expf(xr[j]) / d;
}

extern "C" __global__ void __launch_bounds__(SM_THREADS)
softmax_safe(const float* __restrict__ x, float* __restrict__ y, long long n) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * n;
    float* yr = y + blockIdx.x * n;
    float m = NEG_INF;
    for (long long j = threadIdx.x; j < n; j += SM_THREADS) m = fmaxf(m, xr[j]);
    m = block_reduce<SM_THREADS>(m, true, scratch);
    float d = 0.0f;
    for (long long j = threadIdx.x; j < n; j += SM_THREADS) d += expf(xr[j] - m);
    d = block_reduce<SM_THREADS>(d, false, scratch);
    for (long long j = threadIdx.x; j < n; j += SM_THREADS) yr[j] = expf(xr[j] - m) / d;
}

extern "C" __global__ void __launch_bounds__(SM_THREADS)
softmax_online(const float* __restrict__ x, float* __restrict__ y, long long n) {
    __shared__ float sm[32], sd[32];
    const float* xr = x + blockIdx.x * n;
    float* yr = y + blockIdx.x * n;
    float m = NEG_INF, d = 0.0f;
    for (long long j = threadIdx.x; j < n; j += SM_THREADS) {    // running max and rescaled sum
        const float v = xr[j];
        if (v > m) { d = d * expf(m - v) + 1.0f; m = v; }
        else d += expf(v - m);
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
    for (long long j = threadIdx.x; j < n; j += SM_THREADS) yr[j] = expf(xr[j] - m) / d;
}
