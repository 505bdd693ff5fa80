// fa2_tc.cu: FlashAttention-2 forward on tensor cores, fp16 / bf16 inputs, fp32 accumulation.
//
// Seed: FA2 paper (002) Algorithm 1 (Q-outer loop, online softmax with the rescaling of O deferred
// to the end, logsumexp saved), Sec. 3.1 (fewer non-matmul FLOPs: exp2 with the scale folded in,
// one division per row at the end) and Sec. 3.3 (warp partitioning: split-Q, each warp owns 16-row
// slices of Q and sees every key of a tile, so no inter-warp reduction; or split-K, FA1's scheme).
//
// Kernels (rungs of the tensor-core ladder; bench/results/ holds their measured speed)
//   fa2_tc_forward<T, D, BR, BC, WARPS, SPLIT_Q, MINB, R, DROPOUT>   grid (ceil(Nq/BR), B*Hq), WARPS*32
//       threads. SPLIT_Q: each warp owns BR/WARPS query rows and every key of a tile. !SPLIT_Q (split-K):
//       each warp owns all BR rows and BC/WARPS keys of every tile; the warps agree on each row's tile
//       max through shared memory (one more barrier per tile) and add their partial O and l at the
//       end in warp order (tc_softmax.cuh), so every warp holds BR x D accumulators.
//       MINB: blocks per SM the register allocation must allow (__launch_bounds__), the occupancy axis.
//       mma.sync.m16n8k16 (fp32 accumulate); Q, K, V tiles through cp.async into XOR-swizzled
//       shared memory (no padding, no bank conflicts) and into registers by ldmatrix (.trans for
//       V); P stays in registers between the two GEMMs (a C fragment pair is an A fragment).
//       DROPOUT is a template switch: the unrolled Philox calls cost registers even when unused.
//       STAGES = 2, the pipeline (the flash-attn 2 order): V_j's copy flies while S = Q K_j^T is
//       computed, K_{j+1}'s while softmax and O += P V_j run; one K and one V buffer. STAGES = 1, the
//       rung below: each tile's copies are waited for before its GEMMs (what the overlap buys).
// Status (H100, bench/results/h100/): 0 failures over more than 5,000 oracle-checked Hypothesis
// examples per dtype (fp16, bf16), every feature, at 1cd78c6; compute-sanitizer clean (split-K too).
// N = 2k-16k, causal and not: the default (split-Q, Br = 128, 4 warps x 32 rows, Bc = 64 at d = 64 and
// 32 at d = 128) runs 240-311 TFLOP/s at d = 64 (0.92-1.00x PyTorch SDPA flash) and 256-333 at
// d = 128 (0.90-0.94x); Bc = 128 at d = 64 0.99-1.10x, Bc = 64 at d = 128 0.94-1.00x (both spill on
// sm_80, so not the default). Split-K runs 0.51-0.61x: split-Q over split-K 1.6-1.8x (FA2 Sec. 3.3),
// since every split-K warp reads the whole Q tile, waits at one more barrier per tile and keeps
// Br x D accumulators. STAGES = 1 runs 0.74-0.88x SDPA flash at d = 64 and 0.72-0.77x at d = 128
// (96be664): the overlap buys 12-26% (predicted 10-20%, less at d = 128; but Bc halves at d = 128, so a
// tile's bytes per FLOP do not fall). Rung 1 (fa2_tc_naive.cu) runs 45-51.
// Masks: the host's tile table (EMPTY / FULL / PARTIAL) and the band bound the tile loop (tiles
// above the causal diagonal are never loaded); the element predicate runs only in partial tiles
// and the tile that crosses Nk. Dropout: the contract's Philox counters, one call per pair of
// columns a lane holds (element (b, h, i, j) uses word j % 4 of philox(j / 4, i, b*Hq + h, offset)).
// Envelope (static_asserts below, ValueError in variants/fa2_tc.py): D in {64, 128} (d <= D and a
// multiple of 8, zero-filled to D); a warp's rows and keys per tile multiples of 16.
// Packed sequences (-DFA_VARLEN, sandbox/varlen.py; a module of its own, so that the kernels above are
// compiled from the same text as without the switch): one launch for every sequence of a packed batch
// in flash-attn's varlen layout. Grid (blocks, Hq): block x reads its (sequence, Q tile) from the
// host's table (variants/fa2_tc.py varlen_tables, longest band first), the sequence's offsets, lengths
// and band (bottom-right aligned per sequence) from the sequence table; no tile table (the band alone
// classifies a tile), no dropout, no modifiers; out packed (total_q, Hq, d), lse (Hq, total_q).
#include "tc_softmax.cuh"
#include "tc_gemm.cuh"
#include "tc_mods.cuh"

