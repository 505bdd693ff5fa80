// fa1_exact.cu: FlashAttention-1 in exact float32 on CUDA cores.
//
// Seeds: FA1 paper (001) Algorithm 1 / lecture (003) Algorithm 1 (forward: K/V-outer loop, Q-inner
// loop, O, l and m read from and written back to HBM on every step), Algorithm 2 (dropout and
// masking in the forward) and Algorithm 4 of 004_d1f618a8657308c1.txt (backward: recomputes S and
// P, regenerates the dropout mask from the saved RNG state). The differences that FA2 later made
// are what this file keeps: one thread block per (batch, head), the output kept normalised after
// every K/V tile, and (by default) the split-K warp partitioning.
//
// Kernels
//   fa1_forward<D, BR, BC, WARPS, SPLIT_Q, R>  grid (1, B*Hq): the block walks K/V tiles (outer)
//       and, for each, the Q tiles that can see it (inner); per step it reads O_i, l_i, m_i from
//       HBM, folds in the tile, and writes them back (FA1 Algorithm 1, lines 9-13). At the end it
//       turns (m, l) into the logsumexp the contract saves. SPLIT_Q: warps own query rows; !SPLIT_Q
//       (split-K, FA1's choice): warps split the keys of a tile and reduce the row max, the row sum
//       and P V through shared memory, in warp order.
//   fa1_backward<D, BR, BC, WARPS, R>          grid (1, B*Hkv): Algorithm 4 as written: K/V tiles
//       outer, Q tiles inner, dQ_i read-modified-written in HBM (the block owns every query row of
//       its K/V head's group, so no atomics); P is recomputed from the logsumexp (m + log l), not
//       from m and l separately (the same numbers to within rounding; one saved array).
// Masks: tiles classified EMPTY / FULL / PARTIAL on the host; empty tiles are never loaded, and the
// band bounds both loops (tiles above the causal diagonal are skipped). Dropout: P~ is dropped
// before P~ V and l keeps the undropped sum (Algorithm 2); Philox counters as in the contract.
#include "exact_backward.cuh"

