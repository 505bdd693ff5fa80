// tc_gemm.cuh: the swizzled-tile machinery of the tensor-core rungs from fa2_tc.cu on: cp.async
// copies of Q / K / V tiles into XOR-swizzled shared memory, the ldmatrix base addresses of a lane,
// and the two GEMMs of a K/V tile on mma.m16n8k16 fragments (S = Q K^T; O += P V with P taken from
// the S registers). Shared by fa2_tc.cu and fa1_tc.cu.
#pragma once
#include "mma.cuh"
#include "tc_softmax.cuh"

// ---- device helpers

// Rows [row0, row0 + ROWS) of a [N, d] 16-bit matrix (row stride srow, unit stride along d) into a
// swizzled [ROWS][D] tile, asynchronously; rows >= N and 16-byte chunks >= d / 8 are zero-filled.
// A thread copies one chunk column c of every (THREADS / CH)-th row: one running global pointer and
// compile-time shared offsets (r % 8, so the swizzle, is the same in every step), rather than a
// 64-bit address per step that the compiler would hoist out of the tile loop and keep live.
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile_async(T* dst, const T* __restrict__ src, long long srow,
                                                int row0, int N, int dchunks) {
    constexpr int CH = D / 8, STEP = THREADS / CH;
    static_assert(THREADS % CH == 0 && STEP % 8 == 0, "each thread keeps one chunk column and row % 8");
    const int c = threadIdx.x % CH, r = threadIdx.x / CH;
    const bool col_in = c < dchunks;
    const T* g = src + (long long)(row0 + r) * srow + c * 8;
    const unsigned s = smem_addr(dst + swizzle<D>(r, c));
#pragma unroll
    for (int it = 0; it < (ROWS + STEP - 1) / STEP; ++it) {
        if (ROWS % STEP != 0 && r + it * STEP >= ROWS) break;
        const bool in = col_in && row0 + r + it * STEP < N;
        cp_async_16(s + it * STEP * D * 2, in ? g : src, in ? 16 : 0);
        g += STEP * srow;
    }
}

// ldmatrix row addresses (bytes, shared window) of this lane for the Q rows from `wrow`, K and V.
// A lane's swizzled chunk for k-step kk is (2 kk + c) ^ (row % 8) = 2 kk ^ (c ^ row % 8) with c in
// {0, 1}, and rows are multiples of 128 bytes, so every k-step's address is the lane's base XOR
// (kk << 5): one register per operand, not one per (k-step, tile) as the compiler hoisted from
// swizzle<D>() (seen: 243 registers).
struct TileBases {
    unsigned q, k, v;
};
template <typename T, int D>
__device__ __forceinline__ TileBases tile_bases(const T* sQ, const T* sK, const T* sV, int wrow, int lane) {
    constexpr int ROWB = D * 2;
    const int r7 = lane & 7;
    return {smem_addr(sQ) + (wrow + lane % 16) * ROWB + (((lane / 16) ^ r7) << 4),
            smem_addr(sK) + ((lane / 16) * 8 + r7) * ROWB + ((((lane / 8) & 1) ^ r7) << 4),
            smem_addr(sV) + (((lane / 8) & 1) * 8 + r7) * ROWB + (((lane / 16) ^ r7) << 4)};
}

// s = Q K^T for this warp's 16 MT rows and the tile's 8 NT keys (fp32, overwritten), or with SEEDED
// s += Q K^T (tc_mods.cuh seed_scores: a distance bias where the accumulator starts).
template <typename T, int D, bool SEEDED = false, int MT, int NT>
__device__ __forceinline__ void gemm_qk(float (&s)[MT][NT][4], unsigned q_base, unsigned k_base) {
    constexpr int ROWB = D * 2;
    if constexpr (!SEEDED) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(a[mt], (q_base ^ (kk << 5)) + mt * 16 * ROWB);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned bk[4];
            ldmatrix_x4(bk, (k_base ^ (kk << 5)) + np * 16 * ROWB);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(s[mt][2 * np], a[mt], bk);
                mma_16816<T>(s[mt][2 * np + 1], a[mt], bk + 2);
            }
        }
    }
}

// O += P V: P from the S registers (two C fragments = one A fragment), V by ldmatrix.trans.
template <typename T, int D, int BC, int MT, int NT, int ND>
__device__ __forceinline__ void gemm_pv(float (&o)[MT][ND][4], const float (&s)[MT][NT][4], unsigned v_base) {
    constexpr int ROWB = D * 2;
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
        unsigned pa[MT][4];
        p_fragments<T>(pa, s, kk);
#pragma unroll
        for (int dp = 0; dp < ND / 2; ++dp) {
            unsigned bv[4];
            ldmatrix_x4_trans(bv, (v_base ^ (dp << 5)) + kk * 16 * ROWB);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(o[mt][2 * dp], pa[mt], bv);
                mma_16816<T>(o[mt][2 * dp + 1], pa[mt], bv + 2);
            }
        }
    }
}