#ifdef FA_VARLEN
#ifdef FA_MODS
#error "FA_VARLEN: packed sequences take no modifiers"
#endif
// Kernel arguments after DROPOUT_PARAMS: the sequence table [S][VL_SEQ_INTS] (q offset, Nq, k offset,
// Nk, band lo, band hi) and the block table [blocks][2] (sequence, Q tile), int32 each.
#define VL_SEQ_INTS 6
#define VARLEN_PARAMS , const int* __restrict__ vl_seqs, const int* __restrict__ vl_blocks

// ---- device helpers (packed sequences)

// The class of column tile t for rows [r0, r1] of one sequence, from its band: every tile of the band's
// range [t0, t1] holds a visible element (the band is one interval of j - i), so none is EMPTY.
struct VarlenTiles {
    int r0, r1, bc, nk, lo, hi;
    __device__ __forceinline__ int operator[](int t) const {
        const long long c0 = (long long)t * bc, c1 = min(c0 + bc, (long long)nk) - 1;
        return c0 - r1 >= lo && c1 - r0 <= hi ? TILE_FULL : TILE_PARTIAL;
    }
};
__device__ __forceinline__ int next_live_tile(const VarlenTiles&, int t, int) { return t; }

// write_output for packed rows: O [rows, Hq, d] from this sequence's first row and head (row stride
// o_sm elements), LSE [Hq, total_q] from this sequence's first entry of the head.
template <typename T, int MT, int ND>
__device__ __forceinline__ void write_output_packed(const float (&o)[MT][ND][4], const float (&m)[MT][2],
                                                    const float (&l)[MT][2], T* __restrict__ O, long long o_sm,
                                                    float* __restrict__ LSE, int row_base, int Nq, int d, int g,
                                                    int tq) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float sum = l[mt][hr];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int i = row_base + mt * 16 + g + 8 * hr;
            if (i >= Nq) continue;
            const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
            T* orow = O + i * o_sm;
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                const int c = n * 8 + 2 * tq;
                if (c < d)
                    *reinterpret_cast<unsigned*>(orow + c) = Elem<T>::pack(o[mt][n][2 * hr] * inv, o[mt][n][2 * hr + 1] * inv);
            }
            if (tq == 0) LSE[i] = sum == 0.0f ? NEG_INF : (m[mt][hr] + log2f(sum)) * LN2;
        }
}
#else
#define VARLEN_PARAMS
#endif

// ---- kernels

