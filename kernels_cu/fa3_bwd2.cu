// fa3_bwd2.cu: the second wgmma backward (issue 17 step 6), fp16 / bf16, fp32 accumulation, sm_90a.
//
// Seed: FA2 paper (002) Algorithm 2 (column-parallel, P recomputed from the logsumexp, D = rowsum(dO o O)
// precomputed, dQ accumulated in fp32 across the key blocks) with its five GEMMs on wgmma (FA3 paper
// Sec. 3). The rung below is fa3_bwd.cu (bwd_kernel="wgmma"): the same tile (BC = 128 keys per block,
// 64 per warpgroup, BR = 64 query rows per step (128 at D = 64: change 4), 256 threads, 1 block per SM), work list, masks,
// dropout replay, double buffer of Q / dO / lse / D (cp.async there; TMA and bulk copies here since session 10,
// change 3) and dK / dV epilogue. What changes:
//
// 1. dQ: both warpgroups' dS^T rows go to one shared panel (a 256-thread named barrier), and at D = 128
//    dQ (64 queries x 128) = dS (64 x 128 keys) K (128 x 128) is split along its columns: warpgroup w
//    computes the 64 columns of K panel w over all 128 keys (m64n64, A = dS^T read MN-major, B = K
//    MN-major). At D = 64 (one panel; an n32 half-panel operand was not tried) each warpgroup computes the
//    64 x 64 partial over its own 64 keys, warpgroup 1 stages it in shared memory and warpgroup 0 adds it
//    to its own (a 256-thread arrive / sync), so there too one partial leaves the block. No branch on
//    the warpgroup encloses a wgmma: ptxas serializes every wgmma of a kernel where one does (C7519).
//    One fp32 partial per element per block and Q tile instead of two, and no per-thread atomics: a
//    warpgroup writes its 64 x 64 fp32 block into shared memory in accumulator order (thread t's n8 tile
//    n at (n * 128 + t) * 16 bytes: consecutive threads, consecutive 16 bytes, no bank conflict), and
//    one thread adds the 16 KB to global memory with one bulk reduction
//    (cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32; PTX ISA 8.0, sm_90), issued right after
//    the next tile's first block barrier (which publishes the staging, fenced for the async proxy) and
//    double-buffered per warpgroup: the issuing thread commits one bulk group per tile (empty where there is
//    no block) and, before the dS^T barrier that precedes the staging writes, waits until all but the latest
//    have read their buffers (bulk_wait_read<1>: the reduction of the other buffer may still run). (Until
//    session 10 it waited at the loop head, a tile earlier: ptxas counts bulk groups on cp.async's scoreboard,
//    and the loop's lse / D cp.async wait sat there.) The fp32
//    accumulator in global memory is in that accumulator order, [B*Hq][ceil(Nq / 64)][D / 64][8][128][4]
//    floats, and a small second kernel (fa3_bwd2_dq) turns it into dq in q's dtype (scaled, rows < Nq,
//    columns < d): the cast that the atomic backwards run after them anyway. (FA3's hopper/ backward
//    does its dQ the same way: a per-warpgroup bulk reduction of an accumulator-ordered buffer and a
//    post-processing kernel.) Traffic per block and Q tile at D = 128: 32 KB of reductions in 2 bulk
//    operations, was 64 KB in 4096 float4 atomics (issue 17: about 8.6 GB of atomics per backward at
//    B*H = 64, N = 4096); at D = 64, 16 KB in 1, was 32 KB.
// 2. Overlap (the GEMMs are asynchronous; each wait is where a result or a buffer is needed):
//      S^T, dP^T issued as two groups (the dropout keep mask, 32 Philox calls, computed under them);
//      wait<1>: S^T done, P = exp2(S scale - lse) computed while dP^T runs (two copies of that loop: full
//      tiles skip the mask's per-element branches); dV += P_drop^T dO issued at once (P in registers);
//      wait<1>: dP^T done, dS = P o (dP Z - D) while dV runs; dS^T stored; barrier; dQ issued, then
//      dK += dS^T Q; wait<1>: dQ done, staged while dK runs; dK is not waited for at the end of the tile
//      but runs under the next tile's block barrier and S^T / dP^T (its A operand is the dS^T panel, not
//      registers: an A operand in registers across the loop's back edge made ptxas wait and copy the next
//      S^T accumulators), completing by that tile's first wait; a 256-thread barrier there frees its Q
//      buffer for the copies of the tile after.
//    -DFA3_BWD2_SERIAL (SANDBOX_BWD2_SERIAL=1 in variants/fa3_backward.py) waits for every GEMM group as
//    soon as it is issued instead: changes 1 and 3 without 2, for measuring them apart.
// 3. Copies: lse and D of the next tile with Q and dO (fa3_bwd.cu loads them into registers and stores
//    them, which holds warps 0-1, so warpgroup 0's next wgmma, for a memory latency per tile), issued after
//    the first wait of the tile rather than before its GEMMs; by cp.async until session 10. Since then Q and dO come by
//    TMA (issue 17 step 3): thread 0 issues 64 x 64 boxes of 4-D tensor maps (d, Nq, Hq, B) into the swizzled
//    panels, completing on an mbarrier per buffer that every thread waits on at the loop head; rows >= Nq and
//    columns >= d are TMA's zero fill. Before, all 256 threads issued cp.async: ~290 instructions per thread
//    and tile and 13% of the stall samples (ncu, D = 128, N = 4k). Predicted +5-10% at D = 128; measured
//    (bench/results/h100/2026-11-26-session-10.md, same call) +3-4% non-causal, +5-6% causal at N = 4k-8k, and
//    +5-6% / +3% at D = 64, with ptxas splitting S^T (below). The next tile's class is looked up where its
//    load does not stall the warps and ptxas keeps S^T whole (the loop's comment; tests/test_fa3_bwd.py
//    checks the SASS): +5% more at D = 128. lse and D by two bulk copies on the same mbarrier, from rows that
//    fa3_bwd2_pre pads to whole 128-row tiles (16-byte aligned), and the reduction's wait moved mid-tile
//    (change 1): +0-4% more. The d = 128 backward, N = 4k, non-causal: 433 -> 488 TFLOP/s over the four.
// Predicted (H100, B = 4, H = 16, N = 4096, d = 128, fp16, non-causal; backward alone ~200 TFLOP/s with
// fa3_bwd.cu, which the ncu profile of session 4 shows latency-bound: 0.27 instructions per scheduler-cycle,
// no eligible warp 73% of cycles, L2 57% busy with the atomics, spills in its loop; ~6.7 us per Q tile
// where the tensor cores need ~1.5 us and shared memory ~1.7 us (S^T, dP^T, dQ are m64n64 with both
// operands in shared memory: ~128 B/clk, the SM's whole bandwidth)):
//   changes 1 + 3 alone (-DFA3_BWD2_SERIAL): 260-300 TFLOP/s (+30-50%: no atomics from the LSU and half
//   the reduction traffic, no spills, no register loads of lse / D);
//   change 2 on top (the default build): 290-350 TFLOP/s (+10-20% more: the exponentials, about a fifth
//   of a tile's tensor time, dS, the dQ staging and the tile boundary run under GEMMs).
//   fwd + bwd from torch: ~245 -> 340-390 TFLOP/s (cuDNN 534: 0.65-0.73x). Causal about the same ratios;
//   d = 64 +30-50% (twice d = 128's element-wise work per FLOP at BR = 64: it stays further from cuDNN).
// Measured: bench/results/h100/ (session 5 on). Profile at D = 128 (2026-11-26-session-9.md, N = 4k, non-causal):
// 438 TFLOP/s against cuDNN's 552; tensor pipe 48% busy, 2 active warps per scheduler with 0.56 eligible, no
// eligible warp 61% of cycles, no spill traffic: latency-bound at eight warps per SM. fa3_bwd2_dq, the D
// preprocessing and the accumulator's memset are 3-5% of the backward.
//
// 4. BR = 128 query rows per step at D = 64 without dropout (FA3's hdim-64 tile,
//    128 x 128; variants/fa3_backward.py rows2). Each warpgroup's S^T and dP^T are m64n128 (at m64n64 with
//    both operands in shared memory a wgmma needs the SM's whole 128 B/clk: every step was bound by shared
//    memory), each warpgroup's dQ block is whole (64 queries x 64 over all 128 keys, from dS^T panel wg), so
//    the partial exchange of BR = 64 goes, and the barriers and waits per FLOP halve. Per 128 queries the
//    shared-memory traffic drops from ~480 KB to ~384 KB. The visibility of a masked tile is taken as bits
//    under the GEMMs (VIS_BITS), which is what made it fit in 255 registers (251, no spills, NVRTC 13).
//    Predicted (H100, fp16, d = 64, N = 4k-16k, B H = 64): backward +15-25% over BR = 64 non-causal (about
//    300 -> 350-380 TFLOP/s), less causal; forward + backward from 0.70-0.79x cuDNN to 0.78-0.85x.
//    Measured (bench/results/h100/2026-11-26-session-8.md, same run, N = 2k-16k): backward +25-38% (267-302 ->
//    354-400 TFLOP/s non-causal, 213-298 -> 267-408 causal), forward + backward 0.90-0.97x cuDNN: more than
//    predicted (not profiled; the count above leaves out the partial exchange's wait and the per-step costs).
//
// 5. (session 20) BR = 128 with a score modifier's text at D = 64 too: it had spilled (524 bytes, the soft-cap), so
//    such modules ran BR = 64. chain_rows (below) orders the modifier loop's row blocks; full tiles evaluate the
//    modifier without the per-element branch. Predicted: the text path gains what plain attention gained from
//    BR = 128 (-20-28% time). Measured (H100, fp16, causal, B N = 16k, same run, the old build beside the new):
//    soft-cap 2.99 -> 2.42 ms at N = 4k, 5.40 -> 4.25 at 8k (over plain causal +53% -> +24%); relative bias
//    3.07 -> 2.39, 5.47 -> 4.13; at D = 128 (BR = 64, only the branch-free full tiles) -1.5% and -4%.
//
// Score modifiers (issue 18; variants/fa3_backward.py backward_mods): a distance bias (ALiBi) seeds S^T as the
// forward seeds S; any other score modifier with a derivative compiles its text (tc_mods.cuh FA_SCORE_MOD,
// FA_SCORE_MOD_GRAD) into the exponent's loop, where S becomes P mod' after P went into dV's operand; sinks
// need nothing (P comes from lse). A mask modifier (FA_MASK_MOD): the host folds its tile classes into the
// tile table ([mod_tile_b x tile_heads] rows, as the forward's), so the work list skips its empty tiles and
// full tiles skip the predicate; partial tiles evaluate mod_visible per element (as visibility bits under
// the GEMMs at BR = 128).
//
// Kernels
//   fa3_bwd2<T, D, BR, R, DROPOUT>  grid (ceil(Nk / 128), B*Hkv), 256 threads: dK, dV, and dQacc += dS K;
//                                   BR = 64, or 128 at D = 64 without dropout (change 4).
//   fa3_bwd2_pre<T>              grid (ceil(Nq / 128) 2, B*Hq), 256 threads, before fa3_bwd2: D = rowsum(dO o O) and
//                                lse in padded rows, dQacc zeroed (one launch for fa2-tc's rowdot kernel and a memset).
//   fa3_bwd2_dq<T>               grid (ceil(Nq / 64), B*Hq), 256 threads: dq = scale * dQacc in T (the host's scale
//                                times a factored modifier's post pre: variants/fa3_backward.py dq_scale).
// Envelope: D in {64, 128}; sm_90a. Not deterministic (reduction order); the deterministic dQ stays
// fa2-tc's (variants/fa3_wgmma.py).
// Shared memory (bytes, variants/fa3_backward.py smem2): K, V 2 * 128 D * 2; Q, dO two buffers each
// 4 * BR D * 2; dS^T 128 * BR * 2; dQ staging 2 warpgroups * 2 * 16384; lse, D 4 * BR * 4; two mbarriers 16;
// 1024 of alignment: 215056 at D = 128, 199696 at D = 64 (BR = 128), 149520 at D = 64 with dropout (BR = 64).
// Compile report (NVRTC 13.5, sm_90a, fp16): D = 128 245 registers (254 with dropout), D = 64 249 (BR = 128;
// 226 with dropout at BR = 64; the soft-cap's text 250 at BR = 128), no spills, no wgmma serialized (ptxas C7515 /
// C7519); fa3_bwd2_dq 26, fa3_bwd2_pre 40.
#include "tc_softmax.cuh"
#include "tc_mods.cuh"
#include "hopper.cuh"
#if defined(FA_SCORE_MOD) && !defined(FA_SCORE_MOD_GRAD)
#error "fa3_bwd2.cu takes score modifiers with their derivative (or a distance bias), sinks and mask modifiers"
#endif

