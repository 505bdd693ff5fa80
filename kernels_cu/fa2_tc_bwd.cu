// fa2_tc_bwd.cu: FlashAttention-2 backward on tensor cores, fp16 inputs, fp32 accumulation.
//
// Seed: FA2 paper (002) Algorithm 2: column-parallel (one block per K/V tile), P recomputed from the
// logsumexp, dQ accumulated in fp32 with atomics; D = rowsum(dO o O) is a preprocessing step.
// Per Q tile the block runs five GEMMs on mma.m16n8k16 fragments, every operand by ldmatrix from
// XOR-swizzled tiles (tc_gemm.cuh):
//   S^T = K_j Q_i^T and dP^T = V_j dO_i^T   (A: this warp's 16 keys; B: the tile's queries)
//   dV_j += P_drop^T dO_i and dK_j += dS^T Q_i   (A: the S^T / dS^T registers, as P in the forward)
//   dQ_i += dS K_j                          (A: dS^T through shared memory, ldmatrix.trans; atomics)
// Pipeline: Q, dO, lse and D of the next Q tile (the work list runs over the group's query heads
// and their non-empty tiles) are copied into the second buffer while this tile is computed.
// Dropout replays the contract's Philox counters per element (query i, key j): word j % 4 of
// philox(j / 4, i, b*Hq + h, offset), as the forward.
//
// Kernels
//   fa2_tc_bwd_rowdot<T>   grid ceil(B*Hq*Nq / 32), 256 threads: the preprocessing D = rowsum(dO o O), fp32.
//   fa2_tc_bwd<T, D, BR, BC, WARPS, MK, MINB, R, DROPOUT, ATOMIC_DQ>   grid (ceil(Nk/BC), B*Hkv), WARPS*32
//       threads; each warp owns 16 MK keys of the tile (BC = 16 MK WARPS) and a block of dQ: 16 rows
//       (one of BR / 16 row groups) by D / (WARPS / (BR / 16)) columns, so where the warps outnumber
//       the row groups (BR = 64, BC = 128: 8 warps) two warps share a row group's columns. MK = 2
//       halves the shared-memory reads of the Q and dO operands per FLOP (each fragment feeds two m16
//       key tiles) at the price of twice the dK, dV accumulators.
//       Without ATOMIC_DQ it computes dK and dV only (dQ untouched): the deterministic pair.
//       MINB: blocks per SM the register allocation must allow (__launch_bounds__), the occupancy axis.
//   fa2_tc_bwd_dq<T, D, BR, BC, WARPS, R, DROPOUT>   grid (ceil(Nq/BR), B*Hq): the deterministic dQ,
//       row-parallel like the forward (split-Q, 16 rows per warp): per K/V tile it recomputes
//       S = Q K^T and dP = dO V^T, forms dS in registers and adds dS K (A from the dS registers, K
//       by ldmatrix.trans) in tile order, so every run sums in the same order. Two more GEMMs per
//       tile than the atomic path (7 instead of 5); K and V of the next tile are copied during this one.
//   fa2_tc_bwd_wide<T, D, BR, BC, WARPS, R, DROPOUT>   D = 192 or 256 (d in 136..256, zero-padded), grid and
//       arguments of fa2_tc_bwd (ATOMIC_DQ); BR = BC = 64, 8 warps. Below.
// dQ atomics: lanes t and t ^ 1 swap halves of their C fragments so that each adds four consecutive
// columns with one float4 atomic on sm_90 (scalar atomics before).
// Envelope: D in {64, 128}, BR in {32, 64, 128} (the dS^T tile's swizzle, ds_chunk below); the wide kernel
// D in {192, 256}, BR = BC = 64.
//
// The wide head dims (issue 18 item 5): fa2_tc_bwd keeps each warp's dK and dV for its 16 MK keys over the whole
// head dim, 2 x 16 x D / 32 fp32 registers per lane: 128 at D = 128 (255 registers, no spills on sm_90), 256 at
// D = 256, which cannot fit. Three ways out were weighed:
//   (a) split the head dim of dK / dV over warps: two warps share a 16-key strip, each owning half of D's
//       columns (64 or 48 n8 columns: 64 or 48 floats each for dK and dV, 128 / 96 in all), with the strip's
//       P^T and dS^T passed through shared memory in 16 bits;
//   (b) dK or dV accumulated in shared memory (fp32, 64 keys x 256 x 4 B = 64 KB each): a read-modify-write of
//       64 KB per Q tile per block, next to 209 KB of tiles that already leave no room (227 KB);
//   (c) two kernels, dV (S, dV) and dK + dQ (S, dP, dK, dQ): 7 GEMMs instead of 5 (S twice; +40% tensor work)
//       and the dropout mask replayed twice, for code that still has to hold 128 accumulators at D = 256.
// Chosen: (a), FA2's own design at d = 256 (flash-attn csrc/flash_attn/src, its d = 256 backward: Br = Bc = 64,
// 8 warps, dK / dV partitioned over warps along the head dim, P and dS through shared memory). Its costs are
// small: no GEMM is repeated, S^T and dP^T are split too (each warp computes its strip's 16 keys x half the
// queries, so the exp2 / Philox replay work is not duplicated either), and the exchange is two 8 KB tiles
// written once per Q tile; the dS^T tile was written for dQ anyway, the barrier before dQ exists anyway, so
// (a) adds P^T (8 KB) and moves that barrier before the dV / dK GEMMs, whose A operand is then read by ldmatrix
// (4 x 16 x 64 halves per warp per tile) rather than packed from registers; the numbers are the same (P and dS
// rounded to 16 bits either way). Per Q tile: wait + barrier; S^T, dP^T (this warp: 16 keys x 32 queries,
// k = D); P, dS elementwise (mask, modifiers, dropout replay as fa2_tc_bwd) and P_drop^T, dS^T to shared
// memory; barrier; dV += P_drop^T dO, dK += dS^T Q over the warp's columns; dQ += scale dS K for the warp's
// 16 rows (row group = its strip) over its columns, one 64-column panel at a time (16 floats in flight,
// float4 atomics).
// Warp w: key strip w % 4 (keys 16 (w % 4) ..+15 of the tile; also its dQ row group), half hs = w / 4. Half hs
// owns columns 32 hs .. 32 hs + 31 of every 64-column panel (interleaved rather than contiguous halves, so that
// hs is one XOR folded into the lane's base address at D = 192 too, whose halves are 1.5 panels).
// Layout: Q, K, V, dO tiles as 64-column panels [D/64][rows][64] of 128-byte rows, 16-byte chunk c at c ^ (row
// % 8) (panel_offset): tc_gemm.cuh's row-major swizzle needs power-of-two rows for its XOR addressing, which
// D = 192 (384 bytes) lacks. Shared memory: K, V, 2 x (Q, dO), P^T, dS^T, 2 x (lse, D) = 164,864 B at D = 192
// (fits sm_80's 166,912 B opt-in), 214,016 B at D = 256 (sm_90's 232,448 B only: on sm_80 the host refuses it
// by name before launch; a single-buffered Q / dO, FA2's A100 form, would fit at 148 KB but is not built: no
// forward that reaches d > 128 runs on sm_80). One block (8 warps) per SM, as the D = 128 default. Registers
// (NVRTC 13, ptxas): 229-232 at D = 192, 246-250 at D = 256 on sm_90 (227-253 on sm_80), no spills, also with
// the built-in modifiers compiled in. No deterministic form (no deterministic forward reaches d > 128).
// Expected speed: the same GEMM count per FLOP as fa2_tc_bwd at D = 128 and the same 8 warps per SM; the S^T /
// dP^T step reads 3 ldmatrix per 4 MMAs (5 per 8 at D = 128, Bc = 128) and dQ takes twice the atomics per key
// (Bc = 64 instead of 128), against FLOPs per tile twice D = 128's: about 0.8-1.0x the D = 128 backward's
// TFLOP/s. Not yet run on a GPU.
//
// Status (H100, bench/results/h100/): fuzzed against the oracle in fp16 and bf16 with every feature
// (counts in the summaries), sanitizer clean. The kernel is latency-bound, not bandwidth-bound:
// Nsight Compute (d = 64, N = 4k, Br = 64, 2 blocks per SM) shows 8 warps per SM (12.5% occupancy:
// 215 registers, 58 KB of shared memory), issue slots 32% busy, tensor pipe 24%, L1 59%. So MK = 2
// (2 warps x 32 keys), which halves the operand reads and was predicted up to 40% faster if shared
// memory were the limit, bought 3-7%, while MINB = 3 (168 registers, 84 bytes of spills, 12 warps
// per SM) bought 11-13%: the d = 64 default (variants/fa2_tc.py, TCConfig.BWD_AUTO*). At d = 128, Bc = 128
// with 8 warps (two per dQ row group) halves the dQ atomics and the Q / dO reads per key at the same 8
// warps per SM, and compiles without spills for sm_90: the backward runs 12-16% faster than with Bc = 64
// non-causal, -2 to +11% causal (6ae585e, 638f5f8; fwd + bwd 0.73-0.86x SDPA flash). At d = 64 it loses
// (211 registers: 8 warps per SM, not 12). fa2_tc_bwd_rowdot in place of the CuPy expression (fp32 casts
// of dO and O, product, sum) bought 1-23% of the backward, most at N = 2k. Next rung:
// fewer registers per warp (FA2's 2-D warp layouts for S and dP), so occupancy comes without spills.
//
// Modifiers (issue 18; tc_mods.cuh): a score modifier's text and derivative, or its factored core and the core's
// derivative (FA_SCORE_FACTORED; the soft-cap's sech^2 from its own tanh where a warp's |x| <= 0.5, FA_TANH_CORE),
// a distance bias seeding S^T (S in fa2_tc_bwd_dq; FA_DIST_BIAS), a mask modifier's predicate and tile classes;
// the element-wise step in a full-tile and a masked form (elementwise_forms). Session 26 (H100, fp16 causal,
// N = 4k-8k, bench/results/h100/2026-11-27-session-26.md): plain causal's backward 5-14% faster from the two forms;
// over it, the soft-cap +1-6% (was +35-47%) and ALiBi +1-5% (was +13-25%) on fa2-tc.
#include "tc_softmax.cuh"
#include "tc_gemm.cuh"
#include "tc_mods.cuh"
#if defined(FA_SCORE_MOD) && !defined(FA_SCORE_MOD_GRAD)
#error "fa2_tc_bwd.cu takes score modifiers with their derivative (or a distance bias), sinks and mask modifiers"
#endif