template <typename T, int D, int BR, int BC, int WARPS, bool SPLIT_Q, int STAGES, int MINB, int R, bool DROPOUT>
__global__ void __launch_bounds__(WARPS * 32, MINB)
fa2_tc_forward(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,  // [B, Hq, Nq, d]
               const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,  // [B, Hkv, Nk, d]
               const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,  // [B, Hkv, Nk, d]
               T* __restrict__ O,                        // [B, Hq, Nq, d] contiguous
               float* __restrict__ LSE,                  // [B, Hq, Nq]
               const signed char* __restrict__ tiles,    // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
               int tile_heads, int Hq, int group, int Nq, int Nk, int d,
               float scale_log2,                         // to log2 units, > 0: |scale| log2 e (tc_mods.cuh: modifiers)
               MASK_PARAMS, DROPOUT_PARAMS MOD_PARAMS      // MOD_PARAMS: modifiers only (tc_mods.cuh)
               VARLEN_PARAMS) {                          // packed sequences only (FA_VARLEN, above)
    constexpr int THREADS = WARPS * 32;
    constexpr int RW = SPLIT_Q ? BR / WARPS : BR;   // query rows per warp
    constexpr int CW = SPLIT_Q ? BC : BC / WARPS;   // keys per warp per tile
    constexpr int MT = RW / 16;         // m16 slices per warp
    constexpr int NT = CW / 8;          // n8 tiles of S
    constexpr int ND = D / 8;           // n8 tiles of O
    static_assert(D == 64 || D == 128, "head dim padded to 64 or 128");
    static_assert(RW % 16 == 0 && CW % 16 == 0, "each warp needs 16k query rows and 16k keys per tile");
    static_assert(STAGES == 1 || STAGES == 2, "copies waited for at once (1) or one tile ahead (2)");
    // shared memory: the Q, K, V tiles; split-K reuses them for the partial sums (add_split_k_partials)
    // and keeps the warps' row maxima after them
    constexpr int TILE_BYTES = 2 * D * (BR + 2 * BC), RED_BYTES = SPLIT_Q ? 0 : 4 * BR * (D + 8 + 4);
    extern __shared__ __align__(1024) uint4 smem_u4[];
    T* sQ = reinterpret_cast<T*>(smem_u4);   // [BR][D] swizzled
    T* sK = sQ + BR * D;                      // [BC][D]
    T* sV = sK + BC * D;                      // [BC][D]
    float* xm = reinterpret_cast<float*>(reinterpret_cast<char*>(smem_u4) +
                                           (TILE_BYTES > RED_BYTES ? TILE_BYTES : RED_BYTES));   // [WARPS][BR]

#ifdef FA_VARLEN
    // packed: Q, K, V arrive as [1, H, total, d] views; this block's sequence moves their bases to its
    // first row and sets Nq, Nk and the band to its own (Nq arrives as total_q, the LSE row length)
    static_assert(!DROPOUT, "packed sequences: no dropout");
    const int total_q = Nq, vs = vl_blocks[2 * blockIdx.x];
    const int* seq = vl_seqs + VL_SEQ_INTS * vs;
    const int q0 = seq[0], k0 = seq[2];
    Nq = seq[1], Nk = seq[3], band_lo = seq[4], band_hi = seq[5];
    Q += q0 * q_sm;
    K += k0 * k_sm;
    V += k0 * v_sm;
    const int tr = vl_blocks[2 * blockIdx.x + 1], bh = blockIdx.y, b = 0, h = bh, hk = h / group;
#endif
    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
#ifndef FA_VARLEN
    const int tr = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y,    // last Q tiles first: causal's longest rows start early
              b = bh / Hq, h = bh % Hq, hk = h / group;
#endif
    const int row0 = tr * BR, nTc = (Nk + BC - 1) / BC, dch = d / 8;
#ifdef FA_VARLEN
    // a block table built for max_seqlen_q (fa2_varlen_seqs, below) holds tiles past a shorter sequence's rows
    if (row0 >= Nq) return;
#endif
    const int wrow = SPLIT_Q ? warp * RW : 0, wcol = SPLIT_Q ? 0 : warp * CW;    // this warp's rows and keys
    const T* Kb = K + b * k_sb + hk * k_sh;
    const T* Vb = V + b * v_sb + hk * v_sh;
#if defined(FA_VARLEN)
    const VarlenTiles trow{row0, min(row0 + BR, Nq) - 1, BC, Nk, band_lo, band_hi};
#elif defined(FA_MODS)
    const signed char* trow = tiles + (mod_tile_index(mod_tile_b, tile_heads, b, h) * gridDim.x + tr) * nTc;
#else
    const signed char* trow = tiles + ((long long)(tile_heads == 1 ? 0 : h) * gridDim.x + tr) * nTc;
#endif
    int t, t1;
    band_tiles(row0, min(row0 + BR, Nq) - 1, band_lo, band_hi, Nk, BC, t, t1);
#ifdef FA_MASK_MOD
    t = first_live_tile([trow](int u) { return (int)trow[u]; }, t, t1);    // a mask modifier's leading EMPTY tiles
#else                                                                     // at once (tiles.cuh)
    t = next_live_tile(trow, t, t1);
#endif

    const TileBases base = tile_bases<T, D>(sQ, sK + wcol * D, sV + wcol * D, wrow, lane);

    load_tile_async<T, BR, D, THREADS>(sQ, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, dch);
    if (t <= t1) load_tile_async<T, BC, D, THREADS>(sK, Kb, k_sm, t * BC, Nk, dch);
    cp_async_commit();

    float o[MT][ND][4], m[MT][2], l[MT][2];    // l: this lane's partial row sums (quad-reduced at the end)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.0f;
    }
