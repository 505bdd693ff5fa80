// tc_softmax.cuh: what every FA2 forward rung of the tensor-core tier does between and after its
// two GEMMs, on the registers of mma.m16n8k16 C fragments (see mma.cuh for the layout): scores into
// the mask applied (-inf scores), the online softmax update on raw scores with the scale folded into one FFMA (FA2 paper Algorithm 1, lines 9-10,
// rescaling of O deferred to the end, Sec. 3.1), dropout with the contract's Philox counters, and
// the epilogue that writes O / l and the logsumexp once.
//
// A warp holds rows [row_base, row_base + 16 MT) of the block: element e of n8 tile n of m16 slice
// mt is row row_base + 16 mt + g + 8 (e >= 2), column col0 + 8 n + 2 t + (e & 1) (g = lane / 4,
// t = lane % 4). A row lives in one quad of lanes.
#pragma once
#include "common.cuh"
#include "philox.cuh"
#include "tiles.cuh"
#include "mma.cuh"

#define LN2 0.6931471805599453f       // lse = (m2 + log2 l) * ln 2 (m2: the row max in log2 units)

// ---- device helpers

// 2^x for x <= 8 (the softmax's exponents: <= 0, or up to the conditional rescale's slack) on the FMA pipe (FA_EXP2_EMU, below): x = j + f with j = round(x) by the 1.5 * 2^23
// shifter (two FADDs, no F2I / FRND, which share the MUFU's quarter rate), 2^f on [-1/2, 1/2] by a
// degree-4 polynomial (a relative minimax fit with the constant held at exactly 1: 2.9e-6 relative error
// in float32 Horner form, against 2^-11 for the fp16 rounding of P that follows), times 2^j built in the
// exponent field from the shifter's low bits (one integer op) by one FMUL. x is first clamped to -127 by
// max.NaN (a NaN stays NaN, as ex2.approx gives NaN for NaN: a NaN score must reach its row's output,
// the NaN contract; fmaxf would turn it into -127): -inf (a masked score, a row that saw nothing) and
// anything below give j = -127, 2^j = +0 and so exactly 0, as ex2.approx.ftz's flush does (the epilogue's
// dead-row test needs l == 0); a NaN makes p NaN and the product NaN. Seed context: FlashAttention-4
// (Blackwell) splits the softmax's exponentials between MUFU.EX2 and such a polynomial; the FA3 paper's
// Sec. 3.2 names the EX2 throughput (3.9 TFLOP/s of MUFU against 989 of fp16 wgmma on the H100) as what
// its overlap hides.
__device__ __forceinline__ float exp2_fma(float x) {
    asm("max.NaN.f32 %0, %0, 0fC2FE0000;" : "+f"(x));   // max(x, -127), NaN if x is NaN (sm_80+)
    const float shifted = x + 12582912.0f;               // 1.5 * 2^23: round to nearest integer
    const float j = shifted - 12582912.0f;
    const float f = x - j;                                // [-1/2, 1/2]
    float p = fmaf(0.009582853f, f, 0.055906426f);
    p = fmaf(p, f, 0.24024099f);
    p = fmaf(p, f, 0.69312418f);
    p = fmaf(p, f, 1.0f);
    // the shifter's bits are 0x4B400000 + j: (j + 127) << 23 is 2^j's bit pattern (0 for j = -127)
    const unsigned e = (__float_as_uint(shifted) + (127u - 0x4B400000u)) << 23;
    return p * __uint_as_float(e);
}

// FA_EXP2_EMU = k > 0 (an NVRTC -D option, the fa3 variants' `exp2_fma` parameter): the softmax's exp2 of
// every k-th n8 column block runs exp2_fma on the FMA pipe, the rest MUFU.EX2. The idea: where the EX2s
// bound a tile (d = 64; a score modifier's MUFU.TANH beside them), move a fraction of them to the idle FMA
// pipe. Measured slower at every k on the H100: the softmax is bound by its instructions per warp, not by
// the MUFU pipe, and exp2_fma is about ten instructions for one (bench/results/h200/2026-11-26-session-6.md).
#ifndef FA_EXP2_EMU
#define FA_EXP2_EMU 0
#endif
__device__ __forceinline__ float softmax_exp2(float x, int n) {
    constexpr int K = FA_EXP2_EMU > 0 ? FA_EXP2_EMU : 1;
    if (FA_EXP2_EMU > 0 && n % K == K - 1) return exp2_fma(x);
    return exp2_ftz(x);
}