#define LOG2E_F 1.4426950408889634f

// ---- device helpers

// Swizzled 16-byte chunk of (row, chunk) in the [BC][BR] dS^T tile: rows of 8 or 16 chunks (BR = 64,
// 128) as swizzle<>: chunk ^ (row % 8); rows of 4 chunks (BR = 32, two rows per 128-byte line): chunk ^
// ((row / 2) % 4). Either way the 8 rows an ldmatrix phase reads hit 8 different 16-byte bank groups.
template <int BR>
__device__ __forceinline__ int ds_chunk(int row, int chunk) {
    static_assert(BR == 32 || BR == 64 || BR == 128, "dS^T rows of 4, 8 or 16 chunks");
    return BR >= 64 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3);
}

// The element-wise step of a tile (P, dS from S, dP) in two compiled forms, each under a block-uniform branch:
// a full tile (no range, band / block mask or mask modifier check per element) and a masked tile (every check).
// With FA_TANH_CORE the full form is the one whose soft-cap core takes sech^2 from its own tanh, in full tiles that
// pass tc_mods.cuh bwd_core_small; the other tiles share the masked form (fa_sech2, `masked` tested per element).
// f(masked, core_grad) is the kernel's lambda, given constants at each call so that each form is compiled apart.
// Measured (H100, fp16 causal, N = 4k-8k, session 26): one form for all tiles ran plain causal 5-6% (d = 64) and
// 14% (d = 128) slower; a third form (full tiles past |x| = 0.5) made the soft-cap 4% slower. SPLIT false (the
// dropout builds, whose registers two forms of the Philox step would spill): one form, as before.
#ifdef FA_TANH_CORE
#define BWD_CORE_ARG msc.arg
#else
#define BWD_CORE_ARG 0.0f
#endif
template <bool SPLIT, typename F, typename S>
__device__ __forceinline__ void elementwise_forms(F&& f, bool masked, const S& s, float core_arg) {
#ifdef FA_TANH_CORE
    if (!masked && bwd_core_small(s, core_arg)) f(false, true);
    else f(masked, false);
#else
    if (!SPLIT) f(masked, false);
    else if (masked) f(true, false);
    else f(false, false);
#endif
}

// ---- kernels

// The key block's walk (fa2_tc_bwd, fa2_tc_bwd_wide): its Q-tile range t0..t1 under the band, and cls_of(gi, t), the
// class of Q tile t of the group's query head gi (the walk skips EMPTY tiles). With a mask modifier and one query
// head per block, t1 becomes the last live tile: the trailing EMPTY tiles (a document mask's later documents, the
// packed backward of sandbox/varlen.py) are found 32 at a time (tiles.cuh last_live_tile) instead of by the walk's
// serial scan, one dependent load each, which cost the packed backward 10-34% at d = 128 (H100, session 16).
#ifdef FA_MODS
#define BWD_TABLE_ROW(gi) mod_tile_index(mod_tile_b, tile_heads, b, hk * group + (gi))
#else
#define BWD_TABLE_ROW(gi) ((long long)(tile_heads == 1 ? 0 : hk * group + (gi)))
#endif
#ifdef FA_MASK_MOD
#define BWD_LIVE_END if (group == 1) t1 = last_live_tile([&](int t) { return cls_of(0, t); }, t0, t1);
#else
#define BWD_LIVE_END
#endif
#define BWD_WALK_RANGE                                                                                   \
    int t0, t1;                                                                                          \
    band_row_tiles(col0, min(col0 + BC, Nk) - 1, band_lo, band_hi, Nq, BR, t0, t1);                      \
    auto cls_of = [&](int gi, int t) { return (int)tiles[(BWD_TABLE_ROW(gi) * nTr + t) * nTc + tc]; };  \
    BWD_LIVE_END