#ifdef FA_DIST_BIAS
    const float slope = dist_slope_raw(b, h, MOD_FN_ARGS);
#endif

    while (t <= t1) {
        const int col0 = t * BC;
        cp_async_wait<0>();
        __syncthreads();                              // K_t (and Q) landed; every warp is done with V_{t-1}
        load_tile_async<T, BC, D, THREADS>(sV, Vb, v_sm, col0, Nk, dch);
        cp_async_commit();
        if constexpr (STAGES == 1) {                  // no overlap: K_t and V_t land before any GEMM
            cp_async_wait<0>();
            __syncthreads();
        }

        // S = Q K_t^T (fp32), this warp's RW rows x BC keys
        float s[MT][NT][4];
#ifdef FA_DIST_BIAS
        seed_scores(s, slope, row0 + wrow, col0 + wcol, g, tq);   // tc_mods.cuh: the bias seeds S
#endif
        gemm_qk<T, D, FA_SEED_S>(s, base.q, base.k);
        __syncthreads();                              // every warp is done reading K_t
        const int next = next_live_tile(trow, t + 1, t1);
        if (STAGES == 2 && next <= t1) load_tile_async<T, BC, D, THREADS>(sK, Kb, k_sm, next * BC, Nk, dch);
        cp_async_commit();                            // (an empty group keeps the wait counts fixed)

        // mask (partial tiles only), online softmax on raw scores, dropout (tc_softmax.cuh)
        const int cls = trow[t];
#ifdef FA_MODS
        // modifiers: the score modifier on every element (the mask's -inf after it), the row range checked
        // in every tile that crosses Nq or Nk (a buffer indexed by i or j must not be read past its end)
        const bool full = cls == TILE_FULL && col0 + BC <= Nk && row0 + BR <= Nq;
#ifdef FA_SCORE_MONOTONE
        // a monotone modifier (tc_mods.cuh mod_row_max; split-Q): a full tile's row max on the raw scores, then the
        // modifier, so that the max's shuffles run beside the MUFU.TANHs instead of after the last of them. Measured
        // with the soft-cap (H100, fp16 causal, N = 4k-8k, session 26): 2-3 points faster at D = 128 (Bc = 32), 2-4
        // points slower at D = 64 (Bc = 64), so D = 128 only
        if (SPLIT_Q && D == 128 && full) {
            float mx[MT][2];
            row_max(s, mx);
            mod_row_max(mx, b, h, MOD_FN_ARGS);
            mod_scores<FA_SEED_S>(s, true, cls, mask, b, h, row0 + wrow, col0 + wcol, Nq, Nk, g, tq, MOD_FN_ARGS);
            softmax_update<DROPOUT>(s, m, l, o, mx, scale_log2);
        } else
#endif
        {
            mod_scores<FA_SEED_S>(s, full, cls, mask, b, h, row0 + wrow, col0 + wcol, Nq, Nk, g, tq, MOD_FN_ARGS);
            if constexpr (SPLIT_Q) online_softmax<DROPOUT>(s, m, l, o, scale_log2);
        }
#else
        if (cls != TILE_FULL || col0 + BC > Nk) mask_scores(s, cls, mask, h, row0 + wrow, col0 + wcol, Nq, Nk, g, tq);
        if constexpr (SPLIT_Q) online_softmax<DROPOUT>(s, m, l, o, scale_log2);
#endif
        if constexpr (!SPLIT_Q) {
            float mx[MT][2];
            row_max(s, mx);
            agree_row_max<WARPS, BR>(mx, xm, warp, g, tq);   // read before the barrier below: xm is free again
            softmax_update<DROPOUT>(s, m, l, o, mx, scale_log2);
        }
        if (DROPOUT) apply_dropout<R>(s, drop, bh, row0 + wrow, col0 + wcol, g, tq);

        cp_async_wait<1>();                           // V_t landed (K_{t+1} may still be in flight)
        __syncthreads();
        gemm_pv<T, D, CW>(o, s, base.v);             // O += P V_t, P from registers
        if (STAGES == 1 && next <= t1) {              // K_{t+1} after the GEMMs (every warp passed S_t's barrier)
            load_tile_async<T, BC, D, THREADS>(sK, Kb, k_sm, next * BC, Nk, dch);
            cp_async_commit();
        }
        t = next;
    }
    cp_async_wait<0>();                               // nothing may land after the block exits
    if constexpr (!SPLIT_Q) {
        __syncthreads();                              // every warp is done with the tiles: reuse them
        add_split_k_partials<WARPS, BR, D>(o, l, reinterpret_cast<float*>(smem_u4), warp, g, tq);
        if (warp != WARPS - 1) return;                // the last warp holds the whole rows
    }

