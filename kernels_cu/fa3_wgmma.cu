// fa3_wgmma.cu: the first Hopper rung: FlashAttention-2's forward (fa2_tc.cu) with both GEMMs on
// warpgroup MMA (wgmma.mma_async, sm_90a) instead of mma.sync; fp16 / bf16 in, fp32 accumulation.
//
// Seed: FA3 paper (Shah et al. 2024) Sec. 3.1, its first ingredient only: each warpgroup (4 warps,
// 64 query rows) issues S = Q K^T with Q and K read by the tensor cores straight from shared memory
// (no ldmatrix into registers), and O += P V with P kept in registers as the A operand; the
// accumulators stay in the mma.m16n8k16 C layout, so the mask, online softmax, dropout and epilogue
// are fa2_tc.cu's (tc_softmax.cuh, FA2 paper Algorithm 1, Sec. 3.1). Loads are still cp.async by every
// thread, one tile ahead as in fa2_tc.cu (STAGES = 2): V_j's copy flies during S = Q K_j^T, K_{j+1}'s
// during the softmax and P V_j. TMA, warp specialization and ping-pong are the rungs after this one.
//
// Kernel
//   fa3_wgmma_forward<T, D, BC, WG, R, DROPOUT>   grid (ceil(Nq / (64 WG)), B*Hq), 128 WG threads
//       WG warpgroups each own 64 rows of the Br = 64 WG row tile and every key of a Bc tile. Q, K, V
//       tiles in the 128-byte-swizzled panels of hopper.cuh (D / 64 panels of [rows][64]).
//       One block per SM by construction (__launch_bounds__(threads, 1)): Bc = 128 keeps 64 S and
//       D / 2 O accumulators per thread. Wide heads take FA3's smaller key tiles (variants/fa3_wgmma.py
//       AUTO_BC): D = 192, Bc = 112 (96 O + 56 S + 28 P registers); D = 256, Bc = 80 (128 + 40 + 20).
// Masks, dropout, GQA, dead rows, any Nq / Nk: as fa2_tc.cu (the host's tile table, the band, the
// element predicate in partial tiles, the contract's Philox counters). Score and mask modifiers: as
// fa2_tc.cu (tc_mods.cuh, compiled in by -D switches; none: the kernel without them).
// Envelope (static_asserts; ValueError in variants/fa3_wgmma.py): D in {64, 128, 192, 256} (d <= D, a
// multiple of 8, zero-filled), Bc in {64, 80, 112, 128, 192}, WG in {1, 2, 3}, shared memory and (D > 128)
// registers checked on the host; an sm_90 GPU (the sm_90a target).
#include "tc_softmax.cuh"
#include "tc_mods.cuh"
#include "hopper.cuh"

// ---- kernels