#define LOG2E_F 1.4426950408889634f

// FA_SCORE_FACTORED (sandbox/modifiers.py cuda_defines, a modifier with cuda_factored_grad): score_mod and
// score_mod_grad are the factored core and its derivative, mod(x) = post core(pre x), mod'(x) = post pre
// core'(pre x), and the factors come as three more arguments, so that a modifier such as the soft-cap needs no
// buffer load per element (ptxas keeps none of them in registers across the loop's wgmma fences). FACTORED_PARAMS,
// bwd_ds_scale and the FA_TANH_CORE vote (bwd_core_small) are tc_mods.cuh's, shared with fa2_tc_bwd.cu.

#ifdef FA3_BWD2_SERIAL
#define BWD2_SERIAL true
#else
#define BWD2_SERIAL false
#endif

// chain_rows (BR = 128 with a score modifier's text): the next row block's four scores get an OR with this block's
// results (its four P mod' and two packed P words) times a runtime zero, so that none of the next block's work, its
// MUFU operations included, can issue before this block's results exist. Without it ptxas issued every element's
// MUFU operations first and kept each P beside its derivative until the products and packs at the end (sunk past the
// three copies of the loop): up to 64 values more than the loop needs, 524 bytes of spills for the soft-cap (NVRTC
// 13.5), and 64 query rows per step instead of 128. With it: 250 registers, no spills; 2-3 ALU operations per element
// more.
__device__ __forceinline__ void chain_rows(const float (&done)[4], unsigned pa0, unsigned pa1, float (&next)[4],
                                           unsigned zero) {
    const unsigned z = (pa0 | pa1 | __float_as_uint(done[0]) | __float_as_uint(done[1]) | __float_as_uint(done[2]) |
                        __float_as_uint(done[3])) & zero;
#pragma unroll
    for (int e = 0; e < 4; ++e) next[e] = __uint_as_float(__float_as_uint(next[e]) | z);
}