template <typename T, int D, int BR, int BC, int WARPS, int MK, int MINB, int R, bool DROPOUT, bool ATOMIC_DQ>
__global__ void __launch_bounds__(WARPS * 32, MINB)
fa2_tc_bwd(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
           const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
           const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
           const T* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
           const float* __restrict__ LSE,      // [B, Hq, Nq]
           const float* __restrict__ Dv,       // [B, Hq, Nq] rowsum(dO o O)
           float* __restrict__ dQ,             // [B, Hq, Nq, d] fp32, zeroed (ATOMIC_DQ only)
           T* __restrict__ dK,                 // [B, Hkv, Nk, d] contiguous
           T* __restrict__ dV,                 // [B, Hkv, Nk, d] contiguous
           const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
           int tile_heads, int Hq, int Hkv, int group, int Nq, int Nk, int d,
           float scale, MASK_PARAMS, DROPOUT_PARAMS MOD_PARAMS FACTORED_PARAMS) {   // modifiers only (tc_mods.cuh)
    constexpr int THREADS = WARPS * 32;
    constexpr int NQ = BR / 8;          // n8 tiles of S^T (queries)
    constexpr int ND = D / 8;           // n8 tiles of dK, dV, dQ
    static_assert(D == 64 || D == 128, "head dim padded to 64 or 128");
    constexpr int RG = BR / 16;         // dQ row groups of 16
    constexpr int DQC = D * RG / WARPS; // dQ columns per warp
    static_assert(BC == 16 * MK * WARPS && BR % 16 == 0 && WARPS % RG == 0, "16 MK keys per warp, 16-row dQ groups");
    static_assert(DQC % 16 == 0, "each warp's dQ columns: whole ldmatrix.x4.trans steps");
    extern __shared__ __align__(1024) uint4 smem_u4[];
    T* sK = reinterpret_cast<T*>(smem_u4);   // [BC][D] swizzled
    T* sV = sK + BC * D;                      // [BC][D]
    T* sQ = sV + BC * D;                      // [2][BR][D]: two buffers, the next Q tile lands during this one
    T* sdO = sQ + 2 * BR * D;                 // [2][BR][D]
    T* sdS = sdO + 2 * BR * D;                // [BC][BR] dS^T, swizzled rows of BR
    float* sL = reinterpret_cast<float*>(sdS + BC * BR);   // [2][BR] lse in log2 units
    float* sD = sL + 2 * BR;                               // [2][BR] rowsum(dO o O)
    constexpr unsigned QBUF = BR * D * 2;                  // bytes between the two buffers of Q (and of dO)

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4, r7 = lane & 7;
    const int tc = blockIdx.x, bhk = blockIdx.y, b = bhk / Hkv, hk = bhk % Hkv;
    const int rg = warp % RG, wdq = (warp / RG) * (DQC / 8);   // this warp's dQ row group, first n8 column tile
    const int col0 = tc * BC, wkey = warp * 16 * MK, wq = rg * 16, dch = d / 8;
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC;
    const float scale_log2 = scale * LOG2E_F, ds_scale = bwd_ds_scale(scale FACTORED_ARGS);   // dK's, dQ's factor
#ifdef FA_SCORE_MOD
    const BwdModScales msc = bwd_mod_scales(scale FACTORED_ARGS);
#endif
#ifdef FA_MASK_MOD
    BWD_WALK_RANGE                               // here, where few registers are live: below the dK, dV accumulators
#endif                                           // the D = 128 build spilled 40 bytes (NVRTC 13, sm_90)

    // operand bases: K and V rows of this warp as A; Q and dO as B (S^T, dP^T) and as B^T (dV, dK);
    // K as B^T (dQ); dS^T as A^T (dQ): the K-style lane pattern of tile_bases, read with .trans
    const TileBases kq = tile_bases<T, D>(sK, sQ, sdO, wkey, lane);   // .q: K as A, .k: Q as B, .v: dO as B^T
    const TileBases vd = tile_bases<T, D>(sV, sdO, sQ, wkey, lane);   // .q: V as A, .k: dO as B, .v: Q as B^T
    const unsigned kT = tile_bases<T, D>(sK, sK, sK, 0, lane).v;      // K as B^T
    // dS^T as A^T: this lane's row (key) of each 16-key step and its query chunk, 2 rg + (lane / 8) % 2.
    // BR >= 64 XORs the row group's 2 rg in at each use ((2 rg + c) ^ r7 = c ^ r7 ^ 2 rg): folding it into
    // the base cost the D = 128 kernel 48 more bytes of spills (NVRTC 13, sm_90; 255 registers either way).
    const int dsr = (lane / 16) * 8 + r7;
    const unsigned dsT = smem_addr(sdS) + dsr * (BR * 2) +
                         (ds_chunk<BR>(dsr, (BR >= 64 ? 0 : 2 * rg) + ((lane / 8) & 1)) << 4);
    const unsigned dsT_warp = BR >= 64 ? dsT ^ (rg << 5) : dsT;

    load_tile_async<T, BC, D, THREADS>(sK, K + b * k_sb + hk * k_sh, k_sm, col0, Nk, dch);
    load_tile_async<T, BC, D, THREADS>(sV, V + b * v_sb + hk * v_sh, v_sm, col0, Nk, dch);
    cp_async_commit();

    float dk[MK][ND][4], dv[MK][ND][4];
#pragma unroll
    for (int mk = 0; mk < MK; ++mk)
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[mk][n][e] = dv[mk][n][e] = 0.0f;
#ifndef FA_MASK_MOD
    BWD_WALK_RANGE                               // (with a mask modifier: at the top, above)
#endif
    auto advance = [&](int& gi, int& t) {        // to the next non-empty (gi, t); false past the end
        if (t0 > t1) return false;
        do {
            if (++t > t1) { t = t0; if (++gi >= group) return false; }
        } while (cls_of(gi, t) == TILE_EMPTY);
        return true;
    };
    // Q, dO (cp.async), lse and D (plain loads) of work item (gi, t) into buffer `buf`
    auto issue = [&](int gi, int t, int buf) {
        const int h = hk * group + gi, bh = b * Hq + h, row0 = t * BR;
        load_tile_async<T, BR, D, THREADS>(sQ + buf * BR * D, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, dch);
        load_tile_async<T, BR, D, THREADS>(sdO + buf * BR * D, dO + b * do_sb + h * do_sh, do_sm, row0, Nq, dch);
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
        __syncthreads();                              // this tile landed; every warp is done with the last one
        if (have) issue(gi, t, buf ^ 1);              // the next tile flies while this one is computed
        cp_async_commit();
        buf ^= 1;
        {
            const int h = hk * group + cgi, bh = b * Hq + h, cls = cls_of(cgi, ct), row0 = ct * BR;
            const unsigned off = cbuf * QBUF;
            const float* cL = sL + cbuf * BR;
            const float* cD = sD + cbuf * BR;
            float s[MK][NQ][4], dp[MK][NQ][4];
#ifdef FA_DIST_BIAS
            seed_scores_t(s, dist_slope(b, h FA_SM_ARGS) / scale, col0 + wkey, row0, g, tq);   // tc_mods.cuh
#endif
            gemm_qk<T, D, FA_SEED_S>(s, kq.q, kq.k + off);   // S^T: this warp's keys x the tile's queries
            gemm_qk<T, D>(dp, vd.q, vd.k + off);         // dP^T = V dO^T
            const bool masked = cls != TILE_FULL || col0 + BC > Nk || row0 + BR > Nq;
#ifdef FA_SCORE_MOD
            const float fi0 = (float)(row0 + 2 * tq), fj0 = (float)(col0 + wkey + g);   // tc_mods.cuh: fi, fj
#endif
            // P_drop^T into s, dS^T into dp; core_grad: tc_mods.cuh bwd_mod_logit (elementwise_forms)
            auto elementwise = [&](bool tile_masked, bool core_grad) {
#pragma unroll
                for (int mk = 0; mk < MK; ++mk)
#pragma unroll
                for (int n = 0; n < NQ; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int x = n * 8 + 2 * tq + (e & 1), i = row0 + x;                  // query
                        const int j = col0 + wkey + mk * 16 + g + (e >= 2 ? 8 : 0);            // key
                        const float L = cL[x];
#ifdef FA_MODS
                        const bool vis = L != NEG_INF &&
                                         (!tile_masked || (i < Nq && j < Nk && (cls == TILE_FULL || mod_visible(mask, b, h, i, j, MOD_FN_ARGS))));
                        float x2 = s[mk][n][e] * scale_log2, gr = 1.0f;   // the logit in log2 units, mod'(s)
#ifdef FA_SCORE_MOD
                        if (vis) {
                            const float fi = fi0 + (float)(n * 8 + (e & 1)), fj = fj0 + (float)(mk * 16 + (e >= 2 ? 8 : 0));
                            x2 = bwd_mod_logit(s[mk][n][e], gr, core_grad, msc, b, h, i, j, fi, fj FA_SM_ARGS);
                        }
#endif
                        const float p = vis ? exp2_ftz(x2 - L) : 0.0f;
#else
                        const bool vis = L != NEG_INF && (!tile_masked || (i < Nq && j < Nk && (cls == TILE_FULL || mask.visible(h, i, j))));
                        const float p = vis ? exp2_ftz(s[mk][n][e] * scale_log2 - L) : 0.0f;
#endif
                        float f = 1.0f;                       // Z / (1 - p) of element (i, j)
                        if (DROPOUT && vis) f = dropout_factor(drop, word_of(dropout_words<R>(drop, bh, i, j >> 2), j & 3));
                        s[mk][n][e] = p * f;                  // P_drop^T (dV's A operand)
#ifdef FA_MODS
                        dp[mk][n][e] = p * (dp[mk][n][e] * f - cD[x]) * gr;   // dS_raw = dS_mod o mod'(s)
#else
                        dp[mk][n][e] = p * (dp[mk][n][e] * f - cD[x]);   // dS^T = P o (dP Z / (1 - p) - D)
#endif
                    }
            };
            elementwise_forms<!DROPOUT>(elementwise, masked, s, BWD_CORE_ARG);
            gemm_pv<T, D, BR>(dv, s, kq.v + off);        // dV += P_drop^T dO
            gemm_pv<T, D, BR>(dk, dp, vd.v + off);       // dK += dS^T Q (scaled at the end)
            if constexpr (!ATOMIC_DQ) continue;          // dQ is fa2_tc_bwd_dq's
            // dS^T to shared memory (16-bit) for dQ = dS K
#pragma unroll
            for (int mk = 0; mk < MK; ++mk)
#pragma unroll
            for (int n = 0; n < NQ; ++n)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int row = wkey + mk * 16 + g + 8 * hr, col = n * 8 + 2 * tq;
                    *reinterpret_cast<unsigned*>(sdS + row * BR + (ds_chunk<BR>(row, col / 8) << 3) + (col % 8)) =
                        Elem<T>::pack(dp[mk][n][2 * hr], dp[mk][n][2 * hr + 1]);
                }
            __syncthreads();
            // dQ rows wq..wq+15, columns 8 wdq .. 8 wdq + DQC - 1 += scale dS K: A = dS (queries x keys) by
            // ldmatrix.trans of dS^T, B = K by ldmatrix.trans
            const bool odd = tq & 1;
            const int i = row0 + wq + g + (odd ? 8 : 0);
            float* row = dQ + ((long long)bh * Nq + min(i, Nq - 1)) * d + 4 * (tq / 2);
            float dq[1][DQC / 8][4];
#pragma unroll
            for (int n = 0; n < DQC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dq[0][n][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                unsigned a[4];
                ldmatrix_x4_trans(a, dsT_warp + kk * 16 * (BR * 2));
#pragma unroll
                for (int dp2 = 0; dp2 < DQC / 16; ++dp2) {
                    unsigned bk[4];
                    ldmatrix_x4_trans(bk, (kT ^ ((wdq / 2 + dp2) << 5)) + kk * 16 * (D * 2));
                    mma_16816<T>(dq[0][2 * dp2], a, bk);
                    mma_16816<T>(dq[0][2 * dp2 + 1], a, bk + 2);
                }
            }
            add_dq_tiles(dq[0], row, wdq, i < Nq, d, tq, ds_scale);    // float4 atomics (tc_softmax.cuh)
        }
    }
    cp_async_wait<0>();

    // dK = ds_scale dS^T Q, dV: this warp's 16 MK keys
#pragma unroll
    for (int mk = 0; mk < MK; ++mk)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int j = col0 + wkey + mk * 16 + g + 8 * hr;
        if (j >= Nk) continue;
        T* krow = dK + ((long long)bhk * Nk + j) * d;
        T* vrow = dV + ((long long)bhk * Nk + j) * d;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            const int c = n * 8 + 2 * tq;
            if (c < d) {
                *reinterpret_cast<unsigned*>(krow + c) = Elem<T>::pack(dk[mk][n][2 * hr] * ds_scale, dk[mk][n][2 * hr + 1] * ds_scale);
                *reinterpret_cast<unsigned*>(vrow + c) = Elem<T>::pack(dv[mk][n][2 * hr], dv[mk][n][2 * hr + 1]);
            }
        }
    }
}