#ifdef FA_MODS
    fold_sinks(o, m, l, mod_sink, h, tq);             // attention sinks join the denominator (FA_SINKS only)
#endif
#ifdef FA_VARLEN
    write_output_packed<T>(o, m, l, O + ((long long)q0 * Hq + h) * d, (long long)Hq * d,
                           LSE + (long long)h * total_q + q0, row0 + wrow, Nq, d, g, tq);
#else
    write_output<T>(o, m, l, O, LSE, bh, row0 + wrow, Nq, d, g, tq);
#endif
}

#ifdef FA_VARLEN
// The sequence table from offsets on the GPU (cu_seqlens as flash-attn's callers keep them; sandbox/varlen.py):
// block s writes sequence s's row [VL_SEQ_INTS] of vl_seqs and its `tiles` entries of the block table vl_blocks, so
// that the forward above needs no host copy of the offsets (a copy would wait for the caller's stream) and no
// upload: every sequence gets the Q tiles of max_seqlen_q rows (`covered` rows, tiles x block_r), the forward's
// blocks past a sequence's rows returning at once.
// The offsets cannot be checked on the host without that wait, so they are checked here, per sequence: query rows
// [cu_q[s], cu_q[s + 1]) are taken where 0 <= cu_q[s] <= cu_q[s + 1] <= total_q and cu_q[s] is the maximum of
// cu_q[0 .. s] (so that no two taken sequences share a row); any other sequence gets no query rows (no block
// writes for it). Key offsets are clamped into [0, total_k] (reads only). The rows no block will write are set to
// NaN in out and lse: those of a sequence not taken, those of a sequence longer than `covered` (max_seqlen_q too
// small), and those outside [cu_q[0], cu_q[S]]; a taken sequence's block writes its rows after this kernel (stream
// order), so every row of out ends as either a taken sequence's result or NaN, and a broken contract shows.
// band_lo / band_hi: the band at Nq = Nk (sandbox/masks.py Band.from_options(1, 1, ...)), moved by each sequence's
// Nk - Nq as the host's table does. total_q, total_k < 2^31 (the host checks).
__device__ __forceinline__ void set_nan(__half& x) { x = __ushort_as_half(0x7e00); }
__device__ __forceinline__ void set_nan(__nv_bfloat16& x) { x = __ushort_as_bfloat16(0x7fc0); }