template <typename T, int D, int BC, int WG, int R, bool DROPOUT>
__global__ void __launch_bounds__(WG * 128, 1)
fa3_wgmma_forward(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,  // [B, Hq, Nq, d]
                  const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,  // [B, Hkv, Nk, d]
                  const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,  // [B, Hkv, Nk, d]
                  T* __restrict__ O,                        // [B, Hq, Nq, d] contiguous
                  float* __restrict__ LSE,                  // [B, Hq, Nq]
                  const signed char* __restrict__ tiles,    // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
                  int tile_heads, int Hq, int group, int Nq, int Nk, int d,
                  float scale_log2,                         // to log2 units, > 0: |scale| log2 e (tc_mods.cuh: modifiers)
                  MASK_PARAMS, DROPOUT_PARAMS MOD_PARAMS) {   // MOD_PARAMS: modifiers only (tc_mods.cuh)
    constexpr int THREADS = WG * 128, BR = WG * 64;
    constexpr int NT = BC / 8, ND = D / 8;
    static_assert(D == 64 || D == 128 || D == 192 || D == 256, "head dim padded to 64, 128, 192 or 256");
    static_assert(BC == 64 || BC == 80 || BC == 112 || BC == 128 || BC == 192, "wgmma n = Bc");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // panels must sit on 1024-byte boundaries (the swizzle pattern repeats every 8 rows of 128 bytes);
    // the host adds 1024 bytes of slack
    const unsigned sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned sK = sQ + BR * D * 2, sV = sK + BC * D * 2;

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int wg = warp / 4;                      // this thread's warpgroup: rows 64 wg .. 64 wg + 63
    const int tr = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y,    // last Q tiles first (causal's long rows)
              b = bh / Hq, h = bh % Hq, hk = h / group;
    const int row0 = tr * BR, nTc = (Nk + BC - 1) / BC, dch = d / 8;
    const int wrow = warp * 16;                   // the warp's first row in the tile (wgmma: 16 rows per warp)
    const T* Kb = K + b * k_sb + hk * k_sh;
    const T* Vb = V + b * v_sb + hk * v_sh;
#ifdef FA_MODS
    const signed char* trow = tiles + (mod_tile_index(mod_tile_b, tile_heads, b, h) * gridDim.x + tr) * nTc;
#else
    const signed char* trow = tiles + ((long long)(tile_heads == 1 ? 0 : h) * gridDim.x + tr) * nTc;
#endif
    int t, t1;
    band_tiles(row0, min(row0 + BR, Nq) - 1, band_lo, band_hi, Nk, BC, t, t1);
    t = next_live_tile(trow, t, t1);

    load_panels_async<BR, D, THREADS>(sQ, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, dch);
    if (t <= t1) load_panels_async<BC, D, THREADS>(sK, Kb, k_sm, t * BC, Nk, dch);
    cp_async_commit();

    float o[1][ND][4], m[1][2], l[1][2];
    zero_state(o, m, l);
#ifdef FA_DIST_BIAS
    const float slope = dist_slope_raw(b, h, MOD_FN_ARGS);   // tc_mods.cuh: the bias seeds S
#endif

    while (t <= t1) {
        const int col0 = t * BC;
        cp_async_wait<0>();
        fence_proxy_async();                          // the copies are read by the tensor cores next
        __syncthreads();                              // K_t (and Q) landed; every warpgroup is done with V_{t-1}
        load_panels_async<BC, D, THREADS>(sV, Vb, v_sm, col0, Nk, dch);
        cp_async_commit();

        // S = Q K_t^T (fp32): this warpgroup's 64 rows x BC keys
        float s[1][NT][4];
#ifdef FA_DIST_BIAS
        seed_scores(s, slope, row0 + wrow, col0, g, tq);
#endif
        wgmma_fence();
        wg_gemm_qk<T, D, BC, BR, FA_SEED_S>(s[0], sQ + wg * 64 * 128, sK);
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(s[0]);
        __syncthreads();                              // every warpgroup is done reading K_t
        const int next = next_live_tile(trow, t + 1, t1);
        if (next <= t1) load_panels_async<BC, D, THREADS>(sK, Kb, k_sm, next * BC, Nk, dch);
        cp_async_commit();                            // (an empty group keeps the wait counts fixed)

        // mask (partial tiles only), online softmax on raw scores, dropout (tc_softmax.cuh)
        const int cls = trow[t];
#ifdef FA_MODS
        // modifiers (tc_mods.cuh): as fa2_tc.cu, on the same C layout
        mod_scores<FA_SEED_S>(s, cls == TILE_FULL && col0 + BC <= Nk && row0 + BR <= Nq, cls, mask, b, h,
                   row0 + wrow, col0, Nq, Nk, g, tq, MOD_FN_ARGS);
#else
        if (cls != TILE_FULL || col0 + BC > Nk) mask_scores(s, cls, mask, h, row0 + wrow, col0, Nq, Nk, g, tq);
#endif
        online_softmax<DROPOUT>(s, m, l, o, scale_log2);
        if (DROPOUT) apply_dropout<R>(s, drop, bh, row0 + wrow, col0, g, tq);
        unsigned pa[BC / 16][4];
        p_operands<T>(pa, s);

        cp_async_wait<1>();                           // V_t landed (K_{t+1} may still be in flight)
        fence_proxy_async();
        __syncthreads();
        wgmma_fence();
        wg_gemm_pv<T, D, BC>(o[0], pa, sV);           // O += P V_t, P from registers
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(o[0]);
        t = next;
    }
    cp_async_wait<0>();                               // nothing may land after the block exits

#ifdef FA_MODS
    fold_sinks(o, m, l, mod_sink, h, tq);             // attention sinks join the denominator (FA_SINKS only)
#endif
    write_output<T>(o, m, l, O, LSE, bh, row0 + wrow, Nq, d, g, tq);
}
