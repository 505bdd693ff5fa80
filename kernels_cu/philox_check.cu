// philox_check.cu: raw Philox4x32 words on the GPU, for tests/test_gpu_rng.py to compare bit for bit
// with sandbox/philox.py (and through it with the Random123 known-answer vectors).
#include "philox.cuh"

// ---- kernels

template <int ROUNDS>
__global__ void philox_fill(const uint4* __restrict__ ctr,   // [n, 4] counters
                            unsigned k0, unsigned k1,          // key
                            uint4* __restrict__ out,           // [n, 4] words
                            int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) out[t] = philox4x32<ROUNDS>(ctr[t], make_uint2(k0, k1));
}
