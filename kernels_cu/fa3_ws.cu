// fa3_ws.cu: the warp-specialized Hopper rungs: TMA copies on mbarriers, a producer warpgroup, consumer
// warpgroups on wgmma, and (OVERLAP) softmax overlapped with the next S GEMM; fp16 / bf16, fp32 accumulation.
//
// Seed: FA3 paper (Shah et al. 2024) Sec. 3.1 (producer-consumer asynchrony through warp
// specialization and a circular shared-memory buffer, Algorithm 1; register reallocation with
// setmaxnreg) and Sec. 3.2 (intra-warpgroup overlap of softmax with the GEMMs, Algorithm 2). The
// softmax, masks, dropout and epilogue are the tensor-core tier's (tc_softmax.cuh, FA2 paper
// Algorithm 1, Sec. 3.1); operand placement and swizzle are fa3_wgmma.cu's (hopper.cuh).
//
// Kernel
//   fa3_ws_forward<T, D, BC, NC, STAGES, OVERLAP, PINGPONG, PERSIST, R, DROPOUT>   grid (ceil(Nq / (64 NC)), B*Hq),
//       128 (NC + 1) threads. Warpgroup 0 is the producer: after giving registers back (setmaxnreg),
//       one thread issues every TMA copy: the block's Q tile once, then K_j and V_j into a ring of
//       STAGES slots, each slot guarded by a "full" mbarrier (TMA completes the bytes it announced)
//       and an "empty" one (every consumer warp arrives when its wgmma reads of the slot are done).
//       Warpgroups 1..NC consume: 64 query rows each, S = Q K_j^T and O += P V_j on wgmma, no
//       __syncthreads in the loop: the consumer warpgroups drift apart and their softmax and GEMMs
//       interleave on their own.
//       OVERLAP (FA3 Algorithm 2): S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued together, and the
//       softmax of S_{j+1} runs while O += P_j V_j is still on the tensor cores; O's rescale by
//       2^(m_j - m_{j+1}) waits for that GEMM (softmax_scores, then rescale_rows). Without it, each
//       tile's GEMMs are waited for before its softmax (the rung below).
//       PINGPONG (FA3 Sec. 3.1, with NC = 2 and OVERLAP): the two consumer warpgroups take turns issuing
//       their GEMMs through two named barriers, so one's softmax runs under the other's GEMMs.
//       FA_SOFTMAX_TURNS (-D switch, variants/fa3_ws.py softmax_turns; NC = 2, OVERLAP, not PINGPONG): the turns are
//       taken at the softmax instead: the same two named barriers around scores_to_p, so that the two warpgroups'
//       softmaxes never run at once and each one's runs beside the other's GEMMs and tail, whatever their lengths
//       (ping-pong orders the GEMMs and leaves a softmax longer than the other's GEMMs to collide: the soft-cap's).
//       Both warpgroups walk the same tiles of the same items, so the turns alternate across a persistent block's items
//       too. Predicted from the loop trace (H100, N = 4k causal, d = 128): the soft-cap's period from ~4,500 to ~3,000
//       clocks, since its softmax alone would be ~1,250 (130 MUFU ops a thread at 8 clocks a warp, 1,040, and the row
//       max). Measured (bench/results/h100/2026-11-27-session-17.md, one run beside SDPA): the soft-cap unchanged
//       (0.619 against 0.620 ms). Its trace's softmax phase (2,500-2,650 clocks) now includes the wait for the turn (a
//       third of it): alone a soft-capped softmax takes ~1,700 clocks, 1.6x its MUFU bound, and the two back to back
//       fill ~80% of the 4,261-clock period. The SASS suggests why: ptxas issues the 64 MUFU.TANH back to back, then
//       the row max, then the 64 MUFU.EX2, then the sums and conversions, so ~420 other instructions run after the MUFU
//       ops instead of in the 7 idle issue slots each one leaves (in-order issue, one MUFU op per 8 clocks; not yet
//       tested: ptxas chooses that order). Plain d = 128: 1-3% faster non-causal, 2-13% causal (655-658 TFLOP/s at
//       8k-16k non-causal, 0.99-1.04x cuDNN; causal 0.98-1.06x at 4k-16k), 0-4% with modifiers; d = 64 0-8% slower
//       non-causal and 4-11% causal than three consumers, with modifiers mixed (ALiBi, document, sinks 2-5% faster, the
//       soft-cap 7% slower): on at D = 128 ("auto").
//       Tried and reverted (session 17): O += P_j V_j issued one k16 wgmma at a time with an eighth of S_{j+1}'s
//       softmax after each (a warp issuing wgmmas resumes only when the last ones start, so the overlapped loop's
//       softmax waits for P V's issue), predicted -30% soft-cap period: measured 8% SLOWER with the soft-cap (0.668
//       against 0.618 ms, d = 128), 4% slower plain, 3% faster plain at d = 64; ptxas kept the order (SASS) but put a
//       WARPGROUP.ARRIVE before each wgmma. Ping-pong with every 2nd-4th exp2 on the FMA pipe: 4-10% slower with the
//       soft-cap.
//       FA_MUFU_PIPE (variants/fa3_ws.py mufu_pipe, with a score modifier; scores_to_p's pipe_full): the test of the
//       SASS reading above. ptxas then interleaves MUFU.TANH with FMNMX two by two (SASS). Predicted: the soft-capped
//       softmax ~1,700 -> ~1,400 clocks, the soft-cap ~10% faster at d = 128. Measured (H100, N = 4k causal, one A/B
//       in one call, the baseline run before and after): 0.600 against 0.614 / 0.620 ms at d = 128 (-3%), 0.908
//       against 0.967 / 0.962 at d = 64 (-6%), outputs and lse bit for bit equal; plain causal unchanged. Off by
//       default: FA_SCORE_MONOTONE (below) is as fast at d = 64 and faster at d = 128; where both are set, this one
//       runs (scores_to_p tries pipe_full first).
//       FA_SCORE_MONOTONE (sandbox/modifiers.py ScoreMod.monotone: the soft-cap; tc_mods.cuh mod_row_max): a full
//       tile's row max on the raw scores, the modifier applied to the two maxima, the whole softmax in that branch.
//       The dependency mufu_pipe worked around is gone: no MUFU.EX2 waits for the tile's last MUFU.TANH (SASS: the
//       EX2s interleave with the TANHs). Predicted: the soft-capped softmax near its MUFU bound, -8-12% soft-cap at
//       d = 128. Measured (H100, N = 4k causal, ABAB in one run): 0.574-0.582 against 0.612-0.620 ms at d = 128
//       (-6%), 0.908-0.927 against 0.966-0.968 at d = 64 (-5%), outputs and lse bit for bit equal; the loop trace
//       (d = 128) still shows a period 14% above plain causal's (3,894 against 3,406 clocks). exp2_fma = 2-4 on top
//       of it: 4-18% slower.
//       FA_Q_PRESCALE (variants/fa3_ws.py q_prescale, off by default; with a score modifier's text): each consumer
//       warpgroup multiplies its rows of the Q tile by mod_scale in shared memory once per item (prescale_q, below),
//       so that no score needs the FMUL before the modifier; 6% off the soft-cap at d = 64, lse less precise.
//       FA_P_SMEM (variants/fa3_ws.py p_smem, off by default; OVERLAP, Bc 64 or 128, D <= 128): P_j waits for V_j
//       in a [64][BC] tile of shared memory per consumer warpgroup (hopper.cuh store_p: stmatrix), and O += P_j V_j
//       reads its A operand there (wg_gemm_pv_ss) instead of from 32 registers (FA3's P V with P in shared memory
//       rather than registers), so that S_{j+1}'s softmax has them. Predicted (session 23's SASS: S, O and the
//       in-flight P hold 128 of the 160 registers of a three-consumer thread): a spill-free three-consumer
//       soft-cap at d = 64, which would then gain what ALiBi gained from three consumers. Built (NVRTC 13, sm_90a):
//       44 bytes of spill stored instead of 412 on the persistent grid, 68 instead of 556 on the per-tile one (four
//       stmatrix addresses and one row sum, reloaded once an iteration). Measured (H100, d = 64, N = 2k-16k causal,
//       bench/results/h100/2026-11-27-session-24.md, with a 128-thread barrier after the stores): plain causal 9-11%
//       SLOWER (ncu, N = 4k: 9% more instructions, shared-memory wavefronts 47M -> 89M: the SS wgmma reads P as
//       well as V), the soft-cap on three consumers +46-52% over plain causal against the two-consumer default's
//       +43-53% (3-4% slower at 2k-4k, 1-3% faster at 8k-16k). With the warp barrier of today's code: plain causal
//       8-9% slower, the soft-cap +46% against fa3's default +42% (three consumers without the overlap, since
//       session 24: variants/fa3_ws.py serial_three). Bit for bit the same results as P in registers; an option.
//       PERSIST (FA3 Sec. 3.1's persistent kernel and its dynamic tile scheduler; issue 17 step 5): grid
//       (min(items, SMs), 1), each block taking (Q tile, batch, head) items from an atomic counter, head by
//       head, a head's last Q tiles first. Q has two buffers (q_full / q_empty mbarriers, released by the consumers once an item's
//       GEMMs are done) and the K / V ring runs on across items, so the producer loads the next item's Q and
//       first K / V while this one's last GEMMs and epilogue run: a non-persistent block starts with the
//       copies' whole latency exposed and 1 block fits an SM. D <= 128 (two Q buffers fit), no ping-pong.
//       Predicted (H100, fp16): +5-10% forward at N = 2k non-causal (~16 K / V tiles per item: a ~2 us start of
//       ~25 us), +8-15% causal at N = 2k (half the tiles per item on average), within 2% at N = 16k.
//       Measured (bench/results/h100/2026-11-26-session-8.md, same run as the default grid): d = 128 +6% / +8%
//       at N = 2k (non-causal / causal), 0 to +1% at 16k; d = 64 +3% / +6% at 2k but 3-4% slower from N = 8k
//       (not explained), so the host's persistent="auto" turned it on at D = 128 only; since session 9 also at D = 64
//       where a query row sees at most 3k keys on average (2026-11-26-session-9.md: +6% causal at N = 2k).
//       Tried and reverted (session 9): each consumer warpgroup walking only the tiles of its own rows' band (the
//       others' ring turns drained), predicted +8-12% causal at d = 64, N = 2k: measured +1%, and the non-causal
//       forward 5-7% slower (the drain loops around the main loop); the block's time follows its last warpgroup.
//   Tensor maps (variants/fa3_ws.py): 4-D (d, N, H, B) with the caller's strides, box 64 x rows, the
//   128-byte swizzle: each box lands as one [rows][64] panel of hopper.cuh's layout. Rows past N and
//   columns past d come back as zeros (TMA's out-of-bounds fill), so any Nq, Nk and d <= D work.
// Masks, dropout, GQA, dead rows: as fa2_tc.cu (the host's tile table and band bound the tile loop of
// producer and consumers alike; the element predicate runs in partial tiles).
// Bottom-aligned Q tiles (row_shift, variants/fa3_ws.py row_shift): where a band bounds a row's keys from above
// (causal), Q tile t starts at row t BR - row_shift, so that the one partial tile is the first (rows < 0: TMA's
// zero fill, computed on zero Q where the band lets them see keys, never written) and not the last, whose walk
// is the longest: Br = 192 at N = 2k
// causal leaves a third of the last tile's rows empty for all 16 of its key tiles. Not with a block-sparse layout
// or a mask modifier (their tile tables are top-aligned; the host passes 0 there). With score modifiers and sinks
// since session 23: a full tile needs row0 >= 0 and the partial path checks 0 <= i < Nq, so that the modifier never
// sees a row above 0 (a buffer indexed by i). Predicted (H100, d = 64, causal, fa3):
// +4-5% at N = 2k-4k (5.2% / 5.8% less tile work), ~+1% at 8k-16k, nothing non-causal (shift 0). Measured
// (2026-11-26-session-9.md, same call): fa3 +6.3% / +8.3% / +0.8% / +1.1% at N = 2k / 4k / 8k / 16k, fa3-ws
// +3.4% / +6.8% / +0.2% / +1.6%: 0.91-0.99x SDPA cuDNN causal, was 0.85-0.98x.
// Score and mask modifiers (issue 18): as fa2_tc.cu, compiled in by tc_mods.cuh's -D switches (without
// them MOD_PARAMS is empty and the kernel is the one without modifiers): mod_scores where mask_scores ran
// (the wgmma accumulator is mma.sync's C layout per warp: row row0 + wrow + g + 8 (e >= 2), column
// col0 + 8 n + 2 tq + (e & 1)), fold_sinks before write_output; the host folds the mask modifier's tile
// classes into the tile table ([mod_tile_b x tile_heads] rows), which producer and consumers both walk.
// Tried and reverted (session 14): a soft-cap's row max taken on the raw scores (tanh never decreases, so a full
// tile's max of cap tanh(s / cap) is that of its raw max), so that the max's FMNMX chain would run beside the tanh's
// MUFU ops instead of after them; predicted a few percent off the soft-cap's forward. Measured (H100, N = 4k causal,
// two alternating runs, outputs bit-identical): 10% SLOWER at d = 64 (1.07 against 0.96-0.97 ms) and at d = 128
// (0.681 against 0.615-0.620 ms).
// Tried and reverted, twice (sessions 19 and 21; session 19's attempt was recorded in its results file only, so session
// 21 repeated it): the soft-cap's tanh on the FMA pipe, x Q(x^2) in full tiles whose |s / cap| all stay within a limit
// (a warp vote), so that the only MUFU op per element would be the softmax's EX2. Session 19: Q of degree 3, |x| <= 1,
// +25% over plain causal at d = 128 against +15%, +49% against +35% at d = 64. Session 21: Q of degree 2 (2.3e-5
// relative error), |x| <= 0.5; predicted the soft-capped softmax's MUFU bound from ~1,000 clocks a tile to ~500. Measured (H100,
// N = 4k / 8k causal, ABAB): +38% / +43% over plain causal at d = 64 against MUFU.TANH's +37% / +47%, and +23% / +25%
// against +15% / +16% at d = 128; every 2nd, 3rd or 4th n8 block on the polynomial no better (+27% to +32% at d = 128);
// the backward's small tiles (fa3_bwd2.cu FA_TANH_CORE) with the polynomial unchanged (2.417 against 2.426 ms, d = 64,
// 4k). ncu: 25% more instructions executed for 8% more cycles at d = 128 (prescale_q below: why instructions).
// Loop trace (FA_TRACE, variants/fa3_ws.py trace=True; bench/loop_trace.py reads it): the overlapped loop of the
// grid's block 0 stores clock64() at eight points of every iteration (TRACE_EV below), lane 0 of each consumer
// warpgroup's first warp, into fa_trace[warpgroup][iteration][event] (the first FA_TRACE_ITERS iterations; the reader
// zeroes it before the launch). Without FA_TRACE the macros are empty: the kernel is the same. What it showed (H100,
// N = 4k causal, bench/results/h100/2026-11-26-session-15.md): issuing a warpgroup's 16 wgmmas takes about as long as
// they run (the warp resumes only when its last ones start), so its softmax starts when its own P V is almost done,
// and without ping-pong the two warpgroups issue together and run their softmax together. At d = 64 (session 22,
// bench/results/h100/2026-11-27-session-22.md): a soft-capped iteration takes ~3,090 clocks, 1,950-1,990 in the softmax
// and 1,090-1,140 outside it; one warp drives the MUFU at 68% of its peak, two at 95% (a microbenchmark of the same body), so
// with the warpgroups' outside phases end to end the iteration still takes >= 2,815 clocks, +24% over plain causal's
// 2,270 per 128 rows. Ping-pong and turns were measured slower again; three consumers without the overlap (fa3-ws,
// persistent) 3-5% faster from N = 8k only. The README's table of what was tried against the soft-cap has the rest.
// Envelope: D in {64, 128, 192, 256}, BC in {64, 80, 112, 128}, NC in {1, 2, 3}, STAGES in {2, 3}; shared
// memory and (D > 128) registers checked on the host (variants/fa3_ws.py). D = 256 runs FA3's tile: Br = 128
// (NC = 2, 240 registers per consumer thread, O alone 128), Bc = 80, STAGES = 2: 64 KB of Q and 160 KB of
// K / V slots; D = 192: Bc = 112, 48 + 168 KB.
#include "tc_softmax.cuh"
#include "tc_mods.cuh"
#include "hopper.cuh"

