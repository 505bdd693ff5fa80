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
//   fa2_bwd_preprocess                        D = rowsum(dO * O)
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
#include "common.cuh"
#include "philox.cuh"

#define TILE_EMPTY 0
#define TILE_FULL 1
#define PAD 4          // row padding (floats): keeps float4 rows 16-byte aligned and spreads banks
// Occupancy target: 256 threads per SM, i.e. 2 blocks of 4 warps or 1 of 8, leaving 255 registers
// a thread. Without it NVRTC 13.0 aimed at 3 blocks of 128 threads (168 registers) and spilled the
// forward's accumulators (seen on the GPU image).
#define MIN_BLOCKS (WARPS <= 4 ? 2 : 1)

// ---- device helpers

// rows [row0, row0 + ROWS) of a [N, d] matrix (row stride srow, unit stride along d) into
// dst[ROWS][D + PAD], zero-filling rows >= N and columns >= d.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_rows(float* dst, const float* __restrict__ src, long long srow,
                                          int row0, int N, int d) {
    for (int e = threadIdx.x; e < ROWS * D; e += THREADS) {
        const int r = e / D, c = e % D;
        dst[r * (D + PAD) + c] = (row0 + r < N && c < d) ? src[(long long)(row0 + r) * srow + c] : 0.0f;
    }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

// Column-tile range [t0, t1] that rows [r0, r1] can see under the band lo <= j - i <= hi.
__device__ __forceinline__ void band_tiles(int r0, int r1, int lo, int hi, int Nk, int BCOLS, int& t0, int& t1) {
    const long long jlo = max(0LL, (long long)r0 + lo), jhi = min((long long)Nk - 1, (long long)r1 + hi);
    t0 = (int)(jlo / BCOLS);
    t1 = jlo > jhi ? t0 - 1 : (int)(jhi / BCOLS);
}

// Row-tile range [t0, t1] that can see columns [c0, c1].
__device__ __forceinline__ void band_row_tiles(int c0, int c1, int lo, int hi, int Nq, int BROWS, int& t0, int& t1) {
    const long long ilo = max(0LL, (long long)c0 - hi), ihi = min((long long)Nq - 1, (long long)c1 - lo);
    t0 = (int)(ilo / BROWS);
    t1 = ilo > ihi ? t0 - 1 : (int)(ihi / BROWS);
}

// Dropout is applied in a separate, deliberately non-unrolled pass over a tile already in shared
// memory. Inlined into the unrolled register loops, 32 Philox copies kept those loops from
// unrolling and m, l, acc went to local memory; called out of line, the call saved registers to
// the stack (both seen in the compile report as spills).
template <int R>
__device__ __forceinline__ float keep_scale(const Dropout& drop, int bh, int i, int j) {
    const uint4 w = dropout_words<R>(drop, bh, i, j >> 2);
    return dropout_factor(drop, word_of(w, j & 3));
}

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
            MASK_PARAMS, DROPOUT_PARAMS) {
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
                if (*pp != 0.0f) *pp *= keep_scale<R>(drop, b * Hq + h, row0 + wrow + r, col0 + wcol + lane + 32 * c);
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
        const float inv_l = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float* o = O + ((long long)bh * Nq + i) * d;
#pragma unroll
        for (int u = 0; u < DPL; ++u) {
            const int c = lane + 32 * u;
            if (c < d) o[c] = acc[r][u] * inv_l;
        }
        if (lane == 0) LSE[(long long)bh * Nq + i] = l[r] > 0.0f ? m[r] + logf(l[r]) : NEG_INF;
    }
}

// D[b, h, i] = sum_c dO * O; one warp per row. dO [B, Hq, Nq, d] (strided), O contiguous.
__global__ void fa2_bwd_preprocess(const float* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm,
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

// One block per K/V tile of one K/V head: dK, dV for its BC keys (summed over the query heads of
// the group and every visible Q tile); with ATOMIC_DQ, dQ += scale * dS K by float atomics.
// Warps split the BC keys (KEYS each); lanes split the BR queries of a Q tile (BR/32 each).
template <int D, int BR, int BC, int WARPS, bool ATOMIC_DQ, int R>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fa2_bwd_dkdv(const float* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
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
             MASK_PARAMS, DROPOUT_PARAMS) {
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
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tc = blockIdx.x, bhk = blockIdx.y, b = bhk / Hkv, hk = bhk % Hkv;
    const int col0 = tc * BC, wkey = warp * KEYS;
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC;
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
                    const float z = keep_scale<R>(drop, bh, i, j);
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
            if (ATOMIC_DQ) {                            // dQ[i] += scale * sum_j dS[i, j] K[j]
                __syncthreads();                        // every warp's dS^T is in sS
                for (int e = threadIdx.x; e < BR * D; e += THREADS) {
                    const int r = e / D, c = e % D, i = row0 + r;
                    if (i >= Nq || c >= d) continue;
                    float a = 0.0f;
                    for (int j = 0; j < BC; ++j) a = fmaf(sS[j * LDS + r], sK[j * LD + c], a);
                    if (a != 0.0f) atomicAdd(&dQ[((long long)bh * Nq + i) * d + c], a * scale);
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
           MASK_PARAMS, DROPOUT_PARAMS) {
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
                *ss = p == 0.0f ? 0.0f : p * (*ss * keep_scale<R>(drop, bh, i, j) - Dv[(long long)bh * Nq + i]);
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