// The scores stay raw (Q K^T, unscaled) until the exponent: p = 2^(s * scale_log2 - m) is one FFMA
// and an EX2 per element, with m the row max already in log2 units (FA2 paper Sec. 3.1: fewer
// non-matmul FLOPs). The row max is taken on the raw scores, which needs scale_log2 > 0: the host
// passes |scale| and negates K for a negative scale (variants/fa2_tc.py). A sign switch in the
// kernel cost up to 400 bytes of spills (NVRTC 13, sm_90, D = 64, Br = Bc = 128, 4 warps).

// s <- -inf where the element is not visible; called only for partial tiles and the tile that
// crosses Nk (full tiles skip the element predicate). With three consumer warpgroups (160 registers a
// thread) fa3 spilled 64 bytes here: ptxas evaluated the 64 band predicates of a thread into registers before
// applying them (the SASS of session 8; session 7 had blamed the block-sparse lookups, but the spill stayed
// with them compiled out). BY_ROW (fa3_ws.cu at three consumers) takes a band without a block-sparse layout
// row by row: one interval of visible keys per row, two compares of a compile-time column offset per
// element; spill-free. A rolled loop gathering the layout's bits (session 7) made the default fa3's d = 64
// forward 10-13% slower on the H100, so two warpgroups keep this loop as it was.
template <int MT, int NT, bool BY_ROW = false>
__device__ __forceinline__ void mask_scores(float (&s)[MT][NT][4], int cls, const Mask& mask, int h,
                                            int row_base, int col0, int Nq, int Nk, int g, int tq) {
    if constexpr (BY_ROW) {
        if (mask.layout_heads == 0) {
            // BY_ROW, a band alone: a row's visible keys are one interval, [i + lo, i + hi] within [0, Nk), so each
            // element is two compares of its (compile-time) column offset against the row's bounds
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int i = row_base + mt * 16 + g + 8 * hr, c0 = col0 + 2 * tq;
                    // |lo|, |hi| <= 2^30 (sandbox/masks.py UNBOUNDED) and i, Nk < 2^30: no overflow
                    const int first = i + mask.lo - c0;
                    const int last = i < Nq ? min(i + mask.hi, Nk - 1) - c0 : -1 - c0 - NT * 8;
#pragma unroll
                    for (int n = 0; n < NT; ++n)
#pragma unroll
                        for (int u = 0; u < 2; ++u) {
                            const int c = n * 8 + u;
                            if (c < first || c > last) s[mt][n][2 * hr + u] = NEG_INF;
                        }
                }
            return;
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = row_base + mt * 16 + g + (e >= 2 ? 8 : 0);
                const int j = col0 + n * 8 + 2 * tq + (e & 1);
                if (!(i < Nq && j < Nk && (cls == TILE_FULL || mask.visible(h, i, j)))) s[mt][n][e] = NEG_INF;
            }
}

// Row reductions (here and softmax_scores' sum) run as one dependent chain over the n8 blocks. Four
// independent chains combined at the end (shorter dependencies: Nsight Compute puts most of fa3's stall
// cycles at d = 64 on "wait", fixed-latency dependencies, with issue slots ~44% busy) measured 11-13%
// SLOWER for fa3's forward at d = 64 (H200, same run, 2026-11-26; bench/results/h200/2026-11-26-session-6.md),
// so the single chain stays.

// The max over a row's quad of lanes (every lane gets it).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The raw row max of this warp's scores over its columns (quad-reduced: every lane of a row's quad
// holds it); -inf where nothing is visible.

template <int MT, int NT>
__device__ __forceinline__ void row_max(const float (&s)[MT][NT][4], float (&mx)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float x = NEG_INF;
#pragma unroll
            for (int n = 0; n < NT; ++n) x = fmaxf(x, fmaxf(s[mt][n][2 * hr], s[mt][n][2 * hr + 1]));
            mx[mt][hr] = quad_max(x);
        }
}