// ---- kernels

template <typename T, int D, int BR, int R, bool DROPOUT>
__global__ void __launch_bounds__(256, 1)
fa3_bwd2(const __grid_constant__ TmaDesc map_q,                                      // (d, Nq, Hq, B), box (64, 64)
         const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
         const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
         const __grid_constant__ TmaDesc map_do,                                     // (d, Nq, Hq, B), box (64, 64)
         const float* __restrict__ LSE,      // [B*Hq, NPAD]: lse, rows padded to NPAD = ceil(Nq / 128) 128 (fa3_bwd2_pre)
         const float* __restrict__ Dv,       // [B*Hq, NPAD]: rowsum(dO o O), the same padding
         float* __restrict__ dQacc,          // [B*Hq, ceil(Nq/64), 64 D] fp32 in accumulator order, zeroed (64-row tiles)
         T* __restrict__ dK,                 // [B, Hkv, Nk, d] contiguous
         T* __restrict__ dV,                 // [B, Hkv, Nk, d] contiguous
         const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
         int tile_heads, int Hq, int Hkv, int group, int Nq, int Nk, int d,
         float scale, MASK_PARAMS, DROPOUT_PARAMS MOD_PARAMS FACTORED_PARAMS) {   // with modifiers only (below)
    constexpr int THREADS = 256, BC = 128;
    constexpr int NQ = BR / 8, ND = D / 8;
    constexpr unsigned STAGE = 64 * 64 * 4;         // one warpgroup's 64 x 64 fp32 dQ block: 16 KB
    static_assert(D == 64 || D == 128, "head dim padded to 64 or 128");
    static_assert(BR == 64 || (BR == 128 && D == 64 && !DROPOUT), "BR = 128 only at D = 64 without dropout");
    // Who computes which dQ block (below): a warpgroup's block is 64 queries x 64 columns; SPLIT_KEYS (D = 64,
    // BR = 64): both warpgroups compute the one block over their own 64 keys and add the partials.
    constexpr bool SPLIT_KEYS = D == 64 && BR == 64;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned sK = (smem_addr(smem_raw) + 1023u) & ~1023u;   // [D/64][BC][64] panels
    const unsigned sV = sK + BC * D * 2;
    const unsigned sQ = sV + BC * D * 2;                            // [2][D/64][BR][64]
    const unsigned sdO = sQ + 2 * BR * D * 2;                       // [2][D/64][BR][64]
    const unsigned sdS = sdO + 2 * BR * D * 2;                      // [BR/64][BC][64]: dS^T, query panels
    const unsigned sdQ = sdS + BC * BR * 2;                         // [2 warpgroups][2][STAGE]: dQ staging
    constexpr unsigned QBUF = BR * D * 2;
    float* sL = reinterpret_cast<float*>(smem_raw + (sdQ + 4 * STAGE - smem_addr(smem_raw)));   // [2][BR] lse
    float* sD = sL + 2 * BR;                                                                          // [2][BR]
    const unsigned q_full = smem_addr(sD + 2 * BR);   // [2] mbarriers: Q and dO of buffer 0, 1 landed (TMA)

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4, wg = warp / 4;
    const int wt = threadIdx.x % 128;                             // thread of the warpgroup
    const int tc = blockIdx.x, bhk = blockIdx.y, b = bhk / Hkv, hk = bhk % Hkv;
    const int col0 = tc * BC, wkey = warp * 16, dch = d / 8;     // the warp's 16 keys of the tile
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC, nT64 = (Nq + 63) / 64, nPad = (Nq + 127) / 128 * 128;
    const float scale_log2 = scale * LOG2E_F;
#ifdef FA_SCORE_FACTORED
    const float scale_pre = scale * mod_pre;          // the factored core's argument: pre times the scaled score
#endif
    // dS's factor: the scale, times a factored modifier's post pre, applied in dK's epilogue (and, by the host, in
    // fa3_bwd2_dq's) instead of once per score
    const float ds_scale = bwd_ds_scale(scale FACTORED_ARGS);
    const float keep_factor = drop.threshold == 0u ? 1.0f : drop.inv_keep;   // dropout_factor of a kept element
    const unsigned k_rows = sK + wg * 64 * 128, v_rows = sV + wg * 64 * 128;   // this warpgroup's 64 keys (A)
#ifdef FA_MASK_MOD
    // With a mask modifier and one query head per block the walk ends at the last live Q tile, found 32 tiles at a
    // time (tiles.cuh last_live_tile) instead of by advance's serial scan, one dependent load per trailing EMPTY tile
    // (a document mask's later documents: the packed backward of sandbox/varlen.py); here, as in fa2_tc_bwd, where
    // few registers are live.
    int live_end;
    {
        int a, z;
        band_row_tiles(col0, min(col0 + BC, Nk) - 1, band_lo, band_hi, Nq, BR, a, z);
        const signed char* col = tiles + mod_tile_index(mod_tile_b, tile_heads, b, hk * group) * nTr * nTc + tc;
        live_end = group == 1 ? last_live_tile([col, nTc](int t) { return (int)col[(long long)t * nTc]; }, a, z) : z;
    }
#endif

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
#ifdef FA_MASK_MOD
    t1 = live_end;
#endif

    // The work list: Q tiles t0..t1 of every query head of the group, EMPTY tiles skipped.
    auto cls_of = [&](int gi, int t) {
#ifdef FA_MODS
        const long long row = mod_tile_index(mod_tile_b, tile_heads, b, hk * group + gi);   // per batch with a mask modifier
#else
        const long long row = tile_heads == 1 ? 0 : hk * group + gi;
#endif
        return (int)tiles[(row * nTr + t) * nTc + tc];
    };
    // advance: the next tile of the list and its class (kept for its iteration: one lookup per tile)
    auto advance = [&](int& gi, int& t, int& cls) {
        if (t0 > t1) return false;
        do {
            if (++t > t1) { t = t0; if (++gi >= group) return false; }
        } while ((cls = cls_of(gi, t)) == TILE_EMPTY);
        return true;
    };
    // The copies of a tile, all from thread 0 and completing on q_full[buf]: Q and dO by TMA (64 x 64 boxes, rows
    // >= Nq and columns >= d zero-filled, in the 128-byte swizzle of the panels), lse and D by two bulk copies of
    // their padded rows (rows >= Nq are 0 there: their Q and dO rows are zero, so S = 0, dP = 0, D = 0 and they
    // add nothing; masked tiles test i < Nq anyway). No cp.async copies in the loop: ptxas counts bulk groups (the
    // dQ reductions) on cp.async's scoreboard, so a cp.async wait there also waited for the last reduction.
    auto issue = [&](int gi, int t, int buf) {
        const int h = hk * group + gi, bh = b * Hq + h, row0 = t * BR;
        if (threadIdx.x == 0) {
            mbar_expect_tx(q_full + 8 * buf, 2 * QBUF + 2 * BR * 4);
            bulk_load(smem_addr(sL + buf * BR), LSE + (long long)bh * nPad + row0, BR * 4, q_full + 8 * buf);
            bulk_load(smem_addr(sD + buf * BR), Dv + (long long)bh * nPad + row0, BR * 4, q_full + 8 * buf);
#pragma unroll
            for (int p = 0; p < D / 64; ++p)
#pragma unroll
                for (int c = 0; c < BR / 64; ++c) {
                    const unsigned at = buf * QBUF + p * BR * 128 + c * 64 * 128;
                    tma_load_4d(sQ + at, map_q, q_full + 8 * buf, p * 64, row0 + c * 64, h, b);
                    tma_load_4d(sdO + at, map_do, q_full + 8 * buf, p * 64, row0 + c * 64, h, b);
                }
        }
    };

    int gi = 0, t = t0 - 1, buf = 0, ncls = 0;        // the work list's next tile, its class; its Q / dO buffer
    // The thread that issues a warpgroup's dQ reductions (both warpgroups; warpgroup 0 alone with SPLIT_KEYS),
    // and the block staged in the last tile, reduced at the start of the next (after its block barrier): `pend`
    // = (b*Hq + h) * ceil(Nq / 64) + the block's 64-row tile, -1 for none (or a tile past Nq: BR = 128 with
    // ceil(Nq / 64) odd, whose block is zero); at D = 128 the block is column panel wg of that tile. Its staging
    // buffer is that tile's Q / dO buffer index (both alternate per tile), buf ^ 1 until buf moves on in this tile.
    const bool issuer = wt == 0 && (!SPLIT_KEYS || wg == 0);
    int pend = -1;
    auto reduce_pending = [&]() {                   // one bulk group per tile and issuer, empty without a block
        if (issuer) {
            if (pend >= 0)
                bulk_reduce_add_f32(dQacc + (long long)pend * (64 * D) + (D == 128 ? wg * (64 * 64) : 0),
                                    sdQ + (wg * 2 + (buf ^ 1)) * STAGE, STAGE);
            bulk_commit();
        }
    };

    // gi = group once the work list is exhausted (advance leaves it there), so the loop carries no flag
    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_full + 8, 1);
        mbar_init_fence();
    }
    __syncthreads();                                  // the mbarriers are initialised before any thread waits
    if (!advance(gi, t, ncls)) gi = group;
    if (gi < group) issue(gi, t, 0);
    cp_async_commit();
    cp_async_wait<0>();                               // K and V (the loop issues no cp.async)
    for (unsigned use = 0; gi < group; ++use) {      // use: this tile's number; buffer use % 2 is in its (use / 2)-th use
        const int cgi = gi, ct = t, cbuf = buf, cls = ncls;
        // The next tile and its class, looked up where the lookup's global load does not stall every warp (at
        // the loop head, its branch on the loaded class did: Nsight Compute, D = 128, N = 4k, session 10, 4% of the
        // stall samples on the load). Where depends on what ptxas keeps whole (NVRTC 13, checked in the SASS:
        // tests/test_fa3_bwd.py): BR = 64 loads the class of the list's next tile here and tests it once S^T has
        // landed (below; EMPTY, as only a block mask or mask modifier makes it, falls back to the skipping walk),
        // since any test under the GEMMs at D = 128 made ptxas split S^T and wait for all of it and the last dK
        // before its last wgmma; BR = 128 walks the list under the GEMMs (there the guess's registers split
        // every wgmma).
        int ngi = gi, nt = t + 1, ncls_guess = TILE_EMPTY;
        if (BR == 64) {
            if (nt > t1) { nt = t0; ++ngi; }
            if (ngi < group) ncls_guess = cls_of(ngi, nt);
        }
        fence_proxy_async();                          // K, V and the dQ staging are read by the async proxy next
        mbar_wait(q_full + 8 * cbuf, (use / 2) & 1);  // this tile's Q, dO, lse and D landed
        __syncthreads();                              // the last tile's dS^T, dQ reads and staging are done
        reduce_pending();                             // the last tile's dQ block

        const int h = hk * group + cgi, bh = b * Hq + h, row0 = ct * BR;
        const unsigned q_tile = sQ + cbuf * QBUF, do_tile = sdO + cbuf * QBUF;
        const float* cL = sL + cbuf * BR;
        const float* cD = sD + cbuf * BR;
        float s[1][NQ][4], dp[1][NQ][4];
#ifdef FA_DIST_BIAS
        // a distance bias (ALiBi; tc_mods.cuh): S^T starts at slope (j - i) / scale, so that P below is the
        // modified softmax's; its derivative is 1, so dS needs nothing more (variants/fa3_backward.py
        // backward_mods; sinks need nothing: P comes from lse; other score modifiers: FA_SCORE_MOD below)
        seed_scores_t(s, dist_slope(b, h FA_SM_ARGS) / scale, col0 + wkey, row0, g, tq);
#endif
        wgmma_fence();
        wg_gemm_qk<T, D, BR, BC, FA_SEED_S>(s[0], k_rows, q_tile);   // S^T: this warpgroup's 64 keys x BR queries
        wgmma_commit();
        wg_gemm_qk<T, D, BR, BC>(dp[0], v_rows, do_tile);    // dP^T = V dO^T
        wgmma_commit();
        if (BWD2_SERIAL) wgmma_wait<0>();
        // BR = 128: the next tile, walked here under the GEMMs (after the visibility bits below, ptxas spilled 372
        // bytes; BR = 64 takes the loop head's guess once S^T has landed).
        if (BR == 128) advance(gi, t, ncls);

        // The dropout keep mask while the tensor cores run: bit 4 n + e of `dropped` set where dropout zeroes
        // element (n, e) (query row0 + 8 n + 2 tq + (e & 1), key col0 + wkey + g + 8 (e >= 2)), whether
        // visible or not (an invisible element's P is 0 either way).
        unsigned dropped = 0u;
        if (DROPOUT) {
#pragma unroll 1
            for (int n = 0; n < NQ; ++n)              // rolled: unrolled, the Philox calls interleave and spill
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row0 + n * 8 + 2 * tq + (e & 1), j = col0 + wkey + g + (e >= 2 ? 8 : 0);
                    if (dropout_factor(drop, word_of(dropout_words<R>(drop, bh, i, j >> 2), j & 3)) == 0.0f)
                        dropped |= 1u << (4 * n + e);
                }
        }
        // VIS_BITS (BR = 128): a masked tile's visibility as bits too (bit 4 n + e set where element (n, e) is out
        // of range or masked), computed here under the GEMMs, so that the exponent loops below test a bit per
        // element instead of evaluating the mask: with the mask's arithmetic among 64 S^T accumulators there,
        // ptxas copied them to other registers and spilled 72 bytes (NVRTC 13).
        constexpr bool VIS_BITS = BR == 128;
        const bool masked = cls != TILE_FULL || col0 + BC > Nk || row0 + BR > Nq;
        auto visible = [&](int i, int j) {            // the band / block mask, and the mask modifier where there is one
#ifdef FA_MODS
#ifdef FA_MASK_MOD
            if (cls == TILE_BAND) return mask.visible(h, i, j);     // tiles.cuh: the predicate hides nothing here
            // TILE_CAUSAL runs the predicate here (as PARTIAL): testing it too cost +4% where every masked tile is
            // TILE_BAND and +18-29% with a padding mask at d = 128 (H100, session 13 call 8)
#endif
            return mod_visible(mask, b, h, i, j, MOD_FN_ARGS);
#else
            return mask.visible(h, i, j);
#endif
        };
        unsigned long long hidden = 0ull;
        if (VIS_BITS && masked) {
#pragma unroll 1
            for (int n = 0; n < NQ; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row0 + n * 8 + 2 * tq + (e & 1), j = col0 + wkey + g + (e >= 2 ? 8 : 0);
                    if (!(i < Nq && j < Nk && (cls == TILE_FULL || visible(i, j))))
                        hidden |= 1ull << (4 * n + e);
                }
        }
        // whether element (n, e), query row0 + x, key j, is in range and visible (a masked tile's test)
        auto in_mask = [&](int n, int e, int i, int j) {
            return VIS_BITS ? !((hidden >> (4 * n + e)) & 1ull)
                            : i < Nq && j < Nk && (cls == TILE_FULL || visible(i, j));
        };
        wgmma_wait<1>();                              // S^T landed (and the last tile's dK); dP^T may still run
        fence_accumulators(s[0]);
        fence_accumulators(dk[0]);
        // The last tile's dK += dS^T Q read its Q buffer and the dS^T panel under this tile's first GEMMs; at
        // this barrier both warpgroups' have completed, so the next tile's copies take the buffer (and pass 2
        // below may rewrite the panel). Issued here, not right after S^T and dP^T: there the copies' address
        // arithmetic beside the accumulators in flight makes ptxas split S^T, wait for it and copy its 32
        // accumulators (NVRTC 13).
        named_sync(3, THREADS);
        if (BR == 64) {
            gi = ngi, t = nt, ncls = ncls_guess;
            if (gi < group && ncls == TILE_EMPTY) advance(gi, t, ncls);   // skip the EMPTY tiles of a sparse mask
        }
        if (gi < group) issue(gi, t, buf ^ 1);        // a next tile
        cp_async_commit();
        buf ^= 1;

        // P = 2^(S scale_log2 - lse) where visible; element (n, e): query x = 8 n + 2 tq + (e & 1), key
        // wkey + g + 8 (e >= 2). Two copies of the loop: full tiles (every tile of a non-causal problem but
        // the edges) test only for dead rows (lse = -inf), without the per-element branches of the mask.
        auto factor = [&](int n, int e) {             // Z / (1 - p) of element (n, e) (1 without dropout)
            return DROPOUT ? ((dropped >> (4 * n + e)) & 1u ? 0.0f : keep_factor) : 1.0f;
        };
        unsigned pa[BR / 16][4];                      // P_drop^T as dV's A operand: keys 16 kk .. 16 kk + 15 of the queries
