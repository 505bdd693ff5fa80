// tc_mods.cuh: score and mask modifiers (issue 18) compiled into the tensor-core kernels (fa2_tc.cu,
// fa2_tc_bwd.cu), on the registers of mma.m16n8k16 C fragments (layout: tc_softmax.cuh).
//
// Everything here is behind preprocessor switches that sandbox/modifiers.py (`cuda_defines`) sets
// as NVRTC -D options; without them this header defines MOD_PARAMS as nothing and no function but
// bwd_ds_scale (the scale itself there), so a kernel without modifiers compiles to the same code as before it
// included this header.
//   FA_SCORE_MOD        a score modifier: float score_mod(float s, int b, int h, int i, int j, float fi,
//                       float fj, buffers...); fi, fj are i, j as floats (exact below 2^24, which the host
//                       checks), formed once per row and per column of a tile, so that a modifier of the
//                       distance (ALiBi) pays one FADD per element instead of an I2F (quarter rate, the
//                       MUFU pipe the softmax's EX2 needs). An identity modifier (sinks alone) sets no
//                       FA_SCORE_MOD: the kernel keeps its exp2 fast path (scale folded into one FFMA).
//   FA_SCORE_MOD_GRAD   its derivative score_mod_grad(...) (backward builds only)
//   FA_SCORE_FACTORED   (backward builds) score_mod / score_mod_grad are a factored modifier's core and the core's
//                       derivative (ScoreMod.cuda_factored_grad), their factors three kernel arguments
//                       (FACTORED_PARAMS, below); FA_TANH_CORE: that core is fa_tanh, its derivative fa_sech2
//   FA_DIST_BIAS        instead of FA_SCORE_MOD (every kernel; where the host allows it: |scale| above
//                       the kernels' floor, variants/fa2_tc.py seeds_bias): the modifier is s + slope (j - i) (ALiBi),
//                       with float dist_slope(int b, int h, buffers...); the scores stay raw (scale_log2 =
//                       |scale| log2 e) and the bias in raw units, slope (j - i) / |scale|, is where the S
//                       accumulator starts (seed_scores): one FFMA per element from an immediate instead of
//                       the scale's FMUL, the distance's FADD and the slope's FFMA after the GEMM. A kernel
//                       that seeds says so to mod_scores (SEEDED); one that does not fails to compile.
//                       The backward kernels (fa3_bwd2.cu, fa2_tc_bwd.cu) seed their S^T the same way
//                       (seed_scores_t; fa2_tc_bwd_dq its S, seed_scores) with slope / scale: the derivative
//                       is 1, so that is all a backward needs.
//   FA_SINKS            a per-head sink logit in the softmax denominator (kernel argument mod_sink[Hq])
//   FA_MASK_MOD         a mask modifier: bool mask_mod(int b, int h, int i, int j, buffers...)
//   FA_MOD_FUNCS        the device functions above (the modifier's CUDA C text, on one line)
//   FA_SM_PARAMS / FA_SM_ARGS   the score modifier's buffers as kernel parameters (", const float*
//                       __restrict__ sm_cap, int sm_cap_shape0") and as the call's arguments (", sm_cap,
//                       sm_cap_shape0"); FA_MM_PARAMS / FA_MM_ARGS the mask modifier's (prefix mm_).
// The forward kernels' scale_log2 argument is the factor from the scores their softmax sees to log2 units
// (mod_scores, below), so the softmax code is the same with and without modifiers.
// Semantics (sandbox/modifiers.py, docs/ARCHITECTURE.md "Score and mask modifiers"): the modifier sees
// the scaled score s = scale q.k in natural units and indices (b, h, i, j) with h the query head and
// i, j raw positions; the mask modifier is ANDed with causal, window and the block mask; a sink joins
// the denominator with no value row. The host folds the mask modifier's tile classes into the tile
// table ([mod_tile_b x tile_heads] tables, masks.classify_tiles_mod), so full tiles skip the
// predicate and empty ones are never loaded.
#pragma once