template <typename T, int D, int BR, int BC, int WARPS, int R, bool DROPOUT>
__global__ void __launch_bounds__(WARPS * 32, 1)
fa2_tc_bwd_dq(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
              const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,     // [B, Hkv, Nk, d]
              const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,     // [B, Hkv, Nk, d]
              const T* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
              const float* __restrict__ LSE,      // [B, Hq, Nq]
              const float* __restrict__ Dv,       // [B, Hq, Nq] rowsum(dO o O)
              T* __restrict__ dQ,                 // [B, Hq, Nq, d] contiguous
              const signed char* __restrict__ tiles,   // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
              int tile_heads, int Hq, int group, int Nq, int Nk, int d,
              float scale, MASK_PARAMS, DROPOUT_PARAMS MOD_PARAMS FACTORED_PARAMS) {   // modifiers only (tc_mods.cuh)
    constexpr int THREADS = WARPS * 32;
    constexpr int NT = BC / 8;          // n8 tiles of S and dP (keys)
    constexpr int ND = D / 8;           // n8 tiles of dQ
    constexpr unsigned KVBUF = BC * D * 2;   // bytes between the two buffers of K (and of V)
    static_assert(D == 64 || D == 128, "head dim padded to 64 or 128");
    static_assert(BR == 16 * WARPS && BC % 16 == 0, "16 query rows per warp; BC a multiple of 16");
    extern __shared__ __align__(1024) uint4 smem_u4[];
    T* sQ = reinterpret_cast<T*>(smem_u4);   // [BR][D] swizzled
    T* sdO = sQ + BR * D;                     // [BR][D]
    T* sK = sdO + BR * D;                     // [2][BC][D]: the next tile lands during this one
    T* sV = sK + 2 * BC * D;                  // [2][BC][D]

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int tr = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / group;
    const int row0 = tr * BR, wrow = warp * 16, nTc = (Nk + BC - 1) / BC, dch = d / 8;
    const float scale_log2 = scale * LOG2E_F, ds_scale = bwd_ds_scale(scale FACTORED_ARGS);   // dQ's factor
#ifdef FA_SCORE_MOD
    const BwdModScales msc = bwd_mod_scales(scale FACTORED_ARGS);
#endif
#ifdef FA_DIST_BIAS
    const float slope_raw = dist_slope(b, h FA_SM_ARGS) / scale;    // the bias in raw-score units (tc_mods.cuh)
#endif
    const T* Kb = K + b * k_sb + hk * k_sh;
    const T* Vb = V + b * v_sb + hk * v_sh;
#ifdef FA_MODS
    const signed char* trow = tiles + (mod_tile_index(mod_tile_b, tile_heads, b, h) * gridDim.x + tr) * nTc;
#else
    const signed char* trow = tiles + ((long long)(tile_heads == 1 ? 0 : h) * gridDim.x + tr) * nTc;
#endif
    int t, t1;
    band_tiles(row0, min(row0 + BR, Nq) - 1, band_lo, band_hi, Nk, BC, t, t1);
#ifdef FA_MASK_MOD
    t = first_live_tile([trow](int u) { return (int)trow[u]; }, t, t1);      // as in fa2_tc.cu
#else
    t = next_live_tile(trow, t, t1);
#endif

    const TileBases qa = tile_bases<T, D>(sQ, sK, sV, wrow, lane);    // .q: Q as A, .k: K as B
    const TileBases da = tile_bases<T, D>(sdO, sV, sK, wrow, lane);   // .q: dO as A, .k: V as B, .v: K as B^T

    load_tile_async<T, BR, D, THREADS>(sQ, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, dch);
    load_tile_async<T, BR, D, THREADS>(sdO, dO + b * do_sb + h * do_sh, do_sm, row0, Nq, dch);
    if (t <= t1) {
        load_tile_async<T, BC, D, THREADS>(sK, Kb, k_sm, t * BC, Nk, dch);
        load_tile_async<T, BC, D, THREADS>(sV, Vb, v_sm, t * BC, Nk, dch);
    }
    cp_async_commit();

    float L[2], Dr[2];                  // this lane's rows g and g + 8: lse (log2 units) and D
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int i = row0 + wrow + g + 8 * hr;
        L[hr] = i < Nq ? LSE[(long long)bh * Nq + i] * LOG2E_F : NEG_INF;
        Dr[hr] = i < Nq ? Dv[(long long)bh * Nq + i] : 0.0f;
    }
    float dq[1][ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[0][n][e] = 0.0f;

    int buf = 0;
    while (t <= t1) {
        const int next = next_live_tile(trow, t + 1, t1);
        cp_async_wait<0>();
        __syncthreads();                              // K_t, V_t landed; every warp is done with the other buffer
        if (next <= t1) {
            load_tile_async<T, BC, D, THREADS>(sK + (buf ^ 1) * BC * D, Kb, k_sm, next * BC, Nk, dch);
            load_tile_async<T, BC, D, THREADS>(sV + (buf ^ 1) * BC * D, Vb, v_sm, next * BC, Nk, dch);
        }
        cp_async_commit();
        const unsigned off = buf * KVBUF;
        const int cls = trow[t], col0 = t * BC;
        float s[1][NT][4], dp[1][NT][4];
#ifdef FA_DIST_BIAS
        seed_scores(s, slope_raw, row0 + wrow, col0, g, tq);   // tc_mods.cuh: the bias seeds S
#endif
        gemm_qk<T, D, FA_SEED_S>(s, qa.q, qa.k + off);   // S = Q K_t^T
        gemm_qk<T, D>(dp, da.q, da.k + off);         // dP = dO V_t^T
        const bool masked = cls != TILE_FULL || col0 + BC > Nk || row0 + BR > Nq;
#ifdef FA_SCORE_MOD
        const float fi0 = (float)(row0 + wrow + g), fj0 = (float)(col0 + 2 * tq);   // tc_mods.cuh: fi, fj
#endif
        auto elementwise = [&](bool tile_masked, bool core_grad) {     // dS into s (fa2_tc_bwd's lambda, S's layout)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int i = row0 + wrow + g + 8 * hr, j = col0 + n * 8 + 2 * tq;   // j, j + 1 share a Philox word
                    uint4 w = make_uint4(0, 0, 0, 0);
                    if (DROPOUT) w = dropout_words<R>(drop, bh, i, j >> 2);
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int e = 2 * hr + c;
#ifdef FA_MODS
                        const bool vis = L[hr] != NEG_INF &&
                                         (!tile_masked || (i < Nq && j + c < Nk &&
                                                      (cls == TILE_FULL || mod_visible(mask, b, h, i, j + c, MOD_FN_ARGS))));
                        float x2 = s[0][n][e] * scale_log2, gr = 1.0f;   // the logit in log2 units, mod'(s)
#ifdef FA_SCORE_MOD
                        if (vis) {
                            const float fi = fi0 + (float)(8 * hr), fj = fj0 + (float)(n * 8 + c);
                            x2 = bwd_mod_logit(s[0][n][e], gr, core_grad, msc, b, h, i, j + c, fi, fj FA_SM_ARGS);
                        }
#endif
                        const float p = vis ? exp2_ftz(x2 - L[hr]) : 0.0f;
                        const float f = DROPOUT && vis ? dropout_factor(drop, word_of(w, (j & 3) + c)) : 1.0f;
                        s[0][n][e] = p * (dp[0][n][e] * f - Dr[hr]) * gr;   // dS_raw = dS_mod o mod'(s)
#else
                        const bool vis = L[hr] != NEG_INF &&
                                         (!tile_masked || (i < Nq && j + c < Nk && (cls == TILE_FULL || mask.visible(h, i, j + c))));
                        const float p = vis ? exp2_ftz(s[0][n][e] * scale_log2 - L[hr]) : 0.0f;
                        const float f = DROPOUT && vis ? dropout_factor(drop, word_of(w, (j & 3) + c)) : 1.0f;
                        s[0][n][e] = p * (dp[0][n][e] * f - Dr[hr]);   // dS = P o (dP Z / (1 - p) - D)
#endif
                    }
                }
        };
        elementwise_forms<!DROPOUT>(elementwise, masked, s, BWD_CORE_ARG);
        gemm_pv<T, D, BC>(dq, s, da.v + off);        // dQ += dS K_t, dS from registers
        buf ^= 1;
        t = next;
    }
    cp_async_wait<0>();