#ifndef FA_SCORE_MOD
        auto exp_scores = [&](bool check) {
#pragma unroll
            for (int n = 0; n < NQ; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int x = n * 8 + 2 * tq + (e & 1), i = row0 + x;     // query
                    const int j = col0 + wkey + g + (e >= 2 ? 8 : 0);         // key
                    const float L = cL[x] * LOG2E_F;                            // lse in log2 units
                    const bool vis = L != NEG_INF && (!check || in_mask(n, e, i, j));
                    s[0][n][e] = vis ? exp2_ftz(s[0][n][e] * scale_log2 - L) : 0.0f;
                }
        };
        if (masked) exp_scores(true);
        else exp_scores(false);
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int n = 2 * kk + q / 2, e0 = 2 * (q % 2);
                pa[kk][q] = Elem<T>::pack(s[0][n][e0] * factor(n, e0), s[0][n][e0 + 1] * factor(n, e0 + 1));
            }
#else
        // A score modifier (its whole text and derivative, tc_mods.cuh FA_SCORE_MOD / FA_SCORE_MOD_GRAD): P =
        // 2^(mod(scale S) log2 e - lse) goes into pa as above, and S <- P mod'(scale S), the factor of dS =
        // P mod' o (dP Z - D), so that the derivative is never held beside P (32 registers more spill at
        // D = 128). One element pair (e0, e0 + 1: one key, queries x, x + 1) at a time.
        const float fj0 = (float)(col0 + wkey + g), fi0 = (float)(row0 + 2 * tq);   // tc_mods.cuh: fi, fj
        auto exp_scores_mod = [&](bool check, bool grad_from_core) {
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
#pragma unroll
                for (int e0 = 0; e0 < 4; e0 += 2) {
                    float pp[2];
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const int e = e0 + u, x = n * 8 + 2 * tq + u, i = row0 + x;
                        const int dj = e >= 2 ? 8 : 0, j = col0 + wkey + g + dj;
                        const float L = cL[x] * LOG2E_F;
                        // a full tile (check false) evaluates the modifier everywhere (every (i, j) is in range) and
                        // zeroes a dead row's P after (L = -inf: P = inf there), without a branch; such a row (a text
                        // that sends a whole row to -inf) then gets dS = 0 mod', NaN where mod' is not finite there,
                        // as the oracle's ds mod' does; masked tiles skip its elements (P = mod' = 0)
                        const bool vis = !check || (L != NEG_INF && in_mask(n, e, i, j));
                        float p = 0.0f, grad = 0.0f;
                        if (vis) {
                            const float fi = fi0 + (float)(n * 8 + u), fj = fj0 + (float)dj;
#ifdef FA_SCORE_FACTORED
                            const float xs = s[0][n][e] * scale_pre;
                            const float core = score_mod(xs, b, h, i, j, fi, fj FA_SM_ARGS);
                            p = exp2_ftz(core * mod_post_log2e - L);
#ifdef FA_TANH_CORE
                            if (grad_from_core) grad = fmaf(-core, core, 1.0f);        // sech^2 = 1 - tanh^2
                            else
#endif
                            grad = score_mod_grad(xs, b, h, i, j, fi, fj FA_SM_ARGS);   // times post pre: ds_scale
#else
                            const float xs = s[0][n][e] * scale;
                            p = exp2_ftz(score_mod(xs, b, h, i, j, fi, fj FA_SM_ARGS) * LOG2E_F - L);
                            grad = score_mod_grad(xs, b, h, i, j, fi, fj FA_SM_ARGS);
#endif
                            if (!check) p = L != NEG_INF ? p : 0.0f;
                        }
                        pp[u] = p;
                        s[0][n][e] = p * grad;
                    }
                    pa[n / 2][2 * (n % 2) + e0 / 2] = Elem<T>::pack(pp[0] * factor(n, e0), pp[1] * factor(n, e0 + 1));
                }
                // BR = 128: row block n + 1 starts after block n's P mod' and P are written (see chain_rows)
                if (BR == 128 && n + 1 < NQ)
                    chain_rows(s[0][n], pa[n / 2][2 * (n % 2)], pa[n / 2][2 * (n % 2) + 1], s[0][n + 1], (unsigned)Nq >> 31);
            }
        };
