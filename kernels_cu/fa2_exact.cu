// fa2_exact.cu: FlashAttention-2 in exact float32 on CUDA cores (the exact tier's reference rungs).
//
// Seeds: FA2 paper (002) Algorithm 1 (forward: Q-outer loop, online softmax with deferred
// rescaling, logsumexp saved) and Algorithm 2 (backward: K/V-column-parallel, P recomputed from
// the logsumexp, dQ accumulated atomically); Sec. 3.3 for the warp partitioning.
//
// Kernels
//   fa2_forward<D, BR, BC, WARPS, SPLIT_Q, R>   grid (ceil(Nq/BR), B*Hq). SPLIT_Q: each warp owns
//       BR/WARPS query rows and sees every key of a tile (no inter-warp reduction). !SPLIT_Q
//       ("split-K", the FA1 partitioning): every warp sees all BR rows and BC/WARPS keys of each
//       tile; the warps agree on the row max through shared memory on every tile and add their
//       partial O and row sums at the end, in a fixed order.
//   bwd_preprocess                        D = rowsum(dO * O)
//   fa2_bwd_dkdv<D, BR, BC, WARPS, ATOMIC_DQ, R> grid (ceil(Nk/BC), B*Hkv): one block per K/V tile
//       sums over the query heads of its group (GQA) and every visible Q tile; with ATOMIC_DQ it
//       also adds dS K into dQ with float atomics (the paper's choice), else dQ is left alone.
//   fa2_bwd_dq<D, BR, BC, WARPS, R>           grid (ceil(Nq/BR), B*Hq): the deterministic dQ, row-
//       parallel, fixed summation order (pairs with fa2_bwd_dkdv<..., false, R>).
// Masks: tiles classified EMPTY / FULL / PARTIAL on the host (sandbox/masks.py) are skipped /
// unmasked / masked per element; the band bounds the tile loop, so tiles above the causal diagonal
// are never loaded. Dropout: one Philox call per element (the contract's counters); exp via expf
// (no fast math) so that the tier stays exact.
// Status: see bench/results/ (fuzzed against the oracle on the GPU; timings in the tables).
#include "exact_backward.cuh"

// ---- kernels