// A factored score modifier's factors, kernel arguments of the backward kernels (sandbox/modifiers.py
// ScoreMod.backward_factors): the core's argument is scale pre s, P = 2^(post log2 e core - lse), mod' = post pre
// core'. Defined with or without modifiers (nothing without FA_SCORE_FACTORED), so kernels can list them.
#ifdef FA_SCORE_FACTORED
#define FACTORED_PARAMS , float mod_pre, float mod_post_log2e, float mod_grad_factor
#define FACTORED_ARGS , mod_pre, mod_post_log2e, mod_grad_factor
#else
#define FACTORED_PARAMS
#define FACTORED_ARGS
#endif
#if defined(FA_TANH_CORE) && !defined(FA_SCORE_FACTORED)
#error "FA_TANH_CORE names a factored core (fa_tanh, fa_sech2): define FA_SCORE_FACTORED too"
#endif

// dS's factor in a backward kernel's epilogues: the scale, times a factored modifier's post pre (mod' = post pre
// core': the kernels' dS holds core' alone, so that no FMUL per score applies a constant).
__device__ __forceinline__ float bwd_ds_scale(float scale FACTORED_PARAMS) {
#ifdef FA_SCORE_FACTORED
    return scale * mod_grad_factor;
#else
    return scale;
#endif
}

#if defined(FA_SCORE_MOD) && defined(FA_DIST_BIAS)
#error "FA_DIST_BIAS replaces FA_SCORE_MOD: define one of them"
#endif
#if defined(FA_SCORE_MONOTONE) && !defined(FA_SCORE_MOD)
#error "FA_SCORE_MONOTONE says FA_SCORE_MOD's modifier is monotone: define both"
#endif
#if defined(FA_SCORE_MOD) || defined(FA_DIST_BIAS) || defined(FA_MASK_MOD) || defined(FA_SINKS)
#define FA_MODS 1
#ifndef FA_SM_PARAMS
#define FA_SM_PARAMS
#define FA_SM_ARGS
#endif
#ifndef FA_MM_PARAMS
#define FA_MM_PARAMS
#define FA_MM_ARGS
#endif

// Helpers a modifier's CUDA text may call (the built-ins' do: sandbox/modifiers.py).
// tanh by the hardware's MUFU.TANH (sm_75+): one quarter-rate op instead of libdevice's tanhf (a branchy
// sequence of an exp, a division and a polynomial). Max relative error about 2^-11 (PTX ISA), the
// unit roundoff of fp16; the tolerance rule compares with a naive reference that rounds the modified
// scores to the dtype (sandbox/oracle.py), which errs as much. Not volatile: score_mod and
// score_mod_grad of one element share it (CSE).
__device__ __forceinline__ float fa_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// sech^2 x = 1 - tanh^2 x (the soft-cap's derivative) with a small relative error across the whole range:
// 1 - t t from fa_tanh's t (relative error 2^-11) errs by about 2^-10 in absolute terms, which is all of
// the derivative where tanh saturates (sech^2 4 = 1.3e-3), so gradients through saturated scores came out
// wrong in their leading digits (the GPU feature fuzz found it: dq / dk of softcap cases with large
// logits). 4 e / (1 + e)^2 with e = exp(-2 |x|): one EX2 (MUFU, which the backward's tanh and exp2
// already load) and 1 / (1 + e) on the FMA pipe instead of a second MUFU op: 1 + e lies in (1, 2], where
// 24/17 - 8/17 d is within 1/17 of 1 / d and two Newton steps r (2 - d r) bring it to 1.2e-5 (sech^2:
// 2.6e-5 relative at most, checked in float32 over |x| <= 60).
// e = exp(-2 |x|) and r = 1 / (1 + e), shared by fa_sech2 and fa_tanh_e (the compiler merges the two where a
// score modifier and its derivative evaluate both at one x: the asm is not volatile).
__device__ __forceinline__ float fa_exp_m2abs(float x) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-2.8853900817779268f * fabsf(x)));   // exp(-2 |x|)
    return e;
}
__device__ __forceinline__ float fa_recip_1p(float e) {     // 1 / (1 + e) for e in [0, 1]
    const float d = 1.0f + e;
    float r = fmaf(-0.47058824f, d, 1.4117647f);
    r = r * fmaf(-d, r, 2.0f);
    return r * fmaf(-d, r, 2.0f);
}
__device__ __forceinline__ float fa_sech2(float x) {
    const float e = fa_exp_m2abs(x), r = fa_recip_1p(e);
    return 4.0f * e * (r * r);
}