#ifdef FA_TANH_CORE
        // FA_TANH_CORE (sandbox/modifiers.py cuda_defines: a factored core fa_tanh(s) with derivative fa_sech2(s), the
        // soft-cap's): where every argument x of the warp's tile has |x| <= FA_TANH_GRAD_X (tc_mods.cuh
        // bwd_core_small), the derivative is taken from the core's own value, sech^2 x = 1 - tanh^2 x (one FFMA),
        // instead of fa_sech2 (an EX2 on the MUFU pipe and eight FMA-pipe instructions). Masked tiles
        // (block-uniform) keep fa_sech2 and skip the vote.
        const bool small_x = !masked && bwd_core_small(s, scale_pre);
#else
        constexpr bool small_x = false;
#endif
        if (masked) exp_scores_mod(true, false);
        else if (small_x) exp_scores_mod(false, true);
        else exp_scores_mod(false, false);
#endif
        wgmma_fence();
        wg_gemm_pv<T, D, BR>(dv[0], pa, do_tile);     // dV += P_drop^T dO
        wgmma_commit();
        if (BWD2_SERIAL) wgmma_wait<0>();
        wgmma_wait<1>();                              // dP^T landed; dV may still run
        fence_accumulators(dp[0]);

        // dS^T = P o (dP Z / (1 - p) - D), packed to 16 bits into the dS^T panel (dQ's and dK's A operand)
        unsigned pd[BR / 16][4];
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int x = n * 8 + 2 * tq + (e & 1);
                dp[0][n][e] = s[0][n][e] * (dp[0][n][e] * factor(n, e) - cD[x]);
            }
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int n = 2 * kk + q / 2, e0 = 2 * (q % 2);
                pd[kk][q] = Elem<T>::pack(dp[0][n][e0], dp[0][n][e0 + 1]);
            }
        // dS^T (16-bit) into its panels: key row r, query c at (c / 64) BC 128 + r * 128 + ((c % 64 / 8) ^ (r % 8)) * 16
        // + (c % 8) * 2; pd[n / 2][2 (n % 2) + hr] holds row wkey + g + 8 hr, queries 8 n + 2 tq, + 1
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = wkey + g + 8 * hr, c = n * 8 + 2 * tq;
                const unsigned addr = sdS + (c / 64) * (BC * 128) + r * 128 + ((((c % 64) / 8) ^ (r % 8)) << 4) + (c % 8) * 2;
                asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(pd[n / 2][2 * (n % 2) + hr]));
            }
        fence_proxy_async();
        // The staging buffer this tile writes below was last read by the reduction issued at the previous tile's
        // head; the one issued at this tile's head (the other buffer) may still run. Waited for here, mid-tile,
        // rather than at the loop head (a tile earlier in its life), where it stalled warps 0 and 4 and, through
        // the block barrier, every warp (ncu, D = 128, N = 4k, session 10: 8% of the stall samples).
        if (issuer) bulk_wait_read<1>();
        named_sync(1, THREADS);                       // both warpgroups' dS^T rows are in the panel
        wgmma_fence();

        // dQ block of this warpgroup: 64 queries (dS^T panel qp) x 64 columns (K panel kp) over KEYS keys from
        // key k0, A = the dS^T panel's rows k0.. read MN-major (queries contiguous), B = K panel kp MN-major
        // (d contiguous); k16 steps 16 keys (2048 bytes) apart. D = 128: columns 64 wg.., all 128 keys; D = 64,
        // BR = 128: queries 64 wg.., all 128 keys; SPLIT_KEYS: all of it over this warpgroup's 64 keys (a
        // partial, added to warpgroup 0's below). No branch on the warpgroup around a wgmma (ptxas serializes
        // every wgmma of a kernel that has one).
        constexpr int KEYS = SPLIT_KEYS ? BC / 2 : BC;
        const int k0 = SPLIT_KEYS ? wg * 64 : 0, kp = D == 128 ? wg : 0, qp = BR == 128 ? wg : 0;
        float dq[8][4];
        const unsigned long long dq_a = wgmma_desc(sdS + qp * (BC * 128) + k0 * 128, 1024, 1024);
        const unsigned long long dq_b = wgmma_desc(sK + kp * BC * 128 + k0 * 128, BC * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk)
            Wgmma<T, 64, true>::ss_ta(dq, wgmma_desc_at(dq_a, kk * 2048), wgmma_desc_at(dq_b, kk * 2048), kk > 0);
        wgmma_commit();
        // dK += dS^T Q (scaled at the end) with A = this warpgroup's 64 dS^T rows from the panel (K-major, as Q
        // in S = Q K^T), not from the pd registers: dK runs on into the next tile, and an A operand in registers
        // across the loop's back edge makes ptxas wait for it and copy the next S^T accumulators (NVRTC 13)
        const unsigned long long dk_a = wgmma_desc(sdS + wg * 64 * 128, 16, 1024), dk_b = wgmma_desc(q_tile, BR * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk)
            Wgmma<T, D, true>::ss(dk[0], wgmma_desc_at(dk_a, (kk / 4) * (BC * 128) + (kk % 4) * 32),
                                  wgmma_desc_at(dk_b, kk * 2048), 1);
        wgmma_commit();
        if (BWD2_SERIAL) wgmma_wait<0>();
        wgmma_wait<1>();                              // dV and dQ done; dK runs on into the next tile
        fence_accumulators(dq);
        fence_accumulators(dv[0]);

        // Stage the block in accumulator order (thread wt's n8 tile n at (n * 128 + wt) * 16 bytes) for one
        // bulk reduction per 16 KB, issued after the next block barrier. SPLIT_KEYS: warpgroup 1 stages its
        // partial and arrives; warpgroup 0 adds it to its own first.
        const unsigned stage = sdQ + (wg * 2 + cbuf) * STAGE;
        if (SPLIT_KEYS && wg == 0) {
            named_sync(2, THREADS);                   // warpgroup 1's partial is staged
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                float4 x;
                asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                             : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(stage + 2 * STAGE + (n * 128 + wt) * 16)
                             : "memory");
                dq[n][0] += x.x;
                dq[n][1] += x.y;
                dq[n][2] += x.z;
                dq[n][3] += x.w;
            }
        }