#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int i = row0 + wrow + g + 8 * hr;
        if (i >= Nq) continue;
        T* row = dQ + ((long long)bh * Nq + i) * d;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            const int c = n * 8 + 2 * tq;
            if (c < d) *reinterpret_cast<unsigned*>(row + c) = Elem<T>::pack(dq[0][n][2 * hr] * ds_scale, dq[0][n][2 * hr + 1] * ds_scale);
        }
    }
}

// ---- the wide head dims, D = 192 and 256: fa2_tc_bwd_wide (design in the header)

// A [ROWS][D] 16-bit tile as D / 64 panels [ROWS][64]: 128-byte rows whose 16-byte chunk c sits at c ^ (row % 8).
// Element offset of (row, chunk). Rows of 128 bytes at every D: the ldmatrix addresses of a k-step or a column
// pair are the lane's base XOR (pair % 4) << 5 plus a compile-time panel offset, also at D = 192, whose
// 384-byte rows would break the XOR of tc_gemm.cuh (it needs power-of-two rows).
template <int ROWS>
__device__ __forceinline__ int panel_offset(int row, int chunk) {
    return (chunk >> 3) * (ROWS * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// Rows [row0, row0 + ROWS) of a [N, d] matrix (row stride srow) into panels, asynchronously; rows >= N and
// chunks >= dchunks zero-filled. Thread t copies chunk t % 32 of every (THREADS / 32)-th row (threads past
// D / 8 chunks idle: a quarter at D = 192), so that row % 8, and the swizzle, stay fixed across its steps.
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_panels_async(T* dst, const T* __restrict__ src, long long srow, int row0,
                                                  int N, int dchunks) {
    constexpr int STEP = THREADS / 32;
    static_assert(D / 8 <= 32 && STEP % 8 == 0 && ROWS % STEP == 0, "one chunk column per thread, 8k rows a step");
    const int c = threadIdx.x % 32, r = threadIdx.x / 32;
    if (c >= D / 8) return;
    const bool col_in = c < dchunks;
    const T* g = src + (long long)(row0 + r) * srow + c * 8;
    const unsigned s = smem_addr(dst + panel_offset<ROWS>(r, c));
#pragma unroll
    for (int it = 0; it < ROWS / STEP; ++it) {
        const bool in = col_in && row0 + r + it * STEP < N;
        cp_async_16(s + it * STEP * 128, in ? g : src, in ? 16 : 0);
        g += STEP * srow;
    }
}

// ldmatrix row addresses (bytes) of a lane in a panel tile, the three operand patterns of tc_gemm.cuh's
// tile_bases: A (16 rows from `row`, k along the head dim), B (n along rows from `row`, k along the head dim)
// and B^T (k along rows, n along the head dim). `row` a multiple of 8. k-step kk (16 columns) of A and B, or
// column pair q of B^T: base ^ ((x % 4) << 5) plus (x / 4) panels.
__device__ __forceinline__ unsigned panel_a(unsigned base, int row, int lane) {
    return base + (row + lane % 16) * 128 + (((lane / 16) ^ (lane & 7)) << 4);
}
__device__ __forceinline__ unsigned panel_b(unsigned base, int row, int lane) {
    return base + (row + (lane / 16) * 8 + (lane & 7)) * 128 + ((((lane / 8) & 1) ^ (lane & 7)) << 4);
}
__device__ __forceinline__ unsigned panel_bt(unsigned base, int lane) {
    return base + (((lane / 8) & 1) * 8 + (lane & 7)) * 128 + (((lane / 16) ^ (lane & 7)) << 4);
}

// c = A B^T for 16 rows (A, ROWS_A-row panels) by 8 NT rows (B, ROWS_B-row panels) over k = D: the S^T and dP^T
// GEMMs of fa2_tc_bwd_wide (A: this warp's 16 keys of K or V; B: its half of the Q or dO tile). SEEDED: c += A B^T
// (a distance bias where the accumulator starts, tc_mods.cuh seed_scores_t).
template <typename T, int D, int ROWS_A, int ROWS_B, bool SEEDED = false, int NT>
__device__ __forceinline__ void gemm_panels(float (&c)[NT][4], unsigned a_base, unsigned b_base) {
    if constexpr (!SEEDED) {
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[n][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, (a_base ^ ((kk & 3) << 5)) + (kk >> 2) * (ROWS_A * 128));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned b[4];
            ldmatrix_x4(b, (b_base ^ ((kk & 3) << 5)) + (kk >> 2) * (ROWS_B * 128) + np * 16 * 128);
            mma_16816<T>(c[2 * np], a, b);
            mma_16816<T>(c[2 * np + 1], a, b + 2);
        }
    }
}

// acc += A B over k = BR queries: A (16 keys x BR) from a [BC][BR] tile of P^T or dS^T (rows of BR = 64, ds_chunk
// swizzle) by ldmatrix, B (BR x this warp's columns) from the Q or dO panels by ldmatrix.trans. The warp's
// columns: 32 of each 64-column panel m, 32 hs .. 32 hs + 31 (hs folded into bt_base), n8 tile 4 m + t.
template <typename T, int D, int BR>
__device__ __forceinline__ void gemm_strip(float (&acc)[D / 16][4], unsigned a_base, unsigned bt_base) {
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, a_base ^ (kk << 5));
#pragma unroll
        for (int m = 0; m < D / 64; ++m)
#pragma unroll
            for (int jp = 0; jp < 2; ++jp) {
                unsigned b[4];
                ldmatrix_x4_trans(b, (bt_base ^ (jp << 5)) + m * (BR * 128) + kk * 16 * 128);
                mma_16816<T>(acc[4 * m + 2 * jp], a, b);
                mma_16816<T>(acc[4 * m + 2 * jp + 1], a, b + 2);
            }
    }
}

