// exact_backward.cuh: the backward pieces shared by FA1 and FA2 in the exact tier.
//
// D = rowsum(dO * O) is computed once by a preprocessing kernel (FA2 paper Algorithm 2, line 4;
// FA1's Algorithm 4 recomputes it per tile, which yields the same numbers).
// kv_tile_backward: one K/V tile's dK, dV (FA1 Algorithm 4's inner loop over Q tiles = FA2
// Algorithm 2's body for one column block), P recomputed from the saved logsumexp, the dropout
// mask replayed from (seed, offset). dQ is left alone (DQ_NONE: the deterministic dQ kernel does
// it), added by float atomics (DQ_ATOMIC: FA2, several blocks share a Q row) or read-modified-
// written (DQ_OWNED: FA1, one block per (batch, K/V head) owns every row of its query heads).
#pragma once
#include "exact_tiles.cuh"

#define DQ_NONE 0
#define DQ_ATOMIC 1
#define DQ_OWNED 2

// D[b, h, i] = sum_c dO * O; one warp per row. dO [B, Hq, Nq, d] (strided), O contiguous.
__global__ void bwd_preprocess(const float* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm,
                                   const float* __restrict__ O,   // [B, Hq, Nq, d] contiguous
                                   float* __restrict__ Dv,        // [B, Hq, Nq]
                                   int Hq, int Nq, int d, int rows) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int b = row / (Hq * Nq), h = (row / Nq) % Hq, i = row % Nq;
    const float* a = dO + b * do_sb + h * do_sh + (long long)i * do_sm;
    const float* o = O + (long long)row * d;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) acc = fmaf(a[c], o[c], acc);
    acc = warp_sum(acc);
    if (lane == 0) Dv[row] = acc;
}