#pragma unroll
        for (int n = 0; n < 8; ++n)
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                         :: "r"(stage + (n * 128 + wt) * 16), "f"(dq[n][0]), "f"(dq[n][1]), "f"(dq[n][2]), "f"(dq[n][3])
                         : "memory");
        if (SPLIT_KEYS && wg == 1) named_arrive(2, THREADS);   // read by warpgroup 0; rewritten two tiles on
        const int tile64 = ct * (BR / 64) + (BR == 128 ? wg : 0);
        pend = tile64 < nT64 ? bh * nT64 + tile64 : -1;
    }
    wgmma_wait<0>();                                  // the last dK
    fence_accumulators(dk[0]);
    fence_accumulators(dv[0]);
    fence_proxy_async();
    __syncthreads();                                  // the last dQ block is staged
    reduce_pending();
    if (issuer) bulk_wait<0>();                       // this block's reductions are complete

    // dK = ds_scale dS^T Q (scale, times a factored modifier's post pre), dV: this warp's 16 keys
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
                *reinterpret_cast<unsigned*>(krow + c) = Elem<T>::pack(dk[0][n][2 * hr] * ds_scale, dk[0][n][2 * hr + 1] * ds_scale);
                *reinterpret_cast<unsigned*>(vrow + c) = Elem<T>::pack(dv[0][n][2 * hr], dv[0][n][2 * hr + 1]);
            }
        }
    }
}