// Split-K (warps own column slices of a tile): the warps agree on each row's tile max through
// shared memory (`xm`: [WARPS][BR] floats), so that their partial O and l share one scale and add
// up at the end. One __syncthreads; the caller's next barrier separates it from the next tile's writes.
template <int WARPS, int BR, int MT>
__device__ __forceinline__ void agree_row_max(float (&mx)[MT][2], float* xm, int warp, int g, int tq) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
            if (tq == 0) xm[warp * BR + mt * 16 + g + 8 * hr] = mx[mt][hr];
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float x = NEG_INF;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) x = fmaxf(x, xm[w * BR + mt * 16 + g + 8 * hr]);
            mx[mt][hr] = x;
        }
}

// Conditional rescaling (FlashAttention-4's, Blackwell; any online softmax may use it): a row keeps its
// running max m while the tile's max exceeds it by at most RESCALE_SLACK (log2 units), so that its P is
// at most 2^RESCALE_SLACK = 256 (exact in fp16 and bf16 as a range; fp32 O and l hold it easily) and its
// rescale factor is exactly 1. O = sum P V / l and lse = m + log2 l hold for any m that is a common
// reference of P and l, so the result is the same up to rounding. A warp whose rows all keep theirs skips
// O's rescale (rescale_rows), which in fa3 sits between an O += P V completing and the next one issued.
// Used from D = 128 and without dropout (COND_RESCALE; with dropout P / (1 - p) up to 256 / (1 - p) would pass fp16's
// 65504 from p = 0.9961 on, where 1 / (1 - p) alone reaches it only past 0.99998). On the H100 (fa3, fp16, A/B in one run each;
// bench/results/h100/2026-11-26-session-7.md) it made D = 128's forward 2-3% faster; at D = 64, where O's
// rescale is only 32 FMULs per thread, it measured 1-6% slower with the skip and 1-4% without it. The
// mma.sync kernels (fa2-tc, fa1-tc, fa2-tc-naive) share it at D = 128 through softmax_update, checked against
// the oracle on the GPU but not timed with and without it.
#ifndef FA_RESCALE_SLACK
#define FA_RESCALE_SLACK 8.0f
#endif
template <int ND, bool DROPOUT>
constexpr bool COND_RESCALE = ND >= 16 && !DROPOUT;

// The online softmax update of the scores alone, for a tile whose raw row max is mx: new row max m
// (log2 units; kept within the slack above), P = 2^(s scale_log2 - m) in place, l rescaled and added to,
// and the factor corr = 2^(m_old - m) that O must be rescaled by (rescale_rows) before this tile's P V is
// added. Apart from softmax_update so that a kernel can rescale O later, once an O += P V in flight
// has completed (fa3_ws.cu's intra-warpgroup overlap). l holds this lane's partial row sums.
// One row's step of the update, for a tile whose raw row max is mx: the new running max m (log2 units; kept
// while mx exceeds it by at most the slack, with COND), O's and l's rescale factor corr = 2^(m_old - m), and the
// reference the tile's P is taken against, returned: m, or 0 while nothing is visible (m = -inf).
template <bool COND>
__device__ __forceinline__ float softmax_row_max(float& m, float mx, float scale_log2, float& corr) {
    float m_new = fmaxf(m, mx * scale_log2);
    // keep m within the slack; false for m = -inf (NaN or +inf difference): the first visible tile
    if (COND && m_new - m <= FA_RESCALE_SLACK) m_new = m;
    const float m_use = m_new == NEG_INF ? 0.0f : m_new;     // nothing visible yet
    corr = exp2_ftz(m - m_use);
    m = m_new;
    return m_use;
}