// ---- the loop trace (header: FA_TRACE)
#ifdef FA_TRACE
#define FA_TRACE_ITERS 512
// events: 0 the iteration's top, 1 K_{j+1} and V_j landed, 2 its turn (ping-pong), 3 S_{j+1}'s wgmmas issued,
// 4 P_j V_j's issued, 5 S_{j+1} done, 6 its softmax done (SM_TURNS: the wait for the turn between 5 and 6), 7 P_j V_j
// done
__device__ long long fa_trace[3][FA_TRACE_ITERS][8];
#define TRACE_EV(ev) do { if (blockIdx.x == 0 && blockIdx.y == 0 && lane == 0 && warp % 4 == 0 && \
                              trace_i < FA_TRACE_ITERS) fa_trace[c][trace_i][ev] = clock64(); } while (0)
#define TRACE_NEXT() (++trace_i)
#define TRACE_DECL int trace_i = 0
#else
#define TRACE_EV(ev) do {} while (0)
#define TRACE_NEXT() do {} while (0)
#define TRACE_DECL
#endif

#ifdef FA_SOFTMAX_TURNS
constexpr bool SOFTMAX_TURNS = true;
#else
constexpr bool SOFTMAX_TURNS = false;
#endif
#ifdef FA_P_SMEM
constexpr bool P_SMEM = true;
#else
constexpr bool P_SMEM = false;
#endif