template <typename I, typename T>
__global__ void __launch_bounds__(128)
fa2_varlen_seqs(const I* __restrict__ cu_q, const I* __restrict__ cu_k, int S, long long total_q, long long total_k,
                int band_lo, int band_hi, int tiles, int block_r, int Hq, int d, int* __restrict__ vl_seqs,
                int* __restrict__ vl_blocks, T* __restrict__ O, float* __restrict__ LSE) {
    const long long covered = (long long)tiles * block_r;
    constexpr long long UNB = 1LL << 30;                       // sandbox/masks.py UNBOUNDED
    __shared__ long long warp_max[4];
    const int s = blockIdx.x;
    auto clamp = [](long long x, long long lo, long long hi) { return x < lo ? lo : (x > hi ? hi : x); };
    // the maximum of cu_q[0 .. s], over the block
    long long pm = -0x7fffffffffffffffLL - 1;
    for (int i = threadIdx.x; i <= s; i += blockDim.x) pm = max(pm, (long long)cu_q[i]);
    for (int o = 16; o > 0; o /= 2) pm = max(pm, __shfl_xor_sync(0xffffffffu, pm, o));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = pm;
    __syncthreads();
    pm = max(max(warp_max[0], warp_max[1]), max(warp_max[2], warp_max[3]));
    const long long a = cu_q[s], b = cu_q[s + 1];
    const bool taken = 0 <= a && a <= b && b <= total_q && a == pm;
    const long long q0 = clamp(a, 0, total_q), q1 = clamp(b, q0, total_q);
    const long long k0 = clamp((long long)cu_k[s], 0, total_k), k1 = clamp((long long)cu_k[s + 1], k0, total_k);
    if (threadIdx.x == 0) {
        const long long nq = taken ? q1 - q0 : 0, shift = (k1 - k0) - nq;
        const long long lo = band_lo <= -UNB ? -UNB : clamp(band_lo + shift, -UNB, UNB);
        const long long hi = band_hi >= UNB ? UNB : clamp(band_hi + shift, -UNB, UNB);
        int* row = vl_seqs + (long long)VL_SEQ_INTS * s;
        row[0] = (int)q0, row[1] = (int)nq, row[2] = (int)k0, row[3] = (int)(k1 - k0);
        row[4] = (int)lo, row[5] = (int)hi;
    }
    // rows [r0, r1) that no forward block writes: NaN in out (all heads) and lse
    auto poison = [&](long long r0, long long r1) {
        const long long width = (long long)Hq * d;
        for (long long e = r0 * width + threadIdx.x; e < r1 * width; e += blockDim.x) set_nan(O[e]);
        for (long long e = threadIdx.x; e < (r1 - r0) * Hq; e += blockDim.x)
            LSE[(e % Hq) * total_q + r0 + e / Hq] = __int_as_float(0x7fc00000);
    };
    // the block table [S * tiles][2]: block (tiles - 1 - t) S + s runs Q tile t of sequence s (every sequence's last
    // tiles first: causal's longest rows start early)
    for (int t = threadIdx.x; t < tiles; t += blockDim.x) {
        const long long b = (long long)(tiles - 1 - t) * S + s;
        vl_blocks[2 * b] = s;
        vl_blocks[2 * b + 1] = t;
    }
    if (!taken) poison(q0, q1);
    else if (q1 - q0 > covered) poison(q0 + covered, q1);
    if (s == 0) poison(0, clamp((long long)cu_q[0], 0, total_q));
    if (s == S - 1) poison(q1, total_q);
}
#endif
