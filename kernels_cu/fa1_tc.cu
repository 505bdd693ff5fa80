// fa1_tc.cu: FlashAttention-1 forward on tensor cores, fp16 inputs, fp32 accumulation: the FA1
// side of the FA1-vs-FA2 comparison on equal hardware footing (same mma.sync, ldmatrix, swizzle
// and softmax code as fa2_tc.cu; what differs is the algorithm).
//
// Seed: FA1 paper (001) Algorithm 1 / lecture (003) Algorithm 1: one thread block per (batch, head)
// walks the K/V tiles (outer loop) and, for each, the Q tiles that can see it (inner loop); per
// step it reads O_i, l_i and m_i from HBM, folds in the tile and writes them back (lines 8-13),
// with O kept normalised by l after every step (line 12). Algorithm 2 for dropout (P~ dropped
// before P~ V, l keeps the undropped sum). What this kernel does not copy from FA1: the warps of a
// block split the Q tile's rows (split-Q), not the keys (FA1's split-K), so the comparison with
// fa2_tc.cu isolates the loop order, the HBM round trips of O, l, m and the (batch x heads)-only
// parallelism.
//
// Status (H100, 41f8492 / 18b9335): 0 failures over 5,005 fp16 examples after 18b9335 fixed a race
// (copies of a K/V tile no Q tile sees were never waited for). 46-62 TFLOP/s at N = 2k, 12-37 at
// 8k-16k: FA2 / FA1 on tensor cores 3.8-4.2x at 2k (paper: about 2x) and 6-21x at 8k-16k. Bound
// by the O round trip: per (row, 64-key tile) it moves 2 d fp32 values (8 d bytes) for 4 * 64 * d
// FLOPs, 32 FLOP/byte, about 95 TFLOP/s at 3 TB/s before L2 helps; and one block per (batch, head)
// gives 256 blocks at N = 2k but 32 at 16k (132 SMs).
//
// Kernels
//   fa1_tc_forward<T, D, BR, BC, WARPS, R, DROPOUT>   grid (1, B*Hq), WARPS*32 threads. O, m, l live
//       in fp32 scratch arrays in HBM ([B, Hq, Nq, d], [B, Hq, Nq] x 2: O zero, m -inf, l zero on
//       entry); after the loops the block converts O to the input dtype and writes the logsumexp.
// Masks: the host's tile table (same layout as fa2_tc: [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]) and
// the band bound both loops. Envelope: as fa2_tc.cu (D in {64, 128}, BR / WARPS a multiple of 16).
#include "tc_softmax.cuh"
#include "tc_gemm.cuh"

// ---- kernels