// ---- device helpers

// The tile sequence every role walks: the band's range, minus the tiles the table marks empty.
struct TileWalk {
    const signed char* cls;
    int first, last;
    __device__ __forceinline__ int next(int t) const { return next_live_tile(cls, t + 1, last); }
};

// 32-bit shared-memory store / load by address (the item slots), ordered against the mbarrier operations
__device__ __forceinline__ void st_shared_s32(unsigned addr, int v) {
    asm volatile("st.shared.s32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_s32(unsigned addr) {
    int v;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

#ifdef FA_Q_PRESCALE
// FA_Q_PRESCALE (variants/fa3_ws.py q_prescale, with a score modifier's text; tc_mods.cuh MOD_SCORE_SCALE): this
// warpgroup's 64 rows of the Q tile (`rows`: its rows of panel 0; D / 64 panels of PANEL_Q bytes) times mod_scale in
// place, each product rounded to T, once per item, so that the S GEMM gives mod_scale q.k and no element of any
// tile needs the FMUL before the modifier. Why: ncu (H100, N = 4k causal, fp16, session 21) puts the soft-cap's
// cost in its instructions: +20% executed at d = 128 (the FMUL and MUFU.TANH per element) for +19% cycles, +21% for
// +37% at d = 64. The rows' bytes in any order (the swizzle permutes within a row's 128 bytes): 16 bytes per thread
// and step. Costs one more rounding of q (relative 2^-11 in fp16, 2^-8 in bf16; the oracle's naive reference rounds
// S itself to the dtype, as much). Measured (same call, ABAB): the soft-cap 6% faster at d = 64 (+29% / +39% over
// plain causal at N = 4k / 8k, from +38% / +47%), unchanged at d = 128 (+15% / +16%); a relative bias +5% / -4% at
// d = 64, unchanged at 128; lse's error against the float64 oracle 25-550x larger in fp16, 200-6,100x in bf16: off by
// default. With FA_MUFU_PIPE, pipe_full's factor stays tied to a runtime zero (1.0f | 0 is not a literal): the FMUL
// stays there.
// The caller fences the generic stores from the wgmma's (async proxy) reads and syncs the warpgroup.
template <typename T, int D, int PANEL_Q>
__device__ __forceinline__ void prescale_q(unsigned rows, float f, int tid) {
#pragma unroll
    for (int p = 0; p < D / 64; ++p)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned a = rows + p * PANEL_Q + (k * 128 + tid) * 16;
            unsigned v[4];
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(a) : "memory");
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float2 x = Elem<T>::unpack(v[u]);
                v[u] = Elem<T>::pack(x.x * f, x.y * f);
            }
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                         :: "r"(a), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
        }
}
#endif

