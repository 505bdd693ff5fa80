// mufu_rate.cu: the MUFU (special-function unit) rate that the soft-capped softmax body sustains with a given number of
// warps per SM sub-partition; bench/mufu_rate.py launches it, one block an SM, 1-4 warps per sub-partition.
//
// Seed: FA3 paper (Shah et al. 2024) Sec. 3 (the H100's exponentials run on a unit with a small fraction of the
// tensor cores' throughput, which is why FA3 overlaps the softmax with the GEMMs) and the soft-cap of issue 18, whose
// forward adds a MUFU.TANH per score to the softmax's MUFU.EX2. What it measured (session 22,
// bench/results/h100/2026-11-27-session-22.md): one warp per sub-partition drives the MUFU at ~68% of its peak, two
// at ~95%, whatever the source order, which bounds fa3's soft-capped forward at d = 64 (README, "What the modifiers
// cost now").
//
// Kernel
//   mufu_body<MODE>   grid (SMs), 128 W threads: every thread holds 64 scores in registers and, ITERS times, takes
//                     the two rows' raw max (32 FMNMX, two quad shuffles each) and then, per score:
//       MODE 0   p = exp2(s a - m), the row sums (plain softmax: one MUFU op a score)
//       MODE 1   t = tanh(s c), p = exp2(t a - m), the row sums (the soft-cap: two MUFU ops a score)
//       MODE 2   MODE 1 with every tanh of the tile issued first, then the exponentials and sums
//       MODE 3   MODE 2 with the row sums after every exponential
//   and adds p back into its score, so that each iteration depends on the last. out[thread] = the sums and scores
//   (nothing is optimised away); the values are not checked, only the time.

template <int MODE>
__global__ void mufu_body(float* __restrict__ out, int iters, float c, float a) {
    float x[64];
#pragma unroll
    for (int k = 0; k < 64; ++k) x[k] = (float)((threadIdx.x * 7 + k * 13) % 97) * 0.01f;
    float l0 = 0.0f, l1 = 0.0f;
    for (int it = 0; it < iters; ++it) {
        float m0 = -1e30f, m1 = -1e30f;
#pragma unroll
        for (int k = 0; k < 64; k += 2) {
            m0 = fmaxf(m0, x[k]);
            m1 = fmaxf(m1, x[k + 1]);
        }
        m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
        m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
        m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
        m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
        float s0 = 0.0f, s1 = 0.0f;
        if constexpr (MODE >= 2) {
            float t[64], p[64];
#pragma unroll
            for (int k = 0; k < 64; ++k) asm("tanh.approx.f32 %0, %1;" : "=f"(t[k]) : "f"(x[k] * c));
#pragma unroll
            for (int k = 0; k < 64; ++k) {
                asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(p[k]) : "f"(fmaf(t[k], a, -(k & 1 ? m1 : m0))));
                if (MODE == 2) (k & 1 ? s1 : s0) += p[k];
            }
#pragma unroll
            for (int k = 0; k < 64; ++k) {
                if (MODE == 3) (k & 1 ? s1 : s0) += p[k];
                x[k] += p[k];
            }
        } else {
#pragma unroll
            for (int k = 0; k < 64; ++k) {
                float t = x[k] * c, p;
                if (MODE == 1) asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(t));
                asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(p) : "f"(fmaf(t, a, -(k & 1 ? m1 : m0))));
                (k & 1 ? s1 : s0) += p;
                x[k] += p;
            }
        }
        l0 += s0;
        l1 += s1;
    }
    float r = l0 + l1;
#pragma unroll
    for (int k = 0; k < 64; ++k) r += x[k];
    out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}