template <int D, int BR, int BC, int WARPS, bool SPLIT_Q, int R>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fa2_forward(const float* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,  // [B, Hq, Nq, d]
            const float* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,  // [B, Hkv, Nk, d]
            const float* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,  // [B, Hkv, Nk, d]
            float* __restrict__ O,                   // [B, Hq, Nq, d] contiguous
            float* __restrict__ LSE,                 // [B, Hq, Nq]
            const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)] classes
            int tile_heads, int Hq, int group, int Nq, int Nk, int d, float scale,
            MASK_PARAMS, DROPOUT_PARAMS, PACKED_PARAMS) {
    constexpr int THREADS = WARPS * 32;
    constexpr int ROWS = SPLIT_Q ? BR / WARPS : BR;     // query rows per warp
    constexpr int COLS = SPLIT_Q ? BC : BC / WARPS;     // keys per warp per tile
    constexpr int CPL = COLS / 32, DPL = D / 32, LD = D + PAD, LDP = COLS + PAD;
    static_assert(D % 32 == 0 && D <= 128, "head dim padded to 32, 64, 96 or 128");
    static_assert(BR % WARPS == 0 && COLS % 32 == 0, "each warp needs whole rows and 32k keys");
    extern __shared__ float4 smem_f4[];
    float* sQ = reinterpret_cast<float*>(smem_f4);   // [BR][LD]
    float* sK = sQ + BR * LD;                         // [BC][LD]
    float* sV = sK + BC * LD;                         // [BC][LD]
    float* sP = sV + BC * LD;                         // [WARPS][ROWS][LDP]
    float* sRed = sP + WARPS * ROWS * LDP;            // [WARPS][BR] (split-K row maxima), then [BR] sums

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const PackedMask pm = PACKED_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tr = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / group;
    const int row0 = tr * BR, wrow = SPLIT_Q ? warp * ROWS : 0, wcol = SPLIT_Q ? 0 : warp * COLS;
    const int nTc = (Nk + BC - 1) / BC;
    const float* Kb = K + b * k_sb + hk * k_sh;
    const float* Vb = V + b * v_sb + hk * v_sh;
    load_rows<BR, D, THREADS>(sQ, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, d);

    float m[ROWS], l[ROWS], acc[ROWS][DPL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = NEG_INF; l[r] = 0.0f;
#pragma unroll
        for (int u = 0; u < DPL; ++u) acc[r][u] = 0.0f;
    }
    int t0, t1;
    band_tiles(row0, min(row0 + BR, Nq) - 1, band_lo, band_hi, Nk, BC, t0, t1);
    const signed char* trow = tiles + ((long long)(tile_heads == 1 ? 0 : h) * gridDim.x + tr) * nTc;

    for (int t = t0; t <= t1; ++t) {
        const int cls = trow[t];
        if (cls == TILE_EMPTY) continue;                // never loaded
        const int col0 = t * BC;
        __syncthreads();                                // previous tile fully consumed
        load_rows<BC, D, THREADS>(sK, Kb, k_sm, col0, Nk, d);
        load_rows<BC, D, THREADS>(sV, Vb, v_sm, col0, Nk, d);
        __syncthreads();

        float s[ROWS][CPL];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int c = 0; c < CPL; ++c) s[r][c] = 0.0f;
#pragma unroll 4
        for (int k = 0; k < D; k += 4) {
            float4 kv[CPL];
#pragma unroll
            for (int c = 0; c < CPL; ++c) kv[c] = *reinterpret_cast<const float4*>(&sK[(wcol + lane + 32 * c) * LD + k]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float4 qv = *reinterpret_cast<const float4*>(&sQ[(wrow + r) * LD + k]);
#pragma unroll
                for (int c = 0; c < CPL; ++c) s[r][c] = dot4(qv, kv[c], s[r][c]);
            }
        }
        float mx[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int i = row0 + wrow + r;
            mx[r] = NEG_INF;
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                const int j = col0 + wcol + lane + 32 * c;
                const bool vis = i < Nq && j < Nk && (cls == TILE_FULL || mask.visible(h, i, j));
                s[r][c] = vis ? s[r][c] * scale : NEG_INF;
                mx[r] = fmaxf(mx[r], s[r][c]);
            }
            mx[r] = warp_max(mx[r]);
        }
        if (!SPLIT_Q) {                                 // split-K: the warps agree on each row's max
            if (lane == 0)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) sRed[warp * BR + r] = mx[r];
            __syncthreads();
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                for (int w = 0; w < WARPS; ++w) mx[r] = fmaxf(mx[r], sRed[w * BR + r]);
        }
        float* myP = sP + warp * ROWS * LDP;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float m_new = fmaxf(m[r], mx[r]);
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;   // a row with nothing visible yet
            const float corr = expf(m[r] - m_use);
            float rowsum = 0.0f;
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                const float p = expf(s[r][c] - m_use);
                rowsum += p;
                myP[r * LDP + lane + 32 * c] = p;
            }
            l[r] = l[r] * corr + warp_sum(rowsum);
            m[r] = m_new;
#pragma unroll
            for (int u = 0; u < DPL; ++u) acc[r][u] *= corr;
        }
        if (drop.threshold) {                           // P_drop = P * Z / (1 - p); l keeps the undropped sum
#pragma unroll 1
            for (int e = 0; e < ROWS * CPL; ++e) {
                const int r = e / CPL, c = e % CPL;
                float* pp = &myP[r * LDP + lane + 32 * c];
                dropout_fwd<R>(pp, drop, pm, b * Hq + h, Nq, Nk, row0 + wrow + r, col0 + wcol + 32 * c, lane);
            }
        }
        __syncwarp();
#pragma unroll 2
        for (int c = 0; c < COLS; c += 4) {
            float vv[4][DPL];
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int u = 0; u < DPL; ++u) vv[x][u] = sV[(wcol + c + x) * LD + lane + 32 * u];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float4 pv = *reinterpret_cast<const float4*>(&myP[r * LDP + c]);
#pragma unroll
                for (int u = 0; u < DPL; ++u)
                    acc[r][u] = fmaf(pv.w, vv[3][u], fmaf(pv.z, vv[2][u], fmaf(pv.y, vv[1][u], fmaf(pv.x, vv[0][u], acc[r][u]))));
            }
        }
    }

    if (!SPLIT_Q) {                                     // add the warps' partial O and l in warp order
        __syncthreads();
        float* sO = sQ;                                 // Q is no longer needed: [BR][LD]
        float* sL = sRed;                               // [BR]
        for (int e = threadIdx.x; e < BR * LD; e += THREADS) sO[e] = 0.0f;
        for (int e = threadIdx.x; e < BR; e += THREADS) sL[e] = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            __syncthreads();
            if (warp == w) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                    for (int u = 0; u < DPL; ++u) sO[r * LD + lane + 32 * u] += acc[r][u];
                    if (lane == 0) sL[r] += l[r];
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            l[r] = sL[r];
#pragma unroll
            for (int u = 0; u < DPL; ++u) acc[r][u] = sO[r * LD + lane + 32 * u];
        }
        if (warp != 0) return;                          // warp 0 writes the tile
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int i = row0 + wrow + r;
        if (i >= Nq) break;
        const float inv_l = l[r] == 0.0f ? 0.0f : 1.0f / l[r];     // NaN is not a dead row: only an exactly zero sum is
        float* o = O + ((long long)bh * Nq + i) * d;