template <typename T, int D, int BR, int BC, int WARPS, int R, bool DROPOUT>
__global__ void __launch_bounds__(WARPS * 32, 1)
fa1_tc_forward(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,  // [B, Hq, Nq, d]
               const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,  // [B, Hkv, Nk, d]
               const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,  // [B, Hkv, Nk, d]
               T* __restrict__ O,                        // [B, Hq, Nq, d] contiguous
               float* __restrict__ LSE,                  // [B, Hq, Nq]
               float* __restrict__ Oacc,                 // [B, Hq, Nq, d] fp32 scratch, zero
               float* __restrict__ Mst,                  // [B, Hq, Nq] row max (log2 units), -inf
               float* __restrict__ Lst,                  // [B, Hq, Nq] row sum, zero
               const signed char* __restrict__ tiles,    // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
               int tile_heads, int Hq, int group, int Nq, int Nk, int d,
               float scale_log2,                         // scale * log2(e) > 0 (the host negates K for scale < 0)
               MASK_PARAMS, DROPOUT_PARAMS) {
    constexpr int THREADS = WARPS * 32;
    constexpr int RW = BR / WARPS;
    constexpr int MT = RW / 16;
    constexpr int NT = BC / 8;
    constexpr int ND = D / 8;
    static_assert(D == 64 || D == 128, "head dim padded to 64 or 128");
    static_assert(RW % 16 == 0 && BC % 16 == 0, "each warp needs 16k query rows; BC a multiple of 16");
    extern __shared__ __align__(1024) uint4 smem_u4[];
    T* sQ = reinterpret_cast<T*>(smem_u4);   // [BR][D] swizzled
    T* sK = sQ + BR * D;                      // [BC][D]
    T* sV = sK + BC * D;                      // [BC][D]

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / group;
    const int wrow = warp * RW, nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC, dch = d / 8;
    const T* Qb = Q + b * q_sb + h * q_sh;
    const T* Kb = K + b * k_sb + hk * k_sh;
    const T* Vb = V + b * v_sb + hk * v_sh;
    float* Ob = Oacc + (long long)bh * Nq * d;
    float* Mb = Mst + (long long)bh * Nq;
    float* Lb = Lst + (long long)bh * Nq;
    const signed char* thead = tiles + (long long)(tile_heads == 1 ? 0 : h) * nTr * nTc;
    const TileBases base = tile_bases<T, D>(sQ, sK, sV, wrow, lane);

    int j0, j1;
    band_tiles(0, Nq - 1, band_lo, band_hi, Nk, BC, j0, j1);
    for (int j = j0; j <= j1; ++j) {                      // K/V tiles: the outer loop (line 5)
        const int col0 = j * BC;
        int i0, i1;
        band_row_tiles(col0, min(col0 + BC, Nk) - 1, band_lo, band_hi, Nq, BR, i0, i1);
        while (i0 <= i1 && thead[i0 * nTc + j] == TILE_EMPTY) ++i0;
        if (i0 > i1) continue;                            // no Q tile sees K_j: never loaded
        __syncthreads();                                  // every warp is done with K_{j-1}, V_{j-1}
        load_tile_async<T, BC, D, THREADS>(sK, Kb, k_sm, col0, Nk, dch);
        load_tile_async<T, BC, D, THREADS>(sV, Vb, v_sm, col0, Nk, dch);
        cp_async_commit();
        for (int i = i0; i <= i1; ++i) {                  // Q tiles that see K_j: the inner loop (line 7)
            const int cls = thead[i * nTc + j];
            if (cls == TILE_EMPTY) continue;
            const int row_base = i * BR + wrow;
            __syncthreads();                              // every warp is done with Q_{i-1}
            load_tile_async<T, BR, D, THREADS>(sQ, Qb, q_sm, i * BR, Nq, dch);
            cp_async_commit();

            // O_i, m_i, l_i from HBM (line 8); O was stored normalised: O l restores the sum of P V
            float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int r = row_base + mt * 16 + g + 8 * hr;
                    const bool in = r < Nq;
                    const float lr = in ? Lb[r] : 0.0f;
                    m[mt][hr] = in ? Mb[r] : NEG_INF;
                    l[mt][hr] = tq == 0 ? lr : 0.0f;      // a lane's partial sum; the quad adds up to lr
#pragma unroll
                    for (int n = 0; n < ND; ++n) {
                        const int c = n * 8 + 2 * tq;
                        float2 x = make_float2(0.0f, 0.0f);
                        if (in && c < d) x = *reinterpret_cast<const float2*>(Ob + (long long)r * d + c);
                        o[mt][n][2 * hr] = x.x * lr;
                        o[mt][n][2 * hr + 1] = x.y * lr;
                    }
                }

            cp_async_wait<0>();
            __syncthreads();                              // Q_i (and K_j, V_j) landed
            float s[MT][NT][4];
            gemm_qk<T, D>(s, base.q, base.k);
            if (cls != TILE_FULL || col0 + BC > Nk) mask_scores(s, cls, mask, h, row_base, col0, Nq, Nk, g, tq);
            online_softmax<DROPOUT>(s, m, l, o, scale_log2);
            if (DROPOUT) apply_dropout<R>(s, drop, bh, row_base, col0, g, tq);
            gemm_pv<T, D, BC>(o, s, base.v);

            // O_i = O / l, m_i, l_i back to HBM (lines 12-13)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    float sum = l[mt][hr];
                    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                    const int r = row_base + mt * 16 + g + 8 * hr;
                    if (r >= Nq) continue;
                    const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;   // NaN is not a dead row: only an exactly zero sum is
#pragma unroll
                    for (int n = 0; n < ND; ++n) {
                        const int c = n * 8 + 2 * tq;
                        if (c < d)
                            *reinterpret_cast<float2*>(Ob + (long long)r * d + c) =
                                make_float2(o[mt][n][2 * hr] * inv, o[mt][n][2 * hr + 1] * inv);
                    }
                    if (tq == 0) {
                        Mb[r] = m[mt][hr];
                        Lb[r] = sum;
                    }
                }
        }
    }
    cp_async_wait<0>();
    __syncthreads();                                      // every row's last O, m, l are visible

    // O in the input dtype and lse = (m2 + log2 l) ln 2; rows that saw nothing: 0 and -inf
    for (long long e = threadIdx.x; e < (long long)Nq * d; e += THREADS)
        O[(long long)bh * Nq * d + e] = static_cast<T>(Ob[e]);
    for (int r = threadIdx.x; r < Nq; r += THREADS)
        LSE[(long long)bh * Nq + r] = Lb[r] == 0.0f ? NEG_INF : (Mb[r] + log2f(Lb[r])) * LN2;   // NaN is not a dead row: only an exactly zero sum is
}