template <typename T, int D, int BR, int BC, int WARPS, int R, bool DROPOUT>
__global__ void __launch_bounds__(WARPS * 32, 1)
fa2_tc_bwd_wide(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,     // [B, Hq, Nq, d]
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
                float scale, MASK_PARAMS, DROPOUT_PARAMS MOD_PARAMS FACTORED_PARAMS) {   // fa2_tc_bwd's signature
    constexpr int THREADS = WARPS * 32;
    constexpr int NQH = BR / 16;        // n8 tiles of this warp's S^T / dP^T: half the tile's queries
    constexpr int NDW = D / 16;         // n8 tiles of this warp's dK, dV: half the head dim
    static_assert(D == 192 || D == 256, "the wide head dims (fa2_tc_bwd holds D = 64 and 128)");
    static_assert(BR == 64 && BC == 64 && WARPS == 8, "4 key strips x 2 halves; 4 dQ row groups x 2 halves");
    extern __shared__ __align__(1024) uint4 smem_u4[];
    T* sK = reinterpret_cast<T*>(smem_u4);   // [D/64][BC][64] panels
    T* sV = sK + BC * D;                      // [D/64][BC][64]
    T* sQ = sV + BC * D;                      // [2][D/64][BR][64]: two buffers, the next Q tile lands during this one
    T* sdO = sQ + 2 * BR * D;                 // [2][D/64][BR][64]
    T* sP = sdO + 2 * BR * D;                 // [BC][BR] P_drop^T, swizzled rows of BR (ds_chunk)
    T* sdS = sP + BC * BR;                    // [BC][BR] dS^T
    float* sL = reinterpret_cast<float*>(sdS + BC * BR);   // [2][BR] lse in log2 units
    float* sD = sL + 2 * BR;                               // [2][BR] rowsum(dO o O)
    constexpr unsigned QBUF = BR * D * 2;                  // bytes between the two buffers of Q (and of dO)

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int strip = warp % (BC / 16), hs = warp / (BC / 16);    // key strip (and dQ row group), half
    const int tc = blockIdx.x, bhk = blockIdx.y, b = bhk / Hkv, hk = bhk % Hkv;
    const int col0 = tc * BC, wkey = strip * 16, qh = hs * (BR / 2), wq = strip * 16, dch = d / 8;
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC;
    const float scale_log2 = scale * LOG2E_F, ds_scale = bwd_ds_scale(scale FACTORED_ARGS);   // dK's, dQ's factor
#ifdef FA_SCORE_MOD
    const BwdModScales msc = bwd_mod_scales(scale FACTORED_ARGS);
#endif

    // S^T, dP^T: this warp's 16 keys (A) x the tile's queries qh .. qh + BR/2 - 1 (B), k = D
    const unsigned kA = panel_a(smem_addr(sK), wkey, lane), vA = panel_a(smem_addr(sV), wkey, lane);
    const unsigned qB = panel_b(smem_addr(sQ), qh, lane), doB = panel_b(smem_addr(sdO), qh, lane);
    // dV, dK: P^T / dS^T of the strip (A, every query) x dO / Q over this half's columns (B^T)
    const unsigned pA = smem_addr(sP) + (wkey + lane % 16) * (BR * 2) + (((lane / 16) ^ (lane & 7)) << 4);
    const unsigned dsA = pA - smem_addr(sP) + smem_addr(sdS);
    const unsigned doT = panel_bt(smem_addr(sdO), lane) ^ ((2 * hs) << 5), qT = panel_bt(smem_addr(sQ), lane) ^ ((2 * hs) << 5);
    // dQ: dS (A^T of dS^T, fa2_tc_bwd's pattern at BR = 64) x K over this half's columns (B^T)
    const int dsr = (lane / 16) * 8 + (lane & 7);
    const unsigned dsT = (smem_addr(sdS) + dsr * (BR * 2) + (ds_chunk<BR>(dsr, (lane / 8) & 1) << 4)) ^ (strip << 5);
    const unsigned kT = panel_bt(smem_addr(sK), lane) ^ ((2 * hs) << 5);

    load_panels_async<T, BC, D, THREADS>(sK, K + b * k_sb + hk * k_sh, k_sm, col0, Nk, dch);
    load_panels_async<T, BC, D, THREADS>(sV, V + b * v_sb + hk * v_sh, v_sm, col0, Nk, dch);
    cp_async_commit();

    float dk[NDW][4], dv[NDW][4];
#pragma unroll
    for (int n = 0; n < NDW; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
    BWD_WALK_RANGE
    auto advance = [&](int& gi, int& t) {
        if (t0 > t1) return false;
        do {
            if (++t > t1) { t = t0; if (++gi >= group) return false; }
        } while (cls_of(gi, t) == TILE_EMPTY);
        return true;
    };
    auto issue = [&](int gi, int t, int buf) {
        const int h = hk * group + gi, bh = b * Hq + h, row0 = t * BR;
        load_panels_async<T, BR, D, THREADS>(sQ + buf * BR * D, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, dch);
        load_panels_async<T, BR, D, THREADS>(sdO + buf * BR * D, dO + b * do_sb + h * do_sh, do_sm, row0, Nq, dch);
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
        __syncthreads();                              // this tile landed; every warp is done with the last one
        if (have) issue(gi, t, buf ^ 1);              // the next tile flies while this one is computed
        cp_async_commit();
        buf ^= 1;
        const int h = hk * group + cgi, bh = b * Hq + h, cls = cls_of(cgi, ct), row0 = ct * BR;
        const unsigned off = cbuf * QBUF;
        const float* cL = sL + cbuf * BR;
        const float* cD = sD + cbuf * BR;
        {
            float s[NQH][4], dp[NQH][4];
#ifdef FA_DIST_BIAS
            seed_scores_t(reinterpret_cast<float (&)[1][NQH][4]>(s), dist_slope(b, h FA_SM_ARGS) / scale, col0 + wkey,
                          row0 + qh, g, tq);   // tc_mods.cuh: the bias seeds S^T
#endif
            gemm_panels<T, D, BC, BR, FA_SEED_S>(s, kA, qB + off);   // S^T: this warp's 16 keys x its half of the queries
            gemm_panels<T, D, BC, BR>(dp, vA, doB + off);   // dP^T = V dO^T
            const bool masked = cls != TILE_FULL || col0 + BC > Nk || row0 + BR > Nq;
#ifdef FA_SCORE_MOD
            const float fi0 = (float)(row0 + qh + 2 * tq), fj0 = (float)(col0 + wkey + g);   // tc_mods.cuh: fi, fj
#endif
            auto elementwise = [&](bool tile_masked, bool core_grad) {   // P_drop^T into s, dS^T into dp (as fa2_tc_bwd)
#pragma unroll
                for (int n = 0; n < NQH; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int x = qh + n * 8 + 2 * tq + (e & 1), i = row0 + x;          // query
                        const int j = col0 + wkey + g + (e >= 2 ? 8 : 0);                    // key
                        const float L = cL[x];
#ifdef FA_MODS
                        const bool vis = L != NEG_INF &&
                                         (!tile_masked || (i < Nq && j < Nk && (cls == TILE_FULL || mod_visible(mask, b, h, i, j, MOD_FN_ARGS))));
                        float x2 = s[n][e] * scale_log2, gr = 1.0f;   // the logit in log2 units, mod'(s)
#ifdef FA_SCORE_MOD
                        if (vis) {
                            const float fi = fi0 + (float)(n * 8 + (e & 1)), fj = fj0 + (float)(e >= 2 ? 8 : 0);
                            x2 = bwd_mod_logit(s[n][e], gr, core_grad, msc, b, h, i, j, fi, fj FA_SM_ARGS);
                        }
#endif
                        const float p = vis ? exp2_ftz(x2 - L) : 0.0f;
#else
                        const bool vis = L != NEG_INF && (!tile_masked || (i < Nq && j < Nk && (cls == TILE_FULL || mask.visible(h, i, j))));
                        const float p = vis ? exp2_ftz(s[n][e] * scale_log2 - L) : 0.0f;
#endif
                        float f = 1.0f;                       // Z / (1 - p) of element (i, j)
                        if (DROPOUT && vis) f = dropout_factor(drop, word_of(dropout_words<R>(drop, bh, i, j >> 2), j & 3));
                        s[n][e] = p * f;                      // P_drop^T (dV's A operand)
#ifdef FA_MODS
                        dp[n][e] = p * (dp[n][e] * f - cD[x]) * gr;   // dS_raw = dS_mod o mod'(s)
#else
                        dp[n][e] = p * (dp[n][e] * f - cD[x]);   // dS^T = P o (dP Z / (1 - p) - D)
#endif
                    }
            };
            elementwise_forms<!DROPOUT>(elementwise, masked, s, BWD_CORE_ARG);
            // P_drop^T and dS^T (16-bit) to shared memory: the strip's other half needs them, and dQ needs dS^T
#pragma unroll
            for (int n = 0; n < NQH; ++n)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int row = wkey + g + 8 * hr, col = qh + n * 8 + 2 * tq;
                    const int at = row * BR + (ds_chunk<BR>(row, col / 8) << 3) + (col % 8);
                    *reinterpret_cast<unsigned*>(sP + at) = Elem<T>::pack(s[n][2 * hr], s[n][2 * hr + 1]);
                    *reinterpret_cast<unsigned*>(sdS + at) = Elem<T>::pack(dp[n][2 * hr], dp[n][2 * hr + 1]);
                }
        }
        __syncthreads();
        gemm_strip<T, D, BR>(dv, pA, doT + off);          // dV += P_drop^T dO over this half's columns
        gemm_strip<T, D, BR>(dk, dsA, qT + off);          // dK += dS^T Q (scaled at the end)
        // dQ rows wq..wq+15 += scale dS K over this half's columns, one 64-column panel at a time (16 floats)
        {
            unsigned a[BC / 16][4];
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) ldmatrix_x4_trans(a[kk], dsT + kk * 16 * (BR * 2));
            const bool odd = tq & 1;
            const int i = row0 + wq + g + (odd ? 8 : 0);
            float* row = dQ + ((long long)bh * Nq + min(i, Nq - 1)) * d + 4 * (tq / 2);
#pragma unroll
            for (int m = 0; m < D / 64; ++m) {
                float dq[4][4];
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
                    for (int jp = 0; jp < 2; ++jp) {
                        unsigned bk[4];
                        ldmatrix_x4_trans(bk, (kT ^ (jp << 5)) + m * (BC * 128) + kk * 16 * 128);
                        mma_16816<T>(dq[2 * jp], a[kk], bk);
                        mma_16816<T>(dq[2 * jp + 1], a[kk], bk + 2);
                    }
                add_dq_tiles(dq, row, 8 * m + 4 * hs, i < Nq, d, tq, ds_scale);   // float4 atomics (tc_softmax.cuh)
            }
        }
    }
    cp_async_wait<0>();

    // dK = ds_scale dS^T Q, dV: this warp's 16 keys, columns 64 m + 32 hs + 8 (n % 4) of n8 tile n
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int j = col0 + wkey + g + 8 * hr;
        if (j >= Nk) continue;
        T* krow = dK + ((long long)bhk * Nk + j) * d;
        T* vrow = dV + ((long long)bhk * Nk + j) * d;
