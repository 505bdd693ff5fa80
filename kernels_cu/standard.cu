// standard.cu: standard attention, FA1 paper Algorithm 0 (and its backward, FA1 paper Sec. 2.2 /
// the "standard attention backward pass" of the FA1 appendix): S = scale * Q K^T written to HBM,
// P = softmax(mask(S)) written to HBM, O = P V. Every intermediate makes a round trip through HBM;
// this is the baseline every FlashAttention variant is measured against.
//
// Precision: inputs T (float or __half); S, P, dP, dS stored in T (as a naive implementation in
// that precision stores them); every GEMM accumulates in fp32; lse in fp32.
//
// Kernels
//   standard_gemm<TA,TB,TC>      C = alpha * sum_g A_g B_g, strided batched, group-summed (GQA dK/dV)
//   standard_softmax<T,R>        row softmax of S in place -> dropped-out P, and lse       (forward)
//   standard_probs<T,R>          P_drop = mask(exp(S - lse)) * Z / (1 - p)               (backward)
//   standard_rowdot<T>           D = rowsum(dO * O)                                       (backward)
//   standard_dscores<T,R>        dS = P * (dP_drop * Z / (1 - p) - D), in place over dP_drop (backward)
// Status: correct against the oracle (tests/test_gpu_variants.py); speed in bench/results/.
#include "common.cuh"
#include "philox.cuh"

#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 16
#define GEMM_THREADS 256      // 16 x 16 threads, 4 x 4 outputs each
#define ROW_THREADS 256

// ---- kernels

// C[z, m, n] = alpha * sum_{g < G} sum_{k < K} A(z, g)[m, k] * B(z, g)[k, n], z = b * H + h.
// Each operand is addressed through element strides (batch, head, row, col), so transposes and any
// caller strides cost nothing; operand X of output head h reads head (h * X_hmul + g) / X_hdiv.
template <typename TA, typename TB, typename TC>
__global__ void __launch_bounds__(GEMM_THREADS)
standard_gemm(const TA* __restrict__ A, long long a_sb, long long a_sh, long long a_sm, long long a_sk,
              int a_hmul, int a_hdiv,                        // A(z, g): [M, K]
              const TB* __restrict__ Bm, long long b_sb, long long b_sh, long long b_sk, long long b_sn,
              int b_hmul, int b_hdiv,                        // B(z, g): [K, N]
              TC* __restrict__ C, long long c_sb, long long c_sh, long long c_sm, long long c_sn,  // [B, H, M, N]
              int H, int M, int N, int K, int G, float alpha) {
    __shared__ float As[GEMM_BK][GEMM_BM + 1];
    __shared__ float Bs[GEMM_BK][GEMM_BN + 1];
    const int z = blockIdx.z, b = z / H, h = z % H;
    const int m0 = blockIdx.y * GEMM_BM, n0 = blockIdx.x * GEMM_BN;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {};
    for (int g = 0; g < G; ++g) {
        const TA* Ag = A + b * a_sb + (long long)((h * a_hmul + g) / a_hdiv) * a_sh;
        const TB* Bg = Bm + b * b_sb + (long long)((h * b_hmul + g) / b_hdiv) * b_sh;
        for (int k0 = 0; k0 < K; k0 += GEMM_BK) {
            for (int e = threadIdx.x; e < GEMM_BK * GEMM_BM; e += GEMM_THREADS) {
                const int kk = e / GEMM_BM, mm = e % GEMM_BM;
                const int m = m0 + mm, k = k0 + kk;
                As[kk][mm] = (m < M && k < K) ? to_float(Ag[m * a_sm + k * a_sk]) : 0.0f;
            }
            for (int e = threadIdx.x; e < GEMM_BK * GEMM_BN; e += GEMM_THREADS) {
                const int kk = e / GEMM_BN, nn = e % GEMM_BN;
                const int n = n0 + nn, k = k0 + kk;
                Bs[kk][nn] = (n < N && k < K) ? to_float(Bg[k * b_sk + n * b_sn]) : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < GEMM_BK; ++kk) {
                float a[4], bv[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) a[r] = As[kk][ty + 16 * r];
#pragma unroll
                for (int c = 0; c < 4; ++c) bv[c] = Bs[kk][tx + 16 * c];
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(a[r], bv[c], acc[r][c]);
            }
            __syncthreads();
        }
    }
    TC* Cz = C + b * c_sb + h * c_sh;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int m = m0 + ty + 16 * r, n = n0 + tx + 16 * c;
            if (m < M && n < N) Cz[m * c_sm + n * c_sn] = from_float<TC>(alpha * acc[r][c]);
        }
}