template <int D, int BR, int BC, int WARPS, bool SPLIT_Q, int R>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fa1_forward(const float* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,  // [B, Hq, Nq, d]
            const float* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,  // [B, Hkv, Nk, d]
            const float* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,  // [B, Hkv, Nk, d]
            float* __restrict__ O,                   // [B, Hq, Nq, d] contiguous, zeroed
            float* __restrict__ Ml,                  // [B, Hq, Nq] running max m, set to -inf
            float* __restrict__ Ll,                  // [B, Hq, Nq] running sum l, zeroed
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
    float* sQ = reinterpret_cast<float*>(smem_f4);   // [BR][LD]; then this step's P~ V ([BR][LD])
    float* sK = sQ + BR * LD;                         // [BC][LD]
    float* sV = sK + BC * LD;                         // [BC][LD]
    float* sP = sV + BC * LD;                         // [WARPS][ROWS][LDP]
    float* sRed = sP + WARPS * ROWS * LDP;            // [WARPS][BR] per-warp row maxima (split-K)
    float* sM = sRed + WARPS * BR;                    // [BR] this step's row max m~
    float* sL = sM + BR;                              // [BR] this step's row sum l~
    float* sO = sQ;

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const PackedMask pm = PACKED_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / group;
    const int wrow = SPLIT_Q ? warp * ROWS : 0, wcol = SPLIT_Q ? 0 : warp * COLS;
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC;
    const float* Qb = Q + b * q_sb + h * q_sh;
    const float* Kb = K + b * k_sb + hk * k_sh;
    const float* Vb = V + b * v_sb + hk * v_sh;
    float* Ob = O + (long long)bh * Nq * d;
    float* Mb = Ml + (long long)bh * Nq;
    float* Lb = Ll + (long long)bh * Nq;
    const signed char* th = tiles + (long long)(tile_heads == 1 ? 0 : h) * nTr * nTc;

    int c0, c1;                                        // K/V tiles any row can see
    band_tiles(0, Nq - 1, band_lo, band_hi, Nk, BC, c0, c1);
    for (int tc = c0; tc <= c1; ++tc) {
        const int col0 = tc * BC;
        int r0, r1;                                    // Q tiles that can see this K/V tile
        band_row_tiles(col0, min(col0 + BC, Nk) - 1, band_lo, band_hi, Nq, BR, r0, r1);
        bool loaded = false;
        for (int tr = r0; tr <= r1; ++tr) {
            const int cls = th[(long long)tr * nTc + tc];
            if (cls == TILE_EMPTY) continue;
            const int row0 = tr * BR;
            __syncthreads();                            // the previous step is fully consumed
            if (!loaded) {                              // K_j, V_j: once per outer step
                load_rows<BC, D, THREADS>(sK, Kb, k_sm, col0, Nk, d);
                load_rows<BC, D, THREADS>(sV, Vb, v_sm, col0, Nk, d);
                loaded = true;
            }
            load_rows<BR, D, THREADS>(sQ, Qb, q_sm, row0, Nq, d);
            __syncthreads();

            // S = scale * Q_i K_j^T (this warp's rows x keys), masked
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
            if (!SPLIT_Q) {                             // split-K: the warps agree on each row's max
                if (lane == 0)
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) sRed[warp * BR + r] = mx[r];
                __syncthreads();                        // also: every warp is done reading sQ
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
                    for (int w = 0; w < WARPS; ++w) mx[r] = fmaxf(mx[r], sRed[w * BR + r]);
            }
            // P~ = exp(S - m~), l~ = rowsum(P~) (undropped), P~ V with P~ dropped out
            float* myP = sP + warp * ROWS * LDP;
            float rs[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float m_use = mx[r] == NEG_INF ? 0.0f : mx[r];
                float rowsum = 0.0f;
#pragma unroll
                for (int c = 0; c < CPL; ++c) {
                    const float p = expf(s[r][c] - m_use);
                    rowsum += p;
                    myP[r * LDP + lane + 32 * c] = p;
                }
                rs[r] = warp_sum(rowsum);
            }
            if (drop.threshold) {
#pragma unroll 1
                for (int e = 0; e < ROWS * CPL; ++e) {
                    const int r = e / CPL, c = e % CPL;
                    float* pp = &myP[r * LDP + lane + 32 * c];
                    dropout_fwd<R>(pp, drop, pm, bh, Nq, Nk, row0 + wrow + r, col0 + wcol + 32 * c, lane);
                }
            }
            __syncwarp();
            float acc[ROWS][DPL];
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int u = 0; u < DPL; ++u) acc[r][u] = 0.0f;
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
            // this step's (m~, l~, P~ V) per row into sM, sL, sO
            if (SPLIT_Q) {                              // the warp's own rows of sQ, read by it alone
                __syncwarp();
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                    for (int u = 0; u < DPL; ++u) sO[(wrow + r) * LD + lane + 32 * u] = acc[r][u];
                    if (lane == 0) { sM[wrow + r] = mx[r]; sL[wrow + r] = rs[r]; }
                }
                __syncwarp();
            } else {                                    // add the warps' partials in warp order
                for (int e = threadIdx.x; e < BR * LD; e += THREADS) sO[e] = 0.0f;
                for (int e = threadIdx.x; e < BR; e += THREADS) sL[e] = 0.0f;
                for (int w = 0; w < WARPS; ++w) {
                    __syncthreads();
                    if (warp == w) {
#pragma unroll
                        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                            for (int u = 0; u < DPL; ++u) sO[r * LD + lane + 32 * u] += acc[r][u];
                            if (lane == 0) { sL[r] += rs[r]; if (w == 0) sM[r] = mx[r]; }
                        }
                    }
                }
                __syncthreads();
            }
            // O_i, l_i, m_i <- HBM, fold in the step, -> HBM (Algorithm 1, lines 11-13)
            const int rfirst = SPLIT_Q ? wrow : warp, rstep = SPLIT_Q ? 1 : WARPS;
            const int rend = SPLIT_Q ? wrow + ROWS : BR;
            for (int r = rfirst; r < rend; r += rstep) {
                const int i = row0 + r;
                const float mt = sM[r];
                // nothing visible in this tile. NaN is not a dead row: only an exactly zero sum is (fmaxf
                // drops NaN, so a tile whose visible scores are all NaN has max -inf and sum NaN)
                if (i >= Nq || sL[r] == 0.0f) continue;
                const float m_old = Mb[i], l_old = Lb[i];
                const float m_new = fmaxf(m_old, mt);
                const float a = expf(m_old - m_new), bt = expf(mt - m_new);
                const float l_new = a * l_old + bt * sL[r];
                const float inv = 1.0f / l_new;
                float* o = Ob + (long long)i * d;
                for (int c = lane; c < d; c += 32) o[c] = (l_old * a * o[c] + bt * sO[r * LD + c]) * inv;
                __syncwarp();                           // every lane has read m_old, l_old
                if (lane == 0) { Mb[i] = m_new; Lb[i] = l_new; }
            }
        }
    }
    __syncthreads();                                    // the last step's m, l are in HBM
    for (int i = threadIdx.x; i < Nq; i += THREADS)
        LSE[(long long)bh * Nq + i] = Lb[i] == 0.0f ? NEG_INF : Mb[i] + logf(Lb[i]);   // NaN is not a dead row: only an exactly zero sum is
}

// FA1 Algorithm 4: one block per (batch, K/V head) walks every K/V tile; dQ read-modified-written.
template <int D, int BR, int BC, int WARPS, int R>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fa1_backward(const float* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
             const float* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
             const float* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
             const float* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
             const float* __restrict__ LSE, const float* __restrict__ Dv,                    // [B, Hq, Nq]
             float* __restrict__ dQ, float* __restrict__ dK, float* __restrict__ dV,         // dQ zeroed
             const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
             int tile_heads, int Hq, int Hkv, int group, int Nq, int Nk, int d, float scale,
             MASK_PARAMS, DROPOUT_PARAMS, PACKED_PARAMS) {
    int c0, c1;
    band_tiles(0, Nq - 1, band_lo, band_hi, Nk, BC, c0, c1);
    for (int tc = c0; tc <= c1; ++tc)
        kv_tile_backward<D, BR, BC, WARPS, DQ_OWNED, R>(
            tc, Q, q_sb, q_sh, q_sm, K, k_sb, k_sh, k_sm, V, v_sb, v_sh, v_sm, dO, do_sb, do_sh, do_sm,
            LSE, Dv, dQ, dK, dV, tiles, tile_heads, Hq, Hkv, group, Nq, Nk, d, scale,
            band_lo, band_hi, layout, layout_heads, mask_bq, mask_bk, mask_nbq, mask_nbk,
            drop_threshold, drop_inv_keep, drop_seed, drop_offset, PACKED_ARGS);
}