#pragma unroll
        for (int n = 0; n < NDW; ++n) {
            const int c = (n / 4) * 64 + 32 * hs + (n % 4) * 8 + 2 * tq;
            if (c < d) {
                *reinterpret_cast<unsigned*>(krow + c) = Elem<T>::pack(dk[n][2 * hr] * ds_scale, dk[n][2 * hr + 1] * ds_scale);
                *reinterpret_cast<unsigned*>(vrow + c) = Elem<T>::pack(dv[n][2 * hr], dv[n][2 * hr + 1]);
            }
        }
    }
}

// D = rowsum(dO o O) in fp32, Algorithm 2's preprocessing, in one pass over the 16-bit inputs (the
// CuPy expression it replaces casts both to fp32 first: three more passes, bwd_pre="cupy"). Eight lanes
// per row, one 16-byte chunk each per step, summed by shuffles. grid ceil(rows / 32), 256 threads.
template <typename T>
__global__ void __launch_bounds__(256)
fa2_tc_bwd_rowdot(const T* __restrict__ dO, long long do_sb, long long do_sh, long long do_sm, // [B, Hq, Nq, d]
                  const T* __restrict__ O, long long o_sb, long long o_sh, long long o_sm,     // [B, Hq, Nq, d]
                  float* __restrict__ Dv,          // [B, Hq, Nq]
                  int Hq, int Nq, int d, long long rows) {
    const long long r = (long long)blockIdx.x * 32 + threadIdx.x / 8;
    float acc = 0.0f;
    if (r < rows) {
        const long long bh = r / Nq;
        const long long i = r % Nq, b = bh / Hq, h = bh % Hq;
        const T* x = dO + b * do_sb + h * do_sh + i * do_sm;
        const T* y = O + b * o_sb + h * o_sh + i * o_sm;
        for (int c = threadIdx.x % 8; c < d / 8; c += 8) {
            const uint4 u = *reinterpret_cast<const uint4*>(x + 8 * c);
            const uint4 v = *reinterpret_cast<const uint4*>(y + 8 * c);
            const unsigned us[4] = {u.x, u.y, u.z, u.w}, vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 a = Elem<T>::unpack(us[k]), o = Elem<T>::unpack(vs[k]);
                acc = fmaf(a.x, o.x, fmaf(a.y, o.y, acc));
            }
        }
    }
#pragma unroll
    for (int m = 4; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (threadIdx.x % 8 == 0 && r < rows) Dv[r] = acc;
}