// tanh x = sign(x) (1 - e) / (1 + e) from the same e and r, for a modifier's text: beside fa_sech2 of the same x
// (a backward) one MUFU op for both instead of MUFU.TANH and fa_sech2's EX2, but no faster in fa3_bwd2 on the
// H100, and a forward that uses fa_tanh would not match it (the built-in soft-cap keeps fa_tanh in both). Its
// absolute error is at most 1.2e-5 (the reciprocal's two Newton steps; tests/test_modifiers.py models it),
// below MUFU.TANH's (2^-11 relative: up to 4.9e-4), and absolute error is what the softmax's exponent sees
// (cap tanh); near 0 its relative error grows (1 - e cancels), its absolute error does not. NaN for NaN.
__device__ __forceinline__ float fa_tanh_e(float x) {
    const float e = fa_exp_m2abs(x);
    return copysignf((1.0f - e) * fa_recip_1p(e), x);
}

FA_MOD_FUNCS

// Kernel arguments after DROPOUT_PARAMS: the tile table's batch extent (1 or B; tile_heads is its head
// extent), |scale| for the forward's modifier (the host passes K negated for a negative scale, so
// mod_scale * (q . -k) = scale q.k), the sink logits [Hq] (read only with FA_SINKS), the buffers.
#define MOD_PARAMS , int mod_tile_b, float mod_scale, const float* __restrict__ mod_sink FA_SM_PARAMS FA_MM_PARAMS
#define MOD_FN_PARAMS float mod_scale FA_SM_PARAMS FA_MM_PARAMS
#define MOD_FN_ARGS mod_scale FA_SM_ARGS FA_MM_ARGS
// The factor from the kernel's raw scores to the s a score modifier sees: mod_scale, or 1 where the kernel has
// multiplied Q by mod_scale before its S GEMM (FA_Q_PRESCALE, fa3_ws.cu prescale_q), so that no FMUL per element is
// left (a literal 1.0f: the compiler drops s * 1.0f, exact for every s).
#ifdef FA_Q_PRESCALE
#define MOD_SCORE_SCALE 1.0f
#else
#define MOD_SCORE_SCALE mod_scale
#endif

// ---- device helpers

// The tile table's row for batch entry b, query head h: [mod_tile_b][tile_heads][...] tables.
__device__ __forceinline__ long long mod_tile_index(int mod_tile_b, int tile_heads, int b, int h) {
    return (long long)(mod_tile_b == 1 ? 0 : b) * tile_heads + (tile_heads == 1 ? 0 : h);
}

// Element (b, h, i, j) visible under the band / block mask and the mask modifier (in range: the caller checks).
__device__ __forceinline__ bool mod_visible(const Mask& mask, int b, int h, int i, int j, MOD_FN_PARAMS) {
#ifdef FA_MASK_MOD
    return mask.visible(h, i, j) && mask_mod(b, h, i, j FA_MM_ARGS);
#else
    return mask.visible(h, i, j);
#endif
}

#ifdef FA_DIST_BIAS
// The distance bias's slope in raw-score units, slope / |scale| (mod_scale = |scale|: a distance-bias module
// has no factored scales), for this thread's (b, h).
__device__ __forceinline__ float dist_slope_raw(int b, int h, MOD_FN_PARAMS) {
    return dist_slope(b, h FA_SM_ARGS) / mod_scale;
}

// s = slope (j - i) on the C layout (rows row_base + g + 16 mt (+ 8), columns col0 + 2 tq + 8 n (+ 1)): one
// FFMA per element, the per-element distance an immediate, its per-thread base formed once per tile. Exact
// distances (|j - i| < 2^24, which the host checks for fi, fj); the bias is rounded twice, as the 1-ulp
// relative error of float32 arithmetic allows.
template <int MT, int NT>
__device__ __forceinline__ void seed_scores(float (&s)[MT][NT][4], float slope, int row_base, int col0, int g, int tq) {
    const float base = slope * (float)(col0 + 2 * tq - row_base - g);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[mt][n][e] = fmaf(slope, (float)(8 * n + (e & 1) - 16 * mt - (e >= 2 ? 8 : 0)), base);
}