// dq (rows < Nq, columns < d, in T) = scale * the accumulator-ordered fp32 dQacc of fa3_bwd2. Element
// (row r, column c) of a 64-row tile sits at ((c / 8) * 128 + t) * 4 + 2 h + (c % 2) floats into the tile
// (D = 64 or 128: panel c / 64 is warpgroup c / 64's block, and its n8 tile is (c % 64) / 8), where
// t = 32 (r / 16) + 4 (r % 8) + (c % 8) / 2 is the accumulator thread and h = (r % 16) / 8. A thread
// writes 8 consecutive columns of one row (16 bytes); threads 2k and 2k + 1 take rows r and r + 8, which
// share each 16-byte accumulator slot, so the reads are whole sectors.
template <typename T>
__global__ void __launch_bounds__(256)
fa3_bwd2_dq(const float* __restrict__ acc, T* __restrict__ dQ, int Nq, int d, int D, float scale) {
    const int tile = blockIdx.x, bh = blockIdx.y, nTr = gridDim.x, cgs = D / 8;
    const float* src = acc + ((long long)bh * nTr + tile) * (64 * D);
    for (int it = threadIdx.x; it < 64 * cgs; it += blockDim.x) {
        const int h = it & 1, cg = (it >> 1) % cgs, pr = (it >> 1) / cgs;     // pr = 8 (r / 16) + r % 8
        const int r = (pr / 8) * 16 + pr % 8 + 8 * h, i = tile * 64 + r, c0 = cg * 8;
        if (i >= Nq || c0 >= d) continue;
        const float* x = src + (cg * 128 + (pr / 8) * 32 + (pr % 8) * 4) * 4 + 2 * h;
        unsigned w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 v = *reinterpret_cast<const float2*>(x + 4 * q);
            w[q] = Elem<T>::pack(v.x * scale, v.y * scale);
        }
        *reinterpret_cast<uint4*>(dQ + ((long long)bh * Nq + i) * d + c0) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// The backward's preprocessing, one launch (as FA3's hopper/ backward preprocess): for the 64 rows of Q tile
// blockIdx.x of (b, h) = blockIdx.y, D = rowsum(dO o O) in fp32 and lse copied into rows padded to NPAD =
// gridDim.x 64 = ceil(Nq / 128) 128 (0 past Nq), so that fa3_bwd2 loads a tile's lse and D as two 16-byte aligned
// bulk copies; and the tile's fp32 dQ accumulator block zeroed (tiles < ceil(Nq / 64)). Four threads per row,
// 16-byte loads of 8 columns (rows 16-byte aligned: the variant's check), the columns past the last whole chunk
// one by one.
template <typename T>
__global__ void __launch_bounds__(256)
fa3_bwd2_pre(const T* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm,   // [B, Hq, Nq, d]
             const T* __restrict__ O, long long o_sb, long long o_sh, long long o_sm,       // [B, Hq, Nq, d]
             const float* __restrict__ LSE,          // [B, Hq, Nq]
             float* __restrict__ Lp,                 // [B*Hq, NPAD]
             float* __restrict__ Dp,                 // [B*Hq, NPAD]
             float* __restrict__ dQacc,              // [B*Hq, ceil(Nq/64), 64 D]
             int Hq, int Nq, int d, int D) {
    const int tile = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq, nPad = gridDim.x * 64;
    const int r = threadIdx.x / 4, sub = threadIdx.x % 4, i = tile * 64 + r, nT64 = (Nq + 63) / 64;
    float acc = 0.0f;
    if (i < Nq) {
        const T* go = dO + b * do_sb + h * do_sh + (long long)i * do_sm;
        const T* oo = O + b * o_sb + h * o_sh + (long long)i * o_sm;
        for (int c = sub * 8; c + 8 <= d; c += 32) {
            const uint4 x = *reinterpret_cast<const uint4*>(go + c), y = *reinterpret_cast<const uint4*>(oo + c);
            const unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 u = Elem<T>::unpack(xs[q]), v = Elem<T>::unpack(ys[q]);
                acc = fmaf(u.x, v.x, fmaf(u.y, v.y, acc));
            }
        }
        for (int c = d / 8 * 8 + sub; c < d; c += 4)
            acc = fmaf((float)go[c], (float)oo[c], acc);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (sub == 0) {
        Dp[(long long)bh * nPad + i] = acc;
        Lp[(long long)bh * nPad + i] = i < Nq ? LSE[(long long)bh * Nq + i] : 0.0f;
    }
    if (tile < nT64) {
        float4* z = reinterpret_cast<float4*>(dQacc + ((long long)bh * nT64 + tile) * (64 * D));
        for (int x = threadIdx.x; x < 16 * D; x += blockDim.x) z[x] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}