template <bool COND, int MT, int NT>
__device__ __forceinline__ void softmax_scores(float (&s)[MT][NT][4], float (&m)[MT][2], float (&l)[MT][2],
                                               const float (&mx)[MT][2], float scale_log2, float (&corr)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const float m_use = softmax_row_max<COND>(m[mt][hr], mx[mt][hr], scale_log2, corr[mt][hr]);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    const float p = softmax_exp2(fmaf(s[mt][n][e], scale_log2, -m_use), n);
                    s[mt][n][e] = p;
                    sum += p;
                }
            l[mt][hr] = l[mt][hr] * corr[mt][hr] + sum;
        }
}

// O's rows times their rescale factor; with conditional rescaling (from D = 128, above), nothing where every
// factor of the warp is 1 (the usual case once the rows' maxima settle). Called by whole warps.
template <int MT, int ND>
__device__ __forceinline__ void rescale_rows(float (&o)[MT][ND][4], const float (&corr)[MT][2]) {
    if constexpr (ND >= 16) {
        bool ones = true;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ones = ones && corr[mt][0] == 1.0f && corr[mt][1] == 1.0f;
        if (__all_sync(0xffffffffu, ones)) return;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[mt][n][0] *= corr[mt][0];
            o[mt][n][1] *= corr[mt][0];
            o[mt][n][2] *= corr[mt][1];
            o[mt][n][3] *= corr[mt][1];
        }
}

// The online softmax update for a tile whose raw row max is mx: the scores' update, then O rescaled.
// DROPOUT: whether the kernel drops P out after this (no conditional rescaling then, above).
template <bool DROPOUT, int MT, int NT, int ND>
__device__ __forceinline__ void softmax_update(float (&s)[MT][NT][4], float (&m)[MT][2], float (&l)[MT][2],
                                               float (&o)[MT][ND][4], const float (&mx)[MT][2], float scale_log2) {
    float corr[MT][2];
    softmax_scores<COND_RESCALE<ND, DROPOUT>>(s, m, l, mx, scale_log2, corr);
    rescale_rows(o, corr);
}

// Online softmax on raw scores (FA2 Algorithm 1, lines 9-10): the row max of this tile, then the update.
template <bool DROPOUT, int MT, int NT, int ND>
__device__ __forceinline__ void online_softmax(float (&s)[MT][NT][4], float (&m)[MT][2], float (&l)[MT][2],
                                               float (&o)[MT][ND][4], float scale_log2) {
    float mx[MT][2];
    row_max(s, mx);
    softmax_update<DROPOUT>(s, m, l, o, mx, scale_log2);
}

// P_drop = P Z / (1 - p) (l keeps the undropped sum): element (b, h, i, j) uses word j % 4 of
// philox(j / 4, i, b*Hq + h, offset); a lane's column pair shares one call.
template <int R, int MT, int NT>
__device__ __forceinline__ void apply_dropout(float (&s)[MT][NT][4], const Dropout& drop, int bh, int row_base,
                                              int col0, int g, int tq) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int i = row_base + mt * 16 + g + 8 * hr, j = col0 + n * 8 + 2 * tq;
                const uint4 w = dropout_words<R>(drop, bh, i, j >> 2);
                s[mt][n][2 * hr] *= dropout_factor(drop, word_of(w, j & 3));
                s[mt][n][2 * hr + 1] *= dropout_factor(drop, word_of(w, (j & 3) + 1));
            }
}

// O / l in the input dtype, lse = (m2 + log2 l) ln 2; rows that saw nothing: 0 and -inf.
template <typename T, int MT, int ND>
__device__ __forceinline__ void write_output(const float (&o)[MT][ND][4], const float (&m)[MT][2],
                                             const float (&l)[MT][2], T* __restrict__ O, float* __restrict__ LSE,
                                             int bh, int row_base, int Nq, int d, int g, int tq) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float sum = l[mt][hr];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int i = row_base + mt * 16 + g + 8 * hr;
            if (i < 0 || i >= Nq) continue;            // rows < 0: fa3_ws.cu's bottom-aligned first tile
            const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;   // NaN is not a dead row: only an exactly zero sum is
            T* orow = O + ((long long)bh * Nq + i) * d;
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                const int c = n * 8 + 2 * tq;
                if (c < d)
                    *reinterpret_cast<unsigned*>(orow + c) = Elem<T>::pack(o[mt][n][2 * hr] * inv, o[mt][n][2 * hr + 1] * inv);
            }
            if (tq == 0) LSE[(long long)bh * Nq + i] = sum == 0.0f ? NEG_INF : (m[mt][hr] + log2f(sum)) * LN2;
        }
}