// The same bias on a transposed tile S^T (the backward's: rows are keys key_base + g + 16 mt (+ 8), columns
// queries q0 + 2 tq + 8 n (+ 1)), slope (key - query). Equal in value to seed_scores with the slope negated,
// but a copy: that call made fa3_bwd2's D = 128 dropout build spill 4 bytes (NVRTC 13).
template <int MT, int NT>
__device__ __forceinline__ void seed_scores_t(float (&s)[MT][NT][4], float slope, int key_base, int q0, int g, int tq) {
    const float base = slope * (float)(key_base + g - q0 - 2 * tq);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[mt][n][e] = fmaf(slope, (float)(16 * mt + (e >= 2 ? 8 : 0) - 8 * n - (e & 1)), base);
}
#define FA_SEED_S true
#else
#define FA_SEED_S false
#endif

// The forward's scores after the modifiers, in place: with a score modifier, mod(mod_scale s) in natural
// units, and the kernel's scale_log2 argument is the host's log2 e (variants/fa2_tc.py forward_scale_log2);
// without one the raw scores, scale_log2 = |scale| log2 e. A factored modifier (post core(pre s),
// sandbox/modifiers.py cuda_factored) compiles core as score_mod; the host passes mod_scale = |scale| pre
// and scale_log2 = post log2 e, so that the softmax's one FFMA applies post. -inf where invisible: out of
// range, the band / block mask or the mask modifier (in tiles that are not `full`: a full tile has every
// element in range and visible). A full tile
// runs a separate loop with no predicate at all (the branch on `full` is warp-uniform), as the kernel
// without modifiers skips mask_scores; a partial tile evaluates the score modifier only where visible
// (a buffer indexed by i or j must not be read past its end). `cls` is the tile's class: TILE_BAND (the mask
// modifier sees every element of it, the band or block mask not) tests the band alone: the causal diagonal tiles
// of a document mask skip the predicate's two id loads per score; TILE_CAUSAL (the modifier shows exactly
// j - i <= Nk - Nq of what the band shows) tests the band and that compare: a causal mask given as a dense mask
// skips its byte load per score. The partial loops are separate instantiations (mod_partial<MODE>), one per
// warp-uniform branch: a select per element between the two predicates measured 16% slower at d = 64 with a
// predicate that is always true (H100, session 12).
// A partial tile: -inf where invisible, the score modifier where visible. MODE: PART_PRED the band / block mask
// and the predicate, PART_BAND the band / block mask alone, PART_CAUSAL the band / block mask and j - i <= Nk - Nq.
#define PART_PRED 0
#define PART_BAND 1
#define PART_CAUSAL 2
template <int MODE, int MT, int NT>
__device__ __forceinline__ void mod_partial(float (&s)[MT][NT][4], const Mask& mask, int b, int h, int row_base,
                                            int col0, int Nq, int Nk, int g, int tq, MOD_FN_PARAMS) {
    const float fi0 = (float)(row_base + g), fj0 = (float)(col0 + 2 * tq);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int di = mt * 16 + (e >= 2 ? 8 : 0), dj = n * 8 + (e & 1);
                const int i = row_base + g + di, j = col0 + 2 * tq + dj;
                const bool vis = (unsigned)i < (unsigned)Nq && j < Nk &&     // i < 0: fa3_ws.cu's row_shift
                                 (MODE == PART_BAND ? mask.visible(h, i, j)
                                  : MODE == PART_CAUSAL ? mask.visible(h, i, j) && j - i <= Nk - Nq
                                                        : mod_visible(mask, b, h, i, j, MOD_FN_ARGS));
#ifdef FA_SCORE_MOD
                if (vis) s[mt][n][e] = score_mod(s[mt][n][e] * MOD_SCORE_SCALE, b, h, i, j, fi0 + (float)di, fj0 + (float)dj
                                                 FA_SM_ARGS);
#endif
                if (!vis) s[mt][n][e] = NEG_INF;
            }
}

