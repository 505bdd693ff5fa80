// fa3_bwd.cu: the backward on warpgroup MMA (wgmma, sm_90a), fp16 / bf16, fp32 accumulation.
//
// Seed: FA2 paper (002) Algorithm 2 (column-parallel: one block per K/V tile, P recomputed from the
// logsumexp, D = rowsum(dO o O) precomputed, dQ accumulated with fp32 atomics) with the GEMMs on
// wgmma as in FA3 paper Sec. 3 (its backward keeps the same five GEMMs). fa2_tc_bwd.cu is the
// mma.sync rung below: the same work list, masks, dropout replay and epilogue; here each warpgroup
// owns 64 keys of the BC = 128 key tile and issues
//   S^T = K_j Q_i^T, dP^T = V_j dO_i^T          (A: its K / V rows, B: Q / dO, both K-major)
//   dV_j += P_drop^T dO_i, dK_j += dS^T Q_i      (A: the S^T / dS^T registers, B: dO / Q MN-major)
//   dQ_i += dS_ij K_j over its own 64 keys       (A: dS^T through shared memory, read MN-major;
//                                                 B: K MN-major), added to dQ with float4 atomics,
// so the two warpgroups' dQ partials (their key halves) both go to memory: twice the atomics of one
// dQ per tile, no block barrier between the dS^T stores and the dQ GEMM (a warpgroup reads only
// the dS^T rows it wrote: one named barrier of 128 threads).
// Copies: cp.async into hopper.cuh's swizzled panels; the next Q tile's Q, dO, lse and D land in a
// second buffer while this one is computed (fa2_tc_bwd.cu's pipeline).
//
// Kernel
//   fa3_bwd<T, D, R, DROPOUT>   grid (ceil(Nk / 128), B*Hkv), 256 threads, BR = 64 query rows per tile.
// Envelope: D in {64, 128}; sm_90a. The deterministic dQ stays fa2_tc_bwd_dq's (variants/fa3_wgmma.py).
#include "tc_softmax.cuh"
#include "hopper.cuh"

#define LOG2E_F 1.4426950408889634f

// ---- kernels