// Split-K epilogue: warps 0 .. WARPS-2 add their partial O and l (the same rows under the same
// running max m) into `red` in warp order, one barrier each; the last warp adds the sum into its
// registers, so that write_output sees whole rows. A fixed order, so deterministic. `red`: [BR][D + 8]
// fp32 (the 8-float pad spreads a quad's rows over the banks), then [BR][4] lane partials of l.
template <int WARPS, int BR, int D, int MT, int ND>
__device__ __forceinline__ void add_split_k_partials(float (&o)[MT][ND][4], float (&l)[MT][2], float* red,
                                                     int warp, int g, int tq) {
    constexpr int LD = D + 8;
    float* rl = red + BR * LD;
    for (int w = 0; w < WARPS - 1; ++w) {
        if (warp == w) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int row = mt * 16 + g + 8 * hr;
#pragma unroll
                    for (int n = 0; n < ND; ++n) {
                        float2* x = reinterpret_cast<float2*>(red + row * LD + n * 8 + 2 * tq);
                        const float2 prev = w == 0 ? make_float2(0.0f, 0.0f) : *x;
                        *x = make_float2(prev.x + o[mt][n][2 * hr], prev.y + o[mt][n][2 * hr + 1]);
                    }
                    rl[row * 4 + tq] = (w == 0 ? 0.0f : rl[row * 4 + tq]) + l[mt][hr];
                }
        }
        __syncthreads();
    }
    if (warp == WARPS - 1) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int row = mt * 16 + g + 8 * hr;
#pragma unroll
                for (int n = 0; n < ND; ++n) {
                    const float2 x = *reinterpret_cast<const float2*>(red + row * LD + n * 8 + 2 * tq);
                    o[mt][n][2 * hr] += x.x;
                    o[mt][n][2 * hr + 1] += x.y;
                }
                l[mt][hr] += rl[row * 4 + tq];
            }
    }
}

// Two C fragments side by side (columns 16 kk .. 16 kk + 15 of P) packed into one A fragment.
template <typename T, int MT, int NT>
__device__ __forceinline__ void p_fragments(unsigned (&pa)[MT][4], const float (&s)[MT][NT][4], int kk) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = Elem<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = Elem<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = Elem<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = Elem<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
}

// ---- dQ accumulation of the column-parallel backwards (fa2_tc_bwd.cu, fa3_bwd.cu)

// row[0..3] += v atomically (16-byte aligned: d % 8 == 0 and c % 4 == 0); one vector atomic on sm_90.
__device__ __forceinline__ void add_quad(float* row, float4 v) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(row), v);
#else
    atomicAdd(row, v.x);
    atomicAdd(row + 1, v.y);
    atomicAdd(row + 2, v.z);
    atomicAdd(row + 3, v.w);
#endif
}

// scale * dq (C fragments of n8 column tiles tile0, tile0 + 1, ...) added to dQ: lanes tq and tq ^ 1 swap
// halves so each adds four consecutive columns of one row with one atomic, the even lane row g, the odd
// lane row g + 8. `row`: that row of dQ plus 4 (tq / 2) columns; `row_in`: the row is < Nq.
template <int NT>
__device__ __forceinline__ void add_dq_tiles(const float (&dq)[NT][4], float* row, int tile0, bool row_in, int d,
                                             int tq, float scale) {
    const bool odd = tq & 1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const float r0 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][0] : dq[n][2], 1);
        const float r1 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][1] : dq[n][3], 1);
        const float4 v = odd ? make_float4(r0 * scale, r1 * scale, dq[n][2] * scale, dq[n][3] * scale)
                             : make_float4(dq[n][0] * scale, dq[n][1] * scale, r0 * scale, r1 * scale);
        if (row_in && (tile0 + n) * 8 + 4 * (tq / 2) < d) add_quad(row + (tile0 + n) * 8, v);
    }
}