#ifdef FA_SCORE_MOD
// The score modifier on n8 block n of m16 slice mt of a full tile (every element in range and visible), the scores
// times `scale` first (the forward's mod_scale; fa3_ws.cu's pipelined softmax passes it tied to a dependency). fi,
// fj: the row's and column's index as floats, the per-thread base + a small constant (exact).
__device__ __forceinline__ void mod_full_block(float (&s)[4], int mt, int n, float scale, int b, int h, int row_base,
                                               int col0, int g, int tq FA_SM_PARAMS) {
    const float fi0 = (float)(row_base + g), fj0 = (float)(col0 + 2 * tq);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int di = mt * 16 + (e >= 2 ? 8 : 0), dj = n * 8 + (e & 1);
        s[e] = score_mod(s[e] * scale, b, h, row_base + g + di, col0 + 2 * tq + dj, fi0 + (float)di, fj0 + (float)dj
                         FA_SM_ARGS);
    }
}
#endif

#ifdef FA_SCORE_MONOTONE
// FA_SCORE_MONOTONE (with FA_SCORE_MOD, forward builds; sandbox/modifiers.py ScoreMod.monotone): the compiled
// modifier is a non-decreasing function of the score for each (b, h), independent of i and j (the soft-cap's
// core, tanh), so a row's max over a full tile commutes with it: max_j mod(c s_j) = mod(c max_j s_j) for
// c = mod_scale > 0. mx: the raw row maxima (row_max), made the modified ones (i = j = 0: unread). Any common
// reference of P and l gives the same result (tc_softmax.cuh), so a core that is not monotone to the last bit
// changes the rounding only (MUFU.TANH steps down by up to 114 ulps between neighbouring inputs on the H100:
// tests/test_modifiers_hopper.py).
template <int MT>
__device__ __forceinline__ void mod_row_max(float (&mx)[MT][2], int b, int h, MOD_FN_PARAMS) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
            mx[mt][hr] = score_mod(mx[mt][hr] * MOD_SCORE_SCALE, b, h, 0, 0, 0.0f, 0.0f FA_SM_ARGS);
}
#endif

template <bool SEEDED = false, int MT, int NT>
__device__ __forceinline__ void mod_scores(float (&s)[MT][NT][4], bool full, int cls, const Mask& mask, int b,
                                           int h, int row_base, int col0, int Nq, int Nk, int g, int tq, MOD_FN_PARAMS) {
#if defined(FA_DIST_BIAS)
    static_assert(SEEDED, "FA_DIST_BIAS: the kernel seeds its S accumulator (seed_scores) and says so (SEEDED)");
    if (full) return;
#elif defined(FA_SCORE_MOD)
    if (full) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n)
                mod_full_block(s[mt][n], mt, n, MOD_SCORE_SCALE, b, h, row_base, col0, g, tq FA_SM_ARGS);
        return;
    }
#else
    if (full) return;
#endif
#ifdef FA_MASK_MOD
    if (cls == TILE_BAND) {
        mod_partial<PART_BAND>(s, mask, b, h, row_base, col0, Nq, Nk, g, tq, MOD_FN_ARGS);
        return;
    }
    if (cls == TILE_CAUSAL) {
        mod_partial<PART_CAUSAL>(s, mask, b, h, row_base, col0, Nq, Nk, g, tq, MOD_FN_ARGS);
        return;
    }
#endif
    mod_partial<PART_PRED>(s, mask, b, h, row_base, col0, Nq, Nk, g, tq, MOD_FN_ARGS);
}