// ---- kernels

template <typename T, int D, int BC, int NC, int STAGES, bool OVERLAP, bool PINGPONG, bool PERSIST, int R, bool DROPOUT>
__global__ void __launch_bounds__((NC + 1) * 128, 1)
fa3_ws_forward(const __grid_constant__ TmaDesc map_q,   // (d, Nq, Hq, B), box (64, 64)
               const __grid_constant__ TmaDesc map_k,   // (d, Nk, Hkv, B), box (64, BC)
               const __grid_constant__ TmaDesc map_v,   // (d, Nk, Hkv, B), box (64, BC)
               T* __restrict__ O,                        // [B, Hq, Nq, d] contiguous
               float* __restrict__ LSE,                  // [B, Hq, Nq]
               unsigned* __restrict__ sched,             // PERSIST: the item counter, zero at launch and at exit; else unread
               const signed char* __restrict__ tiles,    // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
               int tile_heads, int Hq, int group, int Nq, int Nk, int d, int BH,   // BH = B * Hq
               int row_shift,                            // Q tile t: rows t BR - row_shift .. (0 <= row_shift < BR)
               float scale_log2,                         // to log2 units, > 0: |scale| log2 e (tc_mods.cuh: modifiers)
               MASK_PARAMS, DROPOUT_PARAMS MOD_PARAMS) {   // MOD_PARAMS: modifiers only (tc_mods.cuh)
    constexpr int BR = NC * 64, NT = BC / 8, ND = D / 8;
    constexpr int PANEL_Q = BR * 128, PANEL_KV = BC * 128;          // bytes of one 64-column panel
    constexpr unsigned Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
    static_assert(D == 64 || D == 128 || D == 192 || D == 256, "head dim padded to 64, 128, 192 or 256");
    static_assert(BC == 64 || BC == 80 || BC == 112 || BC == 128, "wgmma n = Bc");
    static_assert(NC >= 1 && NC <= 3 && (STAGES == 2 || STAGES == 3), "consumers, ring slots");
    static_assert(!PINGPONG || (NC == 2 && OVERLAP), "ping-pong: two consumer warpgroups, overlapped loop");
    static_assert(!PERSIST || (!PINGPONG && D <= 128), "persistent: no ping-pong, two Q buffers (D <= 128)");
    constexpr bool SM_TURNS = SOFTMAX_TURNS && OVERLAP && NC == 2;
    static_assert(!SOFTMAX_TURNS || (SM_TURNS && !PINGPONG), "softmax turns: two consumers, overlap, no ping-pong");
    static_assert(!P_SMEM || (OVERLAP && BC % 64 == 0 && D <= 128), "P from shared memory: the overlapped loop, "
                  "whole 64-key panels, D <= 128");
    constexpr int QBUFS = PERSIST ? 2 : 1;
    constexpr unsigned P_BYTES = P_SMEM ? 64 * BC * 2 : 0;          // FA_P_SMEM: one [64][BC] P tile per consumer
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;     // panels on 1024-byte boundaries
    const unsigned sK = sQ + QBUFS * Q_BYTES, sV = sK + STAGES * KV_BYTES;   // ring slot s at + s * KV_BYTES
    const unsigned sP = sV + STAGES * KV_BYTES;                      // FA_P_SMEM: consumer c's P tile at + c * P_BYTES
    const unsigned bar = sP + NC * P_BYTES;                          // mbarriers, 8 bytes each:
    const unsigned q_full = bar, q_empty = bar + 16, k_full = bar + 32, v_full = k_full + 8 * STAGES,
                   k_empty = v_full + 8 * STAGES, v_empty = k_empty + 8 * STAGES;   // q_*: one per Q buffer
    const unsigned item_slot = v_empty + 8 * STAGES;                // PERSIST: [2] ints, the item of Q buffer qb

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    const int nTr = (Nq + BR - 1) / BR, nTc = (Nk + BC - 1) / BC;
    // The work items: a Q tile of one (batch, head) each. Non-persistent, the block's own (grid (nTr, B*Hq));
    // PERSIST, of nTr * BH (grid: at most one block per SM): block c starts with item c, then takes the next
    // unclaimed one from the counter `sched` (the producer's atomicAdd, passed to the consumers through
    // item_slot beside the Q buffer it loads; -1: none left). A static round robin (c, c + gridDim.x, ...)
    // measured 30-40% slower causal at N = 2k-4k: with 11 Q tiles per head and 132 blocks, block c always drew
    // the same Q tile index, heavy or light. Items are numbered head by head, as the non-persistent grid's
    // blocks are, so that the blocks running at once share few heads' K / V in L2 (numbered tile-major, 132
    // blocks read 132 heads' K / V at once: d = 128, N = 2k ran 35% slower on the H100); a head's last Q tiles
    // (causal's long rows) first.
    const int n_items = PERSIST ? nTr * BH : 1;
    struct Item { int tr, bh, b, h, hk, row0; TileWalk walk; };
    auto item_of = [&](int w) {
        Item x;
        x.tr = PERSIST ? nTr - 1 - w % nTr : gridDim.x - 1 - blockIdx.x;
        x.bh = PERSIST ? w / nTr : blockIdx.y;
        x.b = x.bh / Hq, x.h = x.bh % Hq, x.hk = x.h / group, x.row0 = x.tr * BR - row_shift;
#ifdef FA_MODS
        x.walk.cls = tiles + (mod_tile_index(mod_tile_b, tile_heads, x.b, x.h) * nTr + x.tr) * nTc;
#else
        x.walk.cls = tiles + ((long long)(tile_heads == 1 ? 0 : x.h) * nTr + x.tr) * nTc;
#endif
        band_tiles(x.row0, min(x.row0 + BR, Nq) - 1, band_lo, band_hi, Nk, BC, x.walk.first, x.walk.last);
        x.walk.first = next_live_tile(x.walk.cls, x.walk.first, x.walk.last);
        return x;
    };
    // Every block whose first item exists makes exactly one failing claim, so a launch makes n_items claims
    // (n_items - grid successful ones and grid failing ones; where the grid outnumbers the items, n_items
    // failing ones). The claim that reads n_items - 1 is the last that touches the counter: it resets it, and
    // the next launch on the stream finds it at zero without a memset (sandbox/stream_counters.py).
    auto next_item = [&]() {
        const unsigned c = atomicAdd(sched, 1u);
        if (c == (unsigned)(n_items - 1)) atomicExch(sched, 0u);
        return (int)c + (int)gridDim.x;
    };

    if (threadIdx.x == 0) {
        for (int q = 0; q < 2; ++q) {
            mbar_init(q_full + 8 * q, 1);
            mbar_init(q_empty + 8 * q, NC * 4);         // one arrival per consumer warp
        }
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_full + 8 * s, 1);
            mbar_init(v_full + 8 * s, 1);
            mbar_init(k_empty + 8 * s, NC * 4);         // one arrival per consumer warp
            mbar_init(v_empty + 8 * s, NC * 4);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {
        // ---- producer: one thread issues every copy
        if constexpr (NC == 2) regs_release<24>();
        if constexpr (NC == 3) regs_release<32>();
        if (threadIdx.x == 0) {
            int it = 0;                               // ring position: counts K / V tiles across the items
            for (int w = PERSIST ? (int)blockIdx.x : 0, u = 0; ; w = next_item(), ++u) {
            // Q buffer qb, its (u / QBUFS)-th use: wait for the consumers' release of the use before
            const unsigned qb = u % QBUFS, q_use = u / QBUFS;
            if (PERSIST && q_use > 0) mbar_wait(q_empty + 8 * qb, (q_use - 1) & 1);
            if (PERSIST) {
                st_shared_s32(item_slot + 4 * qb, w < n_items ? w : -1);   // published by the arrival below
                if (w >= n_items) {
                    mbar_arrive(q_full + 8 * qb);     // no Q: the consumers read -1 and stop
                    break;
                }
            }
            const Item x = item_of(w);
            const int b = x.b, h = x.h, hk = x.hk;
            const TileWalk walk = x.walk;
            mbar_expect_tx(q_full + 8 * qb, Q_BYTES);
#pragma unroll
            for (int p = 0; p < D / 64; ++p)
#pragma unroll
                for (int c = 0; c < NC; ++c)
                    tma_load_4d(sQ + qb * Q_BYTES + p * PANEL_Q + c * 64 * 128, map_q, q_full + 8 * qb, p * 64,
                                x.row0 + c * 64, h, b);
            for (int t = walk.first; t <= walk.last; t = walk.next(t), ++it) {
                const int s = it % STAGES;
                const unsigned parity = (it / STAGES) & 1;
                if (it >= STAGES) mbar_wait(k_empty + 8 * s, parity ^ 1);   // the consumers released slot s
                mbar_expect_tx(k_full + 8 * s, KV_BYTES);
#pragma unroll
                for (int p = 0; p < D / 64; ++p)
                    tma_load_4d(sK + s * KV_BYTES + p * PANEL_KV, map_k, k_full + 8 * s, p * 64, t * BC, hk, b);
                if (it >= STAGES) mbar_wait(v_empty + 8 * s, parity ^ 1);
                mbar_expect_tx(v_full + 8 * s, KV_BYTES);
#pragma unroll
                for (int p = 0; p < D / 64; ++p)
                    tma_load_4d(sV + s * KV_BYTES + p * PANEL_KV, map_v, v_full + 8 * s, p * 64, t * BC, hk, b);
            }
            if (!PERSIST) break;
            }
        }
    } else {
        // ---- consumers: 64 rows per warpgroup
        if constexpr (NC == 2) regs_claim<240>();
        if constexpr (NC == 3) regs_claim<160>();
        const Mask mask = MASK_FROM_PARAMS;
        const Dropout drop = DROPOUT_FROM_PARAMS;
        const int g = lane / 4, tq = lane % 4, c = wg - 1;
        const int wrow = (warp - 4) * 16;             // the warp's first row in the tile
        int it = 0;                                   // ring position, as the producer's
        TRACE_DECL;
        // SM_TURNS: the two warpgroups take turns at the softmax (named barriers 1 + c, each turn ended by an arrival
        // on the other's), so that one's MUFU work runs beside the other's GEMMs. Both walk the same tiles of the
        // same items, so the turns alternate across items too: warpgroup 1 lets warpgroup 0 go first, and warpgroup
        // 0's sync after the last item takes warpgroup 1's last arrival.
        auto softmax_turn = [&] { if constexpr (SM_TURNS) named_sync(1 + c, 256); };
        auto softmax_done = [&] { if constexpr (SM_TURNS) named_arrive(2 - c, 256); };
        if (SM_TURNS && c == 1) named_arrive(1, 256);
        for (int u = 0; ; ++u) {
        const unsigned qb = u % QBUFS, q_use = u / QBUFS;
        mbar_wait(q_full + 8 * qb, q_use & 1);        // this item's Q landed (PERSIST: or the end was posted)
        const int w = PERSIST ? ld_shared_s32(item_slot + 4 * qb) : 0;
        if (w < 0) break;
        const Item x = item_of(w);
        const int bh = x.bh, b = x.b, h = x.h, row0 = x.row0;
        const TileWalk walk = x.walk;
        const unsigned q_rows = sQ + qb * Q_BYTES + c * 64 * 128;
#ifdef FA_Q_PRESCALE
        prescale_q<T, D, PANEL_Q>(q_rows, mod_scale, threadIdx.x % 128);
        fence_proxy_async();                          // the stores before this warpgroup's wgmma reads of them
        named_sync(3 + c, 128);                       // ids 1, 2: the turns; 3 + c: this warpgroup alone
#endif
        float o[1][ND][4], m[1][2], l[1][2];
        zero_state(o, m, l);
#ifdef FA_DIST_BIAS
        const float slope = dist_slope_raw(b, h, MOD_FN_ARGS);   // tc_mods.cuh: the bias seeds S
#endif
        // S's accumulator before its GEMM: the distance bias where there is one (tc_mods.cuh seed_scores)
        auto seed = [&](float (&s)[1][NT][4], int t) {
#ifdef FA_DIST_BIAS
            seed_scores(s, slope, row0 + wrow, t * BC, g, tq);
#endif
        };

#if defined(FA_MUFU_PIPE) && defined(FA_SCORE_MOD)
        // FA_MUFU_PIPE = PG (variants/fa3_ws.py mufu_pipe: PG = 2): a full tile's score modifier + row max, then its
        // exponentials + row sums, in groups of PG n8 blocks, the FMNMX (FADD) of group g - 1 after the MUFU ops of
        // group g, and each group's scale tied (OR with a runtime zero) to the running max (sums) through group
        // g - 2, so that ptxas cannot issue every MUFU op of the tile before the ALU work that could fill the issue
        // slots between them (the header: it did, for the soft-cap). The same operations in the same order per
        // element and per row: the result is bit for bit the unpipelined one.
        auto pipe_full = [&](float (&s)[1][NT][4], int col0, float (&corr)[1][2]) {
            constexpr int PG = FA_MUFU_PIPE, NG = NT / PG;
            static_assert(NT % PG == 0, "mufu_pipe: whole groups of n8 blocks");
            const unsigned zero = (unsigned)Nq >> 31;                     // 0, unknown to the compiler
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int gi = 0; gi <= NG; ++gi) {
                if (gi < NG) {
                    const float ms = __uint_as_float(__float_as_uint(MOD_SCORE_SCALE) |
                                                     ((__float_as_uint(mx[0]) | __float_as_uint(mx[1])) & zero));
#pragma unroll
                    for (int n = gi * PG; n < gi * PG + PG; ++n)
                        mod_full_block(s[0][n], 0, n, ms, b, h, row0 + wrow, col0, g, tq FA_SM_ARGS);
                }
                if (gi > 0) {
#pragma unroll
                    for (int n = (gi - 1) * PG; n < gi * PG; ++n)
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr)
                            mx[hr] = fmaxf(mx[hr], fmaxf(s[0][n][2 * hr], s[0][n][2 * hr + 1]));
                }
            }
            float m_use[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
                m_use[hr] = softmax_row_max<COND_RESCALE<ND, DROPOUT>>(m[0][hr], quad_max(mx[hr]), scale_log2,
                                                                        corr[0][hr]);
#pragma unroll
            for (int gi = 0; gi <= NG; ++gi) {
                if (gi < NG) {
                    const float sl = __uint_as_float(__float_as_uint(scale_log2) |
                                                     ((__float_as_uint(sum[0]) | __float_as_uint(sum[1])) & zero));
#pragma unroll
                    for (int n = gi * PG; n < gi * PG + PG; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[0][n][e] = softmax_exp2(fmaf(s[0][n][e], sl, -m_use[e / 2]), n);
                }
                if (gi > 0) {
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                        for (int n = (gi - 1) * PG; n < gi * PG; ++n) {
                            sum[hr] += s[0][n][2 * hr];
                            sum[hr] += s[0][n][2 * hr + 1];
                        }
                }
            }
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) l[0][hr] = l[0][hr] * corr[0][hr] + sum[hr];
        };
#endif

        // the scores of tile t, in registers: masked, softmaxed (O's rescale factor in corr), dropped out
        auto scores_to_p = [&](float (&s)[1][NT][4], int t, float (&corr)[1][2]) {
            const int col0 = t * BC;
#if defined(FA_MUFU_PIPE) && defined(FA_SCORE_MOD)
            if (!DROPOUT && walk.cls[t] == TILE_FULL && col0 + BC <= Nk && row0 >= 0 && row0 + BR <= Nq) {
                pipe_full(s, col0, corr);
                return;
            }
#endif
            float mx[1][2];
#ifdef FA_MODS
            // modifiers (tc_mods.cuh): the score modifier on every element, the mask's -inf after it; the
            // row range checked in every tile that crosses 0 (row_shift's first Q tile), Nq or Nk (buffers
            // indexed by i or j), so that a modifier never sees a row outside [0, Nq)
            const int cls = walk.cls[t];
            const bool full = cls == TILE_FULL && col0 + BC <= Nk && row0 >= 0 && row0 + BR <= Nq;
#ifdef FA_SCORE_MONOTONE
            // a monotone modifier (tc_mods.cuh mod_row_max): a full tile's row max on the raw scores, then the
            // modifier, so that no exponential waits for the last MUFU.TANH; the whole softmax in this branch, so
            // that ptxas may interleave the two (none crosses the branches' join)
            if (full) {
                row_max(s, mx);
                mod_row_max(mx, b, h, MOD_FN_ARGS);
                mod_scores<FA_SEED_S>(s, true, cls, mask, b, h, row0 + wrow, col0, Nq, Nk, g, tq, MOD_FN_ARGS);
                softmax_scores<COND_RESCALE<ND, DROPOUT>>(s, m, l, mx, scale_log2, corr);
                if (DROPOUT) apply_dropout<R>(s, drop, bh, row0 + wrow, col0, g, tq);
                return;
            }
#endif
            mod_scores<FA_SEED_S>(s, full, cls, mask, b, h, row0 + wrow, col0, Nq, Nk, g, tq, MOD_FN_ARGS);
#else
            if (walk.cls[t] != TILE_FULL || col0 + BC > Nk)
                mask_scores<1, NT, NC == 3>(s, walk.cls[t], mask, h, row0 + wrow, col0, Nq, Nk, g, tq);
#endif
            row_max(s, mx);
            softmax_scores<COND_RESCALE<ND, DROPOUT>>(s, m, l, mx, scale_log2, corr);
            if (DROPOUT) apply_dropout<R>(s, drop, bh, row0 + wrow, col0, g, tq);
        };

        if constexpr (!OVERLAP) {
            for (int t = walk.first; t <= walk.last; t = walk.next(t), ++it) {
                const int s = it % STAGES;
                const unsigned parity = (it / STAGES) & 1;
                float sc[1][NT][4], corr[1][2];
                unsigned pa[BC / 16][4];
                seed(sc, t);
                mbar_wait(k_full + 8 * s, parity);
                wgmma_fence();
                wg_gemm_qk<T, D, BC, BR, FA_SEED_S>(sc[0], q_rows, sK + s * KV_BYTES);
                wgmma_commit();
                wgmma_wait<0>();
                fence_accumulators(sc[0]);
                if (lane == 0) mbar_arrive(k_empty + 8 * s);
                scores_to_p(sc, t, corr);
                rescale_rows(o, corr);
                p_operands<T>(pa, sc);
                mbar_wait(v_full + 8 * s, parity);
                wgmma_fence();
                wg_gemm_pv<T, D, BC>(o[0], pa, sV + s * KV_BYTES);
                wgmma_commit();
                wgmma_wait<0>();
                fence_accumulators(o[0]);
                if (lane == 0) mbar_arrive(v_empty + 8 * s);
            }
        } else if (walk.first <= walk.last) {
            // PINGPONG: the two warpgroups take turns issuing their GEMMs (each turn waits on its own
            // named barrier, 1 + c, and ends with an arrival on the other's), so that one's softmax runs
            // under the other's GEMMs. Warpgroup 1 lets warpgroup 0 go first; every sync is matched
            // by one arrival of the other warpgroup, the last one by warpgroup 0's final sync below.
            auto my_turn = [&] { if constexpr (PINGPONG) named_sync(1 + c, 256); };
            auto your_turn = [&] { if constexpr (PINGPONG) named_arrive(2 - c, 256); };
            if (PINGPONG && c == 1) named_arrive(1, 256);
            // P_j, waiting for V_j: in registers (pa, the A operand of wg_gemm_pv), or (FA_P_SMEM) in this
            // warpgroup's P tile in shared memory, so that its 32 registers (Bc = 128) are free through the softmax
            // of S_{j+1}: the three-consumer soft-cap's build spilled 412-556 bytes at 160 registers a thread with
            // P in registers (S, O and P hold 128 of them there; SASS, session 23). The tile is rewritten after
            // the wait for the GEMM that read it (wgmma_wait<0>; a warp's rows of P feed only its own rows of O),
            // and published to the async proxy by each thread's fence and a warp barrier: the wgmma that reads the
            // tile is one operation of the four warps, which each issue it only after their own fence (as FA3's
            // P in shared memory; session 24 first ran a 128-thread named barrier here).
            unsigned pa[BC / 16][4];
            const unsigned p_rows = sP + c * P_BYTES;
            auto keep_p = [&](const float (&sc)[1][NT][4]) {
                if constexpr (P_SMEM) {
                    store_p<T, NT>(p_rows, sc, wrow % 64, lane);
                    fence_proxy_async();
                    __syncwarp();
                } else {
                    p_operands<T>(pa, sc);
                }
            };
            auto issue_pv = [&](int slot) {
                if constexpr (P_SMEM) wg_gemm_pv_ss<T, D, BC>(o[0], p_rows, sV + slot * KV_BYTES);
                else wg_gemm_pv<T, D, BC>(o[0], pa, sV + slot * KV_BYTES);
            };
            // prologue: S_0, its softmax; P_0 waits for V_0
            int t = walk.first, s = it % STAGES;
            unsigned parity = (it / STAGES) & 1;
            {
                float sc[1][NT][4], corr[1][2];
                seed(sc, t);
                mbar_wait(k_full + 8 * s, parity);
                my_turn();
                wgmma_fence();
                wg_gemm_qk<T, D, BC, BR, FA_SEED_S>(sc[0], q_rows, sK + s * KV_BYTES);
                wgmma_commit();
                your_turn();
                wgmma_wait<0>();
                fence_accumulators(sc[0]);
                if (lane == 0) mbar_arrive(k_empty + 8 * s);
                softmax_turn();
                scores_to_p(sc, t, corr);              // O is still zero: no rescale
                softmax_done();
                keep_p(sc);
            }
            for (int tn = walk.next(t); tn <= walk.last; tn = walk.next(tn)) {
                ++it;
                const int sn = it % STAGES;
                const unsigned pn = (it / STAGES) & 1;
                float sc[1][NT][4], corr[1][2];
                TRACE_EV(0);
                seed(sc, tn);
                mbar_wait(k_full + 8 * sn, pn);
                mbar_wait(v_full + 8 * s, parity);
                TRACE_EV(1);
                my_turn();
                TRACE_EV(2);
                wgmma_fence();
                wg_gemm_qk<T, D, BC, BR, FA_SEED_S>(sc[0], q_rows, sK + sn * KV_BYTES);       // S_{j+1} = Q K_{j+1}^T
                wgmma_commit();
                TRACE_EV(3);
                issue_pv(s);                                                        // O += P_j V_j
                wgmma_commit();
                your_turn();
                TRACE_EV(4);
                wgmma_wait<1>();                                                    // S_{j+1} done
                fence_accumulators(sc[0]);
                TRACE_EV(5);
                if (lane == 0) mbar_arrive(k_empty + 8 * sn);
                softmax_turn();
                scores_to_p(sc, tn, corr);             // under O += P_j V_j
                softmax_done();
                TRACE_EV(6);
                wgmma_wait<0>();
                fence_accumulators(o[0]);
                TRACE_EV(7);
                TRACE_NEXT();
                if (lane == 0) mbar_arrive(v_empty + 8 * s);
                rescale_rows(o, corr);
                keep_p(sc);
                t = tn, s = sn, parity = pn;
            }
            mbar_wait(v_full + 8 * s, parity);         // epilogue: the last O += P V
            my_turn();
            wgmma_fence();
            issue_pv(s);
            wgmma_commit();
            your_turn();
            if (PINGPONG && c == 0) named_sync(1, 256);   // warpgroup 1's last arrival
            wgmma_wait<0>();
            fence_accumulators(o[0]);
            if (lane == 0) mbar_arrive(v_empty + 8 * s);
            ++it;                                     // past the item's last tile
        }
        // every S GEMM of the item is done: its Q buffer goes back to the producer (PERSIST: the next item but
        // one loads there, while this epilogue and the next item run)
        if (PERSIST && lane == 0) mbar_arrive(q_empty + 8 * qb);
#ifdef FA_MODS
        fold_sinks(o, m, l, mod_sink, h, tq);        // attention sinks join the denominator (FA_SINKS only)
#endif
        write_output<T>(o, m, l, O, LSE, bh, row0 + wrow, Nq, d, g, tq);
        if (!PERSIST) break;
        }
        if (SM_TURNS && c == 0) named_sync(1, 256);   // warpgroup 1's last arrival
    }
}