template <typename T, int D, int R, bool DROPOUT>
__global__ void __launch_bounds__(256, 1)
fa3_bwd(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
        const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
        const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
        const T* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
        const float* __restrict__ LSE,      // [B, Hq, Nq]
        const float* __restrict__ Dv,       // [B, Hq, Nq] rowsum(dO o O)
        float* __restrict__ dQ,             // [B, Hq, Nq, d] fp32, zeroed
        T* __restrict__ dK,                 // [B, Hkv, Nk, d] contiguous
        T* __restrict__ dV,                 // [B, Hkv, Nk, d] contiguous
        const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
        int tile_heads, int Hq, int Hkv, int group, int Nq, int Nk, int d,
        float scale, MASK_PARAMS, DROPOUT_PARAMS) {
    constexpr int THREADS = 256, BR = 64, BC = 128;
    constexpr int NQ = BR / 8, ND = D / 8;
    static_assert(D == 64 || D == 128, "head dim padded to 64 or 128");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned sK = (smem_addr(smem_raw) + 1023u) & ~1023u;   // [D/64][BC][64] panels
    const unsigned sV = sK + BC * D * 2;
    const unsigned sQ = sV + BC * D * 2;                            // [2][D/64][BR][64]
    const unsigned sdO = sQ + 2 * BR * D * 2;                       // [2][D/64][BR][64]
    const unsigned sdS = sdO + 2 * BR * D * 2;                      // [BC][BR]: dS^T, one panel (BR = 64)
    constexpr unsigned QBUF = BR * D * 2;
    float* sL = reinterpret_cast<float*>(smem_raw + (sdS + BC * BR * 2 - smem_addr(smem_raw)));   // [2][BR] lse (log2)
    float* sD = sL + 2 * BR;                                                                      // [2][BR]

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4, wg = warp / 4;
    const int tc = blockIdx.x, bhk = blockIdx.y, b = bhk / Hkv, hk = bhk % Hkv;
    const int col0 = tc * BC, wkey = warp * 16, dch = d / 8;     // the warp's 16 keys of the tile
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC;
    const float scale_log2 = scale * LOG2E_F;
    const unsigned k_rows = sK + wg * 64 * 128, v_rows = sV + wg * 64 * 128;   // this warpgroup's 64 keys (A)

    load_panels_async<BC, D, THREADS>(sK, K + b * k_sb + hk * k_sh, k_sm, col0, Nk, dch);
    load_panels_async<BC, D, THREADS>(sV, V + b * v_sb + hk * v_sh, v_sm, col0, Nk, dch);
    cp_async_commit();

    float dk[1][ND][4], dv[1][ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[0][n][e] = dv[0][n][e] = 0.0f;
    int t0, t1;
    band_row_tiles(col0, min(col0 + BC, Nk) - 1, band_lo, band_hi, Nq, BR, t0, t1);

    // The work list: Q tiles t0..t1 of every query head of the group, EMPTY tiles skipped.
    auto cls_of = [&](int gi, int t) {
        return (int)tiles[((long long)(tile_heads == 1 ? 0 : hk * group + gi) * nTr + t) * nTc + tc];
    };
    auto advance = [&](int& gi, int& t) {
        if (t0 > t1) return false;
        do {
            if (++t > t1) { t = t0; if (++gi >= group) return false; }
        } while (cls_of(gi, t) == TILE_EMPTY);
        return true;
    };
    auto issue = [&](int gi, int t, int buf) {
        const int h = hk * group + gi, bh = b * Hq + h, row0 = t * BR;
        load_panels_async<BR, D, THREADS>(sQ + buf * QBUF, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, dch);
        load_panels_async<BR, D, THREADS>(sdO + buf * QBUF, dO + b * do_sb + h * do_sh, do_sm, row0, Nq, dch);
        for (int x = threadIdx.x; x < BR; x += THREADS) {
            const int i = row0 + x;
            sL[buf * BR + x] = i < Nq ? LSE[(long long)bh * Nq + i] * LOG2E_F : NEG_INF;
            sD[buf * BR + x] = i < Nq ? Dv[(long long)bh * Nq + i] : 0.0f;
        }
    };

    int gi = 0, t = t0 - 1, buf = 0;
    bool have = advance(gi, t);
    if (have) issue(gi, t, 0);
    cp_async_commit();                                // K, V and the first Q / dO tile
    while (have) {
        const int cgi = gi, ct = t, cbuf = buf;
        have = advance(gi, t);
        cp_async_wait<0>();
        fence_proxy_async();                          // the copies are read by the tensor cores next
        __syncthreads();                              // this tile landed; every warpgroup is done with the last
        if (have) issue(gi, t, buf ^ 1);
        cp_async_commit();
        buf ^= 1;

        const int h = hk * group + cgi, bh = b * Hq + h, cls = cls_of(cgi, ct), row0 = ct * BR;
        const unsigned q_tile = sQ + cbuf * QBUF, do_tile = sdO + cbuf * QBUF;
        const float* cL = sL + cbuf * BR;
        const float* cD = sD + cbuf * BR;
        float s[1][NQ][4], dp[1][NQ][4];
        wgmma_fence();
        wg_gemm_qk<T, D, BR, BC>(s[0], k_rows, q_tile);      // S^T: this warpgroup's 64 keys x 64 queries
        wgmma_commit();
        wg_gemm_qk<T, D, BR, BC>(dp[0], v_rows, do_tile);    // dP^T = V dO^T
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(s[0]);
        fence_accumulators(dp[0]);
        const bool masked = cls != TILE_FULL || col0 + BC > Nk || row0 + BR > Nq;
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int x = n * 8 + 2 * tq + (e & 1), i = row0 + x;     // query
                const int j = col0 + wkey + g + (e >= 2 ? 8 : 0);         // key
                const float L = cL[x];
                const bool vis = L != NEG_INF && (!masked || (i < Nq && j < Nk && (cls == TILE_FULL || mask.visible(h, i, j))));
                const float p = vis ? exp2_ftz(s[0][n][e] * scale_log2 - L) : 0.0f;
                float f = 1.0f;                       // Z / (1 - p) of element (i, j)
                if (DROPOUT && vis) f = dropout_factor(drop, word_of(dropout_words<R>(drop, bh, i, j >> 2), j & 3));
                s[0][n][e] = p * f;                   // P_drop^T (dV's A operand)
                dp[0][n][e] = p * (dp[0][n][e] * f - cD[x]);   // dS^T = P o (dP Z / (1 - p) - D)
            }
        unsigned pa[BR / 16][4], pd[BR / 16][4];
        p_operands<T>(pa, s);
        p_operands<T>(pd, dp);
        wgmma_fence();
        wg_gemm_pv<T, D, BR>(dv[0], pa, do_tile);     // dV += P_drop^T dO
        wg_gemm_pv<T, D, BR>(dk[0], pd, q_tile);      // dK += dS^T Q (scaled at the end)
        wgmma_commit();

        // dS^T (16-bit) into its panel: key row r, query c at r * 128 + ((c / 8) ^ (r % 8)) * 16 + (c % 8) * 2
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = wkey + g + 8 * hr, c = n * 8 + 2 * tq;
                const unsigned addr = sdS + r * 128 + (((c / 8) ^ (r % 8)) << 4) + (c % 8) * 2;
                asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(Elem<T>::pack(dp[0][n][2 * hr], dp[0][n][2 * hr + 1])));
            }
        fence_proxy_async();
        named_sync(1 + wg, 128);                      // this warpgroup's 64 dS^T rows are written

        // dQ (64 queries x D) += dS[:, my keys] K[my keys, :]: A = dS^T rows of this warpgroup read
        // MN-major (queries contiguous), B = K rows MN-major (d contiguous); k16 steps 16 keys apart
        float dq[1][ND][4];
        const unsigned long long dq_a = wgmma_desc(sdS + wg * 64 * 128, 1024, 1024);
        const unsigned long long dq_b = wgmma_desc(sK + wg * 64 * 128, BC * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            Wgmma<T, D, true>::ss_ta(dq[0], wgmma_desc_at(dq_a, kk * 2048), wgmma_desc_at(dq_b, kk * 2048), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();                              // dV, dK and dQ of this tile done
        fence_accumulators(dq[0]);
        fence_accumulators(dk[0]);
        fence_accumulators(dv[0]);
        // rows (queries) of this warp: 16 (warp % 4) + g (+ 8), added by float4 atomics (tc_softmax.cuh)
        const bool odd = tq & 1;
        const int i = row0 + (warp % 4) * 16 + g + (odd ? 8 : 0);
        float* row = dQ + ((long long)bh * Nq + min(i, Nq - 1)) * d + 4 * (tq / 2);
        add_dq_tiles(dq[0], row, 0, i < Nq, d, tq, scale);
    }
    cp_async_wait<0>();

    // dK = scale dS^T Q, dV: this warp's 16 keys
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int j = col0 + wkey + g + 8 * hr;
        if (j >= Nk) continue;
        T* krow = dK + ((long long)bhk * Nk + j) * d;
        T* vrow = dV + ((long long)bhk * Nk + j) * d;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            const int c = n * 8 + 2 * tq;
            if (c < d) {
                *reinterpret_cast<unsigned*>(krow + c) = Elem<T>::pack(dk[0][n][2 * hr] * scale, dk[0][n][2 * hr + 1] * scale);
                *reinterpret_cast<unsigned*>(vrow + c) = Elem<T>::pack(dv[0][n][2 * hr], dv[0][n][2 * hr + 1]);
            }
        }
    }
}