#pragma unroll
        for (int u = 0; u < DPL; ++u) {
            const int c = lane + 32 * u;
            if (c < d) o[c] = acc[r][u] * inv_l;
        }
        if (lane == 0) LSE[(long long)bh * Nq + i] = l[r] == 0.0f ? NEG_INF : m[r] + logf(l[r]);
    }
}

// FA2 Algorithm 2: one block per K/V tile (grid ceil(Nk/BC) x B*Hkv).
template <int D, int BR, int BC, int WARPS, bool ATOMIC_DQ, int R>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fa2_bwd_dkdv(const float* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
             const float* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
             const float* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
             const float* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
             const float* __restrict__ LSE, const float* __restrict__ Dv,                    // [B, Hq, Nq]
             float* __restrict__ dQ, float* __restrict__ dK, float* __restrict__ dV,
             const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
             int tile_heads, int Hq, int Hkv, int group, int Nq, int Nk, int d, float scale,
             MASK_PARAMS, DROPOUT_PARAMS, PACKED_PARAMS) {
    kv_tile_backward<D, BR, BC, WARPS, ATOMIC_DQ ? DQ_ATOMIC : DQ_NONE, R>(
        blockIdx.x, Q, q_sb, q_sh, q_sm, K, k_sb, k_sh, k_sm, V, v_sb, v_sh, v_sm, dO, do_sb, do_sh, do_sm,
        LSE, Dv, dQ, dK, dV, tiles, tile_heads, Hq, Hkv, group, Nq, Nk, d, scale,
        band_lo, band_hi, layout, layout_heads, mask_bq, mask_bk, mask_nbq, mask_nbk,
        drop_threshold, drop_inv_keep, drop_seed, drop_offset, PACKED_ARGS);
}