// One block per row (b, h, i) of S [B, H, Nq, Nk] (contiguous). In place: S -> P * Z / (1 - p).
// A row that sees no key gets P = 0 and lse = -inf.
template <typename T, int ROUNDS>
__global__ void __launch_bounds__(ROW_THREADS)
standard_softmax(T* __restrict__ S,              // [B, H, Nq, Nk] in: scores, out: dropped-out P
                 float* __restrict__ lse,        // [B, H, Nq]
                 int H, int Nq, int Nk, MASK_PARAMS, DROPOUT_PARAMS) {
    __shared__ float scratch[32];
    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const long long row = blockIdx.x;
    const int bh = (int)(row / Nq), i = (int)(row % Nq), h = bh % H;
    T* s = S + row * Nk;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < Nk; j += ROW_THREADS)
        if (mask.visible(h, i, j)) m = fmaxf(m, to_float(s[j]));
    m = block_reduce<ROW_THREADS>(m, true, scratch);
    const float m_safe = m == NEG_INF ? 0.0f : m;
    float l = 0.0f;
    for (int j = threadIdx.x; j < Nk; j += ROW_THREADS)
        if (mask.visible(h, i, j)) l += expf(to_float(s[j]) - m_safe);
    l = block_reduce<ROW_THREADS>(l, false, scratch);
    const float inv_l = l == 0.0f ? 0.0f : 1.0f / l;          // NaN is not a dead row: only an exactly zero sum is
    if (threadIdx.x == 0) lse[row] = l == 0.0f ? NEG_INF : m_safe + logf(l);
    for (int j4 = threadIdx.x; 4 * j4 < Nk; j4 += ROW_THREADS) {
        const uint4 w = drop.threshold ? dropout_words<ROUNDS>(drop, bh, i, j4) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int j = 4 * j4 + t;
            if (j >= Nk) break;
            const float p = mask.visible(h, i, j) ? expf(to_float(s[j]) - m_safe) * inv_l : 0.0f;
            s[j] = from_float<T>(p * dropout_factor(drop, word_of(w, t)));
        }
    }
}

// Backward: recompute P from S and lse (elementwise), apply the replayed dropout mask.
template <typename T, int ROUNDS>
__global__ void __launch_bounds__(ROW_THREADS)
standard_probs(const T* __restrict__ S,          // [B, H, Nq, Nk]
               const float* __restrict__ lse,    // [B, H, Nq]
               T* __restrict__ P,                // [B, H, Nq, Nk] out: P * Z / (1 - p)
               int H, int Nq, int Nk, MASK_PARAMS, DROPOUT_PARAMS) {
    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const long long row = blockIdx.x;
    const int bh = (int)(row / Nq), i = (int)(row % Nq), h = bh % H;
    const float L = lse[row];
    for (int j4 = threadIdx.x; 4 * j4 < Nk; j4 += ROW_THREADS) {
        const uint4 w = drop.threshold ? dropout_words<ROUNDS>(drop, bh, i, j4) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int j = 4 * j4 + t;
            if (j >= Nk) break;
            const float p = (L != NEG_INF && mask.visible(h, i, j)) ? expf(to_float(S[row * Nk + j]) - L) : 0.0f;
            P[row * Nk + j] = from_float<T>(p * dropout_factor(drop, word_of(w, t)));
        }
    }
}

// D[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]; one warp per row.
template <typename T>
__global__ void standard_rowdot(const T* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm,  // [B, H, Nq, d]
                                const T* __restrict__ O, long long o_sb, long long o_sh, long long o_sm,      // [B, H, Nq, d]
                                float* __restrict__ D,    // [B, H, Nq]
                                int H, int Nq, int d, int rows) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int b = row / (H * Nq), h = (row / Nq) % H, i = row % Nq;
    const T* a = dO + b * do_sb + h * do_sh + i * do_sm;
    const T* o = O + b * o_sb + h * o_sh + i * o_sm;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) acc += to_float(a[c]) * to_float(o[c]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) D[row] = acc;
}

// dS = P * (dP_drop * Z / (1 - p) - D), written over dP_drop.
template <typename T, int ROUNDS>
__global__ void __launch_bounds__(ROW_THREADS)
standard_dscores(const T* __restrict__ S,        // [B, H, Nq, Nk]
                 const float* __restrict__ lse,  // [B, H, Nq]
                 const float* __restrict__ D,    // [B, H, Nq]
                 T* __restrict__ dP,             // [B, H, Nq, Nk] in: dP_drop = dO V^T, out: dS
                 int H, int Nq, int Nk, MASK_PARAMS, DROPOUT_PARAMS) {
    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const long long row = blockIdx.x;
    const int bh = (int)(row / Nq), i = (int)(row % Nq), h = bh % H;
    const float L = lse[row], Di = D[row];
    for (int j4 = threadIdx.x; 4 * j4 < Nk; j4 += ROW_THREADS) {
        const uint4 w = drop.threshold ? dropout_words<ROUNDS>(drop, bh, i, j4) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int j = 4 * j4 + t;
            if (j >= Nk) break;
            const long long e = row * Nk + j;
            const float p = (L != NEG_INF && mask.visible(h, i, j)) ? expf(to_float(S[e]) - L) : 0.0f;
            const float dp = to_float(dP[e]) * dropout_factor(drop, word_of(w, t));
            dP[e] = from_float<T>(p * (dp - Di));
        }
    }
}