// Sinks: the running max m (log2 units) and the lane partial sums l take the sink logit sink_h in, with O
// rescaled to the new max, so that write_output divides by sum_j 2^(s_j - m) + 2^(sink - m) and writes
// lse = log(sum_j e^s_j + e^sink). A row that saw no key: O = 0, lse = sink. The sink enters l once per
// row (the quad's lane tq = 0).
template <int MT, int ND>
__device__ __forceinline__ void fold_sinks(float (&o)[MT][ND][4], float (&m)[MT][2], float (&l)[MT][2],
                                           const float* __restrict__ mod_sink, int h, int tq) {
#ifdef FA_SINKS
    const float sk = mod_sink[h] * LOG2E;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const float m_new = fmaxf(m[mt][hr], sk);
            const float c = exp2_ftz(m[mt][hr] - m_new);          // 0 for a row that saw nothing (m = -inf)
            l[mt][hr] = l[mt][hr] * c + (tq == 0 ? exp2_ftz(sk - m_new) : 0.0f);
            m[mt][hr] = m_new;
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                o[mt][n][2 * hr] *= c;
                o[mt][n][2 * hr + 1] *= c;
            }
        }
#endif
}

#ifdef FA_SCORE_MOD_GRAD
// ---- the backward's score modifier, per visible element (fa2_tc_bwd.cu; fa3_bwd2.cu keeps its own loop)

// The factors around score_mod in a backward: its argument is arg s for a raw score s, and the logit in log2 units
// is log2_factor score_mod(arg s). The whole text: arg = scale, log2_factor = log2 e; a factored core
// (FA_SCORE_FACTORED): arg = scale pre, log2_factor = post log2 e, and core' leaves post pre to bwd_ds_scale.
struct BwdModScales {
    float arg, log2_factor;
};
__device__ __forceinline__ BwdModScales bwd_mod_scales(float scale FACTORED_PARAMS) {
#ifdef FA_SCORE_FACTORED
    return {scale * mod_pre, mod_post_log2e};
#else
    return {scale, LOG2E};
#endif
}

// The logit of raw score s in log2 units; gr = the derivative's factor (mod', or core' without post pre).
// core_grad (FA_TANH_CORE, a tile that bwd_core_small passed): sech^2 x = 1 - tanh^2 x from the core's own value,
// one FFMA instead of fa_sech2's EX2 and eight FMA-pipe instructions. Callers pass a constant (a lambda called
// under a warp-uniform branch, once with each value), so each loop is compiled with one form.
__device__ __forceinline__ float bwd_mod_logit(float s, float& gr, bool core_grad, const BwdModScales& sc, int b,
                                               int h, int i, int j, float fi, float fj FA_SM_PARAMS) {
    const float xs = s * sc.arg;
    const float core = score_mod(xs, b, h, i, j, fi, fj FA_SM_ARGS);
#ifdef FA_TANH_CORE
    if (core_grad) gr = fmaf(-core, core, 1.0f);
    else
#endif
        gr = score_mod_grad(xs, b, h, i, j, fi, fj FA_SM_ARGS);
    return core * sc.log2_factor;
}
#endif

#ifdef FA_TANH_CORE
// Whether every core argument x = arg s of the warp's scores has |x| <= FA_TANH_GRAD_X, where 1 - t^2 from
// MUFU.TANH's t (relative error 2^-11) errs by at most 2 t^2 2^-11 / (1 - t^2) <= 2.7e-4 (2^-11.9) relative
// (|x| = 0.5); past that the cancellation grows (sech^2 4 = 1.3e-3 is MUFU.TANH's absolute error), so a tile
// holding a larger one (or an inf: the comparison fails) keeps fa_sech2. fmaxf drops a NaN score, which then
// gives a NaN either way (1 - NaN^2). Every lane of the warp calls it (a block-uniform branch: unmasked tiles).
#define FA_TANH_GRAD_X 0.5f
template <int A, int N>
__device__ __forceinline__ bool bwd_core_small(const float (&s)[A][N][4], float arg) {
    float amax = 0.0f;
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 4; e += 2) amax = fmaxf(amax, fmaxf(fabsf(s[a][n][e]), fabsf(s[a][n][e + 1])));
    return __all_sync(0xffffffffu, amax * fabsf(arg) <= FA_TANH_GRAD_X);
}
template <int N>
__device__ __forceinline__ bool bwd_core_small(const float (&s)[N][4], float arg) {     // one m16 slice (fa2_tc_bwd_wide)
    return bwd_core_small(reinterpret_cast<const float (&)[1][N][4]>(s), arg);
}
#endif

#else
#define MOD_PARAMS
#define FA_SEED_S false
#endif