// Deterministic dQ: one block per Q tile, K/V tiles in a fixed order, no atomics. Warps own
// BR/WARPS query rows (split-Q); lanes split the BC keys of a tile for S and dP, and the head
// dim for dQ.
template <int D, int BR, int BC, int WARPS, int R>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fa2_bwd_dq(const float* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
           const float* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
           const float* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
           const float* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
           const float* __restrict__ LSE, const float* __restrict__ Dv,                    // [B, Hq, Nq]
           float* __restrict__ dQ,                  // [B, Hq, Nq, d] contiguous
           const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
           int tile_heads, int Hq, int group, int Nq, int Nk, int d, float scale,
           MASK_PARAMS, DROPOUT_PARAMS, PACKED_PARAMS) {
    constexpr int THREADS = WARPS * 32;
    constexpr int ROWS = BR / WARPS, CPL = BC / 32, DPL = D / 32, LD = D + PAD, LDP = BC + PAD;
    static_assert(D % 32 == 0 && D <= 128 && BR % WARPS == 0 && BC % 32 == 0, "tile envelope");
    extern __shared__ float4 smem_f4[];
    float* sQ = reinterpret_cast<float*>(smem_f4);   // [BR][LD]
    float* sdO = sQ + BR * LD;                        // [BR][LD]
    float* sK = sdO + BR * LD;                        // [BC][LD]
    float* sV = sK + BC * LD;                         // [BC][LD]
    float* sS = sV + BC * LD;                         // [WARPS][ROWS][LDP] dS of this warp
    float* sPw = sS + WARPS * ROWS * LDP;             // [WARPS][ROWS][LDP] P (dropout pass only)

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const PackedMask pm = PACKED_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tr = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / group;
    const int row0 = tr * BR, wrow = warp * ROWS, nTc = (Nk + BC - 1) / BC;
    float* myP = sPw + warp * ROWS * LDP;
    load_rows<BR, D, THREADS>(sQ, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, d);
    load_rows<BR, D, THREADS>(sdO, dO + b * do_sb + h * do_sh, do_sm, row0, Nq, d);
    const float* Kb = K + b * k_sb + hk * k_sh;
    const float* Vb = V + b * v_sb + hk * v_sh;
    float L[ROWS], Di[ROWS], acc[ROWS][DPL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int i = row0 + wrow + r;
        L[r] = i < Nq ? LSE[(long long)bh * Nq + i] : NEG_INF;
        Di[r] = i < Nq ? Dv[(long long)bh * Nq + i] : 0.0f;
#pragma unroll
        for (int u = 0; u < DPL; ++u) acc[r][u] = 0.0f;
    }
    int t0, t1;
    band_tiles(row0, min(row0 + BR, Nq) - 1, band_lo, band_hi, Nk, BC, t0, t1);
    const signed char* trow = tiles + ((long long)(tile_heads == 1 ? 0 : h) * gridDim.x + tr) * nTc;
    float* myS = sS + warp * ROWS * LDP;
    for (int t = t0; t <= t1; ++t) {
        const int cls = trow[t];
        if (cls == TILE_EMPTY) continue;
        const int col0 = t * BC;
        __syncthreads();
        load_rows<BC, D, THREADS>(sK, Kb, k_sm, col0, Nk, d);
        load_rows<BC, D, THREADS>(sV, Vb, v_sm, col0, Nk, d);
        __syncthreads();
        float s[ROWS][CPL], dp[ROWS][CPL];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int c = 0; c < CPL; ++c) s[r][c] = dp[r][c] = 0.0f;
#pragma unroll 2
        for (int k = 0; k < D; k += 4) {
            float4 kv[CPL], vv[CPL];
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                kv[c] = *reinterpret_cast<const float4*>(&sK[(lane + 32 * c) * LD + k]);
                vv[c] = *reinterpret_cast<const float4*>(&sV[(lane + 32 * c) * LD + k]);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float4 qv = *reinterpret_cast<const float4*>(&sQ[(wrow + r) * LD + k]);
                const float4 ov = *reinterpret_cast<const float4*>(&sdO[(wrow + r) * LD + k]);
#pragma unroll
                for (int c = 0; c < CPL; ++c) { s[r][c] = dot4(qv, kv[c], s[r][c]); dp[r][c] = dot4(ov, vv[c], dp[r][c]); }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int i = row0 + wrow + r;
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                const int j = col0 + lane + 32 * c;
                const bool vis = L[r] != NEG_INF && i < Nq && j < Nk && (cls == TILE_FULL || mask.visible(h, i, j));
                const float p = vis ? expf(s[r][c] * scale - L[r]) : 0.0f;
                if (drop.threshold) { myP[r * LDP + lane + 32 * c] = p; myS[r * LDP + lane + 32 * c] = dp[r][c]; }
                else myS[r * LDP + lane + 32 * c] = p * (dp[r][c] - Di[r]);
            }
        }
        if (drop.threshold) {
#pragma unroll 1
            for (int e = 0; e < ROWS * CPL; ++e) {
                const int r = e / CPL, c = e % CPL, i = row0 + wrow + r, j = col0 + lane + 32 * c;
                const float p = myP[r * LDP + lane + 32 * c];
                float* ss = &myS[r * LDP + lane + 32 * c];
                *ss = p == 0.0f ? 0.0f : p * (*ss * keep_scale_bwd<R>(drop, pm, bh, Nq, i, j) - Dv[(long long)bh * Nq + i]);
            }
        }
        __syncwarp();
#pragma unroll 2
        for (int c = 0; c < BC; c += 4) {
            float kk[4][DPL];
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int u = 0; u < DPL; ++u) kk[x][u] = sK[(c + x) * LD + lane + 32 * u];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float4 sv = *reinterpret_cast<const float4*>(&myS[r * LDP + c]);
#pragma unroll
                for (int u = 0; u < DPL; ++u)
                    acc[r][u] = fmaf(sv.w, kk[3][u], fmaf(sv.z, kk[2][u], fmaf(sv.y, kk[1][u], fmaf(sv.x, kk[0][u], acc[r][u]))));
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int i = row0 + wrow + r;
        if (i >= Nq) break;
        float* o = dQ + ((long long)bh * Nq + i) * d;
#pragma unroll
        for (int u = 0; u < DPL; ++u) {
            const int c = lane + 32 * u;
            if (c < d) o[c] = acc[r][u] * scale;
        }
    }
}