// K/V tile tc of the K/V head blockIdx.y: dK, dV for its BC keys (summed over the query heads of
// the group and every visible Q tile); dQ += scale * dS K as DQ_MODE says.
// Warps split the BC keys (KEYS each); lanes split the BR queries of a Q tile (BR/32 each).
template <int D, int BR, int BC, int WARPS, int DQ_MODE, int R>
__device__ __forceinline__ void
kv_tile_backward(int tc,                           // the K/V tile this block owns now
             const float* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
             const float* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
             const float* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
             const float* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
             const float* __restrict__ LSE,     // [B, Hq, Nq]
             const float* __restrict__ Dv,      // [B, Hq, Nq]
             float* __restrict__ dQ,            // [B, Hq, Nq, d] contiguous, zeroed (ATOMIC_DQ)
             float* __restrict__ dK,            // [B, Hkv, Nk, d] contiguous
             float* __restrict__ dV,            // [B, Hkv, Nk, d] contiguous
             const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
             int tile_heads, int Hq, int Hkv, int group, int Nq, int Nk, int d, float scale,
             MASK_PARAMS, DROPOUT_PARAMS, PACKED_PARAMS) {
    constexpr int THREADS = WARPS * 32;
    constexpr int KEYS = BC / WARPS, QPL = BR / 32, DPL = D / 32, LD = D + PAD, LDS = BR + PAD;
    static_assert(D % 32 == 0 && D <= 128 && BC % WARPS == 0 && BR % 32 == 0, "tile envelope");
    extern __shared__ float4 smem_f4[];
    float* sK = reinterpret_cast<float*>(smem_f4);   // [BC][LD]
    float* sV = sK + BC * LD;                         // [BC][LD]
    float* sQ = sV + BC * LD;                         // [BR][LD]
    float* sdO = sQ + BR * LD;                        // [BR][LD]
    float* sP = sdO + BR * LD;                        // [BC][LDS] dropped-out P^T of this tile
    float* sS = sP + BC * LDS;                        // [BC][LDS] dS^T of this tile

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const PackedMask pm = PACKED_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int bhk = blockIdx.y, b = bhk / Hkv, hk = bhk % Hkv;
    const int col0 = tc * BC, wkey = warp * KEYS;
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC;
    __syncthreads();                                // a previous K/V tile (FA1's loop) fully consumed
    load_rows<BC, D, THREADS>(sK, K + b * k_sb + hk * k_sh, k_sm, col0, Nk, d);
    load_rows<BC, D, THREADS>(sV, V + b * v_sb + hk * v_sh, v_sm, col0, Nk, d);

    float dk[KEYS][DPL], dv[KEYS][DPL];
#pragma unroll
    for (int c = 0; c < KEYS; ++c)
#pragma unroll
        for (int u = 0; u < DPL; ++u) dk[c][u] = dv[c][u] = 0.0f;
    int t0, t1;
    band_row_tiles(col0, min(col0 + BC, Nk) - 1, band_lo, band_hi, Nq, BR, t0, t1);

    for (int g = 0; g < group; ++g) {
        const int h = hk * group + g, bh = b * Hq + h;
        const float* Qb = Q + b * q_sb + h * q_sh;
        const float* dOb = dO + b * do_sb + h * do_sh;
        for (int t = t0; t <= t1; ++t) {
            const int cls = tiles[((long long)(tile_heads == 1 ? 0 : h) * nTr + t) * nTc + tc];
            if (cls == TILE_EMPTY) continue;
            const int row0 = t * BR;
            __syncthreads();
            load_rows<BR, D, THREADS>(sQ, Qb, q_sm, row0, Nq, d);
            load_rows<BR, D, THREADS>(sdO, dOb, do_sm, row0, Nq, d);
            __syncthreads();
            // S^T and dP^T for this warp's keys (rows) and the lane's queries (columns)
            float s[KEYS][QPL], dp[KEYS][QPL];
#pragma unroll
            for (int c = 0; c < KEYS; ++c)
#pragma unroll
                for (int x = 0; x < QPL; ++x) s[c][x] = dp[c][x] = 0.0f;
#pragma unroll 2
            for (int k = 0; k < D; k += 4) {
                float4 qv[QPL], ov[QPL];
#pragma unroll
                for (int x = 0; x < QPL; ++x) {
                    qv[x] = *reinterpret_cast<const float4*>(&sQ[(lane + 32 * x) * LD + k]);
                    ov[x] = *reinterpret_cast<const float4*>(&sdO[(lane + 32 * x) * LD + k]);
                }
#pragma unroll
                for (int c = 0; c < KEYS; ++c) {
                    const float4 kv = *reinterpret_cast<const float4*>(&sK[(wkey + c) * LD + k]);
                    const float4 vv = *reinterpret_cast<const float4*>(&sV[(wkey + c) * LD + k]);
#pragma unroll
                    for (int x = 0; x < QPL; ++x) {
                        s[c][x] = dot4(qv[x], kv, s[c][x]);
                        dp[c][x] = dot4(ov[x], vv, dp[c][x]);
                    }
                }
            }
#pragma unroll
            for (int x = 0; x < QPL; ++x) {
                const int i = row0 + lane + 32 * x;
                const float L = i < Nq ? LSE[(long long)bh * Nq + i] : NEG_INF;
                const float Di = i < Nq ? Dv[(long long)bh * Nq + i] : 0.0f;
#pragma unroll
                for (int c = 0; c < KEYS; ++c) {
                    const int j = col0 + wkey + c;
                    const bool vis = L != NEG_INF && j < Nk && (cls == TILE_FULL || mask.visible(h, i, j));
                    const float p = vis ? expf(s[c][x] * scale - L) : 0.0f;
                    sP[(wkey + c) * LDS + lane + 32 * x] = p;
                    // with dropout, dS needs Z: keep dP here for the dropout pass
                    sS[(wkey + c) * LDS + lane + 32 * x] = drop.threshold ? dp[c][x] : p * (dp[c][x] - Di);
                }
            }
            if (drop.threshold) {                       // P_drop = P * Z / (1 - p), dS = P * (dP * Z / (1 - p) - D)
#pragma unroll 1
                for (int e = 0; e < KEYS * QPL; ++e) {
                    const int c = e / QPL, x = e % QPL, i = row0 + lane + 32 * x, j = col0 + wkey + c;
                    float* pp = &sP[(wkey + c) * LDS + lane + 32 * x];
                    float* ss = &sS[(wkey + c) * LDS + lane + 32 * x];
                    const float p = *pp;
                    if (p == 0.0f) { *ss = 0.0f; continue; }
                    const float z = keep_scale_bwd<R>(drop, pm, bh, Nq, i, j);
                    *pp = p * z;
                    *ss = p * (*ss * z - Dv[(long long)bh * Nq + i]);
                }
            }
            __syncwarp();
            // dV += P_drop^T dO, dK += dS^T Q (this warp's keys, the lane's head-dim columns)
#pragma unroll 2
            for (int r = 0; r < BR; r += 4) {
                float ov[4][DPL], qv[4][DPL];
#pragma unroll
                for (int y = 0; y < 4; ++y)
#pragma unroll
                    for (int u = 0; u < DPL; ++u) {
                        ov[y][u] = sdO[(r + y) * LD + lane + 32 * u];
                        qv[y][u] = sQ[(r + y) * LD + lane + 32 * u];
                    }
#pragma unroll
                for (int c = 0; c < KEYS; ++c) {
                    const float4 pv = *reinterpret_cast<const float4*>(&sP[(wkey + c) * LDS + r]);
                    const float4 sv = *reinterpret_cast<const float4*>(&sS[(wkey + c) * LDS + r]);
#pragma unroll
                    for (int u = 0; u < DPL; ++u) {
                        dv[c][u] = fmaf(pv.w, ov[3][u], fmaf(pv.z, ov[2][u], fmaf(pv.y, ov[1][u], fmaf(pv.x, ov[0][u], dv[c][u]))));
                        dk[c][u] = fmaf(sv.w, qv[3][u], fmaf(sv.z, qv[2][u], fmaf(sv.y, qv[1][u], fmaf(sv.x, qv[0][u], dk[c][u]))));
                    }
                }
            }
            if (DQ_MODE != DQ_NONE) {                   // dQ[i] += scale * sum_j dS[i, j] K[j]
                __syncthreads();                        // every warp's dS^T is in sS
                for (int e = threadIdx.x; e < BR * D; e += THREADS) {
                    const int r = e / D, c = e % D, i = row0 + r;
                    if (i >= Nq || c >= d) continue;
                    float a = 0.0f;
                    for (int j = 0; j < BC; ++j) a = fmaf(sS[j * LDS + r], sK[j * LD + c], a);
                    float* dst = &dQ[((long long)bh * Nq + i) * d + c];
                    if (DQ_MODE == DQ_ATOMIC) { if (a != 0.0f) atomicAdd(dst, a * scale); }
                    else *dst += a * scale;     // DQ_OWNED: this thread is the only writer of dst
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < KEYS; ++c) {
        const int j = col0 + wkey + c;
        if (j >= Nk) break;
        float* dkr = dK + ((long long)bhk * Nk + j) * d;
        float* dvr = dV + ((long long)bhk * Nk + j) * d;
#pragma unroll
        for (int u = 0; u < DPL; ++u) {
            const int x = lane + 32 * u;
            if (x < d) { dkr[x] = dk[c][u] * scale; dvr[x] = dv[c][u]; }
        }
    }
}
