// decode_splitkv.cu: split-KV decoding against a contiguous or paged KV cache, one launch for the
// whole batch, the splits merged by the last block of each (sequence, row tile) to finish (the fast
// rung of sandbox/decode.py).
//
// Seed: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference",
// 2023; not among the seeds): with a handful of query rows, parallelise over the KEY axis; each
// split computes a partial softmax(q k^T) v with its own log-sum-exp, and the splits are merged by
// log-sum-exp,
//     lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) out_s          (decode.merge)
// Inside a split it is the FA2 paper's (seed 002) online softmax (Sec. 2.3.1, exp2 with the scale
// folded into q, Sec. 3.1) and the FA1-style "split-K" partition of the keys across the warps of a
// block (Sec. 3.3: the scheme FA2 drops for long Q tiles is the right one when Q is a few rows), with
// the GQA index mapping of Sec. 3.1: the G query heads of one K/V head, times the Nq new rows, are
// the ROWS rows of one tile, so each K/V byte is read once per K/V head (per tile of ROWS rows).
//
// Why CUDA-core dot products and not mma.sync: decoding reads every K/V byte once and does
// 4 * ROWS flops per 2-byte element pair; at ROWS = 4 (Hq/Hkv = 4, Nq = 1, the case that dominates
// serving) that is ~4 flop/byte against the H100's ~20 fp32 CUDA-core flop per HBM byte, so the
// CUDA cores keep up, and registers hold the whole online softmax with no shared-memory staging,
// fragment shuffles or padding of 4 rows to an m16 tile. What the CUDA cores pay is instruction
// issue: at ~3 TB/s an SM consumes a warp's 2 KB step (4 keys of K and V, D = 128) every ~150
// cycles, so the instructions per step are the budget (below); a tensor-core rung is the next step
// for Nq * G >= 16 and is not built yet.
//
// Memory: every thread loads 16-byte vectors (8 halves of one key row: D / 8 lanes per key,
// 32 / (D / 8) keys per warp per step) and issues UNROLL steps of K and of V loads before it uses
// any; PIPE = 1 keeps STAGES - 1 iterations of them in flight in a private cp.async ring (~96 KB per
// SM at 4 blocks, Little's law asks ~24 KB at 3 TB/s and ~1 us). The K/V stream carries an L2
// policy (createpolicy + .L2::cache_hint; kernel argument evict_first, host switch SANDBOX_DECODE_L2):
// evict-first makes bytes read once replace each other in the L2 instead of evicting (and writing
// back, when dirty) what the L2 holds; the host's default is the normal priority, 1-3% faster on the
// H100 when nothing else wants the L2 (sandbox/decode.py DEFAULT_L2). Keys of a split are cut between the 4 warps; each warp keeps
// its own running max; the warps merge once at the end through per-warp slices of shared memory
// (rescaled to the block's max; no shared-memory atomics); K/V rows need 16-byte alignment (checked
// on the host).
//
// Scores (the per-step instruction budget): every lane forms all ROWS partial dot products over its
// 8 columns, and transpose_reduce sums them over the key's D / 8 lanes with one shuffle per kept
// value per level (halving the values per lane while it holds more than one), so lane c of a key
// group ends up owning NV = max(1, ROWS / (D / 8)) rows: 5 shuffles per key for ROWS = 4, D = 128
// instead of 16. The online softmax (max, exp2, l) runs on the owned rows only; each row's p reaches
// the other lanes for P V by one shuffle from its owner; the rescale of O runs only when some row's
// max grew (warp vote; alpha is exactly 1 otherwise), and exp2 is one MUFU (ex2.approx.ftz: every
// argument is <= 0 against a running max, and a flushed 2^-126 term is below a float sum's
// resolution). Main loop, ROWS = 4, D = 128, PIPE = 1 (sm_90 SASS): 416 instructions in the loop
// body (was 735), ~310 on the contiguous path without a rescale (was ~630), 3 MUFU (was 12),
// 19 shuffles (was 36 plus divergence checks).
//
// Kernels
//   decode_splitkv<T, D, ROWS, PIPE>   grid (S splits, Hkv * ceil(G * Nq / ROWS), B), or with
//       heads_inner = 1 the first two swapped, (row tiles, S, B); 128 threads.
//       Split s of sequence b covers keys [s * chunk, min(L_b, (s + 1) * chunk)), further cut to the
//       keys some row can see (causal and window as a band, bottom-right aligned per sequence:
//       query i sees key j iff lo <= j - i - (L_b - Nq) <= hi, flash-attn's kvcache alignment).
//       L_b = uniform_len when >= 0 (every sequence the same: no lengths array read), else seqlens[b].
//       fused = 1 (default): S = 1 writes out and lse directly; otherwise each block writes its
//       normalised partial O (fp32, only for rows that saw a key) and lse (-inf for the others),
//       counts itself in counters[b, row tile] (fence, atomicAdd), and the block that counts S
//       merges the tile's S partials into out and lse (weights exp(lse_s - max) staged in shared
//       memory, 16 splits' 16-byte loads in flight per thread) and resets the counter to 0: the host
//       keeps one counter buffer per stream, zeroed once (sandbox/decode.py _counters), so no launch
//       needs a memset. fused = 0: partials only, decode_merge merges (two launches: the old form).
//   decode_merge<T, D>   grid (B * Hq * Nq), 128 threads: merges the S partials of each row into
//       out (caller dtype, [B, Hq, Nq, D] contiguous) and lse (fp32, natural log); fused = 0 only.
// Envelope: T __half / __nv_bfloat16; D in {64, 128, 256}; ROWS in {4, 8, 16} (UNROLL 4, 2, 1:
// what fits in 255 registers without spills); pages of 2**page_shift keys (the host takes powers
// of two up to 2**20, sandbox/decode.py); keys per sequence < 2**29 (host check); any S (the merge
// stages DEC_MAX_SPLITS weights and recomputes the rest; the host plans at most 256). Page indices
// are clamped to [0, num_pages) in the kernel (the host checks every page in use beforehand, so the
// clamp only turns a corrupted table into wrong numbers, never into an illegal access). NaN: a NaN
// score makes its rows' out and lse NaN (fmaxf drops NaN from the running max, exp2 of it is NaN in
// l); dead rows (no visible key) give out 0, lse -inf.
//
// Speed changes, round 2 (2026-11, predictions against the H100 figures of 2e6507c (ms, SDPA
// flash in the same run): B = 1: 4k 0.0306 (0.0254), 32k 0.0837 (0.0714), 256k 0.404 (0.373);
// B = 8: 4k 0.0792 (0.0670), 32k 0.403 (0.370), 256k 2.944 (2.825); B = 64: 4k 0.401 (0.414),
// 32k 2.996 (3.138); a fit of those: ~2.95 TB/s plus ~25 us fixed at 16 MB, ~40 us at >= 134 MB,
// against SDPA's ~3.06 TB/s plus ~20 us):
//  1. One launch: the merge kernel, its launch gap and its serial per-row loop go (2-4 us of launch
//     gap and 2-5 us of merge at S = 32-66, now ~1.5 us of fence / count plus ~1-2 us of merge in
//     the last block), S = 1 skips partials and merge altogether (B = 64); no shared-memory CAS
//     loops in the block merge (32 per lane, 4 warps on the same words: ~1-3 us at every block's end).
//  2. Equal lengths by value (no lengths read ahead of the first K/V address: ~0.5-1 us of
//     critical path) and a paged call's lengths and table in one upload (one ~2 us copy fewer).
//  3. The instruction diet above (about half the instructions per step): large N from ~2.95 TB/s
//     toward the copy's ~3.0 (0-4%).
//  4. Evict-first K/V: if the ~15 us of extra fixed cost at >= 134 MB is the write-back of the L2's
//     dirty lines (the bench's L2 flush leaves 50 MB of them), up to ~10-12 us per call at >= 134 MB,
//     ~3 us at 16 MB; else ~0.
//  The split plan is unchanged: against flash-attn's num_splits_heuristic (smallest split count
//  within 85% of the best wave efficiency, 2 CTAs per SM, 128-key blocks) it already launches as
//  many or more blocks (B = 1: 256 / 512 / 528 blocks at 4k / 32k / 256k keys, flash-attn 256 / 232
//  / 232 CTAs; B = 8: 512 / 512 / 2112, flash-attn 256 each) with ~24 KB in flight per block
//  (3 iterations of the ring): >= 6 MB across the chip, above the ~3-6 MB Little's law asks at 3 TB/s
//  and 1-2 us. More splits at B = 1 would add merge work, not bytes in flight.
// Resources (NVRTC 13, after, sm_90 / sm_80, registers, static shared): PIPE = 1: ROWS = 4: 115-128,
// 32.9 KB (4 blocks / SM); ROWS = 8: 183-210, 33.1 KB; PIPE = 0: ROWS = 4: 145-168, 4.2-16.5 KB
// (3 blocks / SM); ROWS = 8: 191-212, 8.5-33.1 KB; ROWS = 16: 232-239, 21.1-41.6 KB; no spills
// anywhere (D = 256 ROWS = 16 spilled 16-72 bytes on sm_80 before); merge: 32 registers. Before
// (2e6507c, sm_90): PIPE = 1 ROWS = 4: 128, 32.8 KB; ROWS = 8: 241-255; PIPE = 0 ROWS = 4: 159-163;
// ROWS = 8: 248-255; ROWS = 16: 247-253.
// Status: compiled and resource-checked on the CPU; the lane algebra (transposed reduction, row
// ownership, broadcasts, lazy rescale, block and fused merges) checked against the float64 oracle by
// a NumPy lane-by-lane model of this kernel (tests/test_decode.py keeps the reduction's part); not
// yet run on a GPU (tests/test_decode_gpu.py, bench family `decode`).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define DEC_NEG_INF (-__int_as_float(0x7f800000))
#define DEC_LN2 0.6931471805599453f          // lse = ln 2 * (m + log2 l): the loop works in log2 units
#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_FULL 0xffffffffu
#define DEC_MAX_SPLITS 256                     // splits whose merge weights the fused merge stages in shared memory
#ifndef DEC_PIPE_MIN_BLOCKS
#define DEC_PIPE_MIN_BLOCKS 4                  // PIPE, ROWS = 4: <= 128 registers, 4 blocks (16 warps) per SM
#endif

// ---- device helpers

__device__ __forceinline__ float2 pair_to_float2(unsigned w, __half) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 pair_to_float2(unsigned w, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

// 8 consecutive 16-bit elements (one 16-byte vector) as 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    const float2 a = pair_to_float2(u.x, T()), b = pair_to_float2(u.y, T());
    const float2 c = pair_to_float2(u.z, T()), d = pair_to_float2(u.w, T());
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

__device__ __forceinline__ float elem_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float elem_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store_elem(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_elem(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
// 4 consecutive outputs as one 8-byte store (p 8-byte aligned: a fresh [rows, D] array, D % 4 == 0)
__device__ __forceinline__ void store4(__half* p, float4 x) {
    __half2 a = __floats2half2_rn(x.x, x.y), b = __floats2half2_rn(x.z, x.w);
    uint2 u;
    u.x = *reinterpret_cast<unsigned*>(&a);
    u.y = *reinterpret_cast<unsigned*>(&b);
    *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 x) {
    __nv_bfloat162 a = __floats2bfloat162_rn(x.x, x.y), b = __floats2bfloat162_rn(x.z, x.w);
    uint2 u;
    u.x = *reinterpret_cast<unsigned*>(&a);
    u.y = *reinterpret_cast<unsigned*>(&b);
    *reinterpret_cast<uint2*>(p) = u;
}

// 2^x by the MUFU directly (ex2.approx.ftz: -inf -> +0, NaN -> NaN, results below 2^-126 -> 0; exp2f
// adds the denormal range around the same MUFU.EX2, four instructions instead of one). Every use
// takes x <= 0 against a running max, where a flushed 2^-126 term is below a float sum's resolution.
__device__ __forceinline__ float dec_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// L2 eviction policy for the streamed K/V. evict_first: a stream of cache bytes read
// once replaces its own lines rather than whatever else the L2 holds (dirty lines included, whose
// write-back would share the DRAM with the stream); evict_normal (the host's default): the
// hardware's default priority.
__device__ __forceinline__ unsigned long long l2_stream_policy(int evict_first) {
    unsigned long long pol = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (evict_first)
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    else
        asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
#endif
    return pol;
}

// 16 bytes global -> shared, asynchronous; src_bytes 0 fills zeros (a key past the split's end).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes, unsigned long long pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 :: "r"(sa), "l"(gmem), "r"(src_bytes), "l"(pol) : "memory");
#else
    *reinterpret_cast<uint4*>(smem) = src_bytes ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}
// 16 bytes global -> registers through the read-only path, not allocated in L1, evict-first in L2
__device__ __forceinline__ uint4 ld_stream16(const void* p, unsigned long long pol) {
    uint4 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(pol));
#else
    r = __ldg(reinterpret_cast<const uint4*>(p));
#endif
    return r;
}

// Transposed warp reduction of ROWS per-lane partial dot products over the LPK lanes of a key
// (xor masks LPK / 2 .. 1): while a lane holds more than one value, each level sends half of them to
// its partner and keeps the other half (the lane whose mask bit is set keeps the upper half), so a
// level costs one shuffle per value kept instead of one per row; once a lane holds one value the
// remaining levels are plain butterflies. After it, v[0 .. NV - 1] (NV = max(1, ROWS / LPK)) are
// full dot products of the rows `own_row(c, i)` below (c = lane % LPK). Partners at every level
// agree on the bits already processed, so they hold the same rows: each sum adds one row's terms.
template <int NV, int M>
__device__ __forceinline__ void transpose_reduce(float* v, int lane) {
    if constexpr (M >= 1) {
        if constexpr (NV > 1) {
            const bool up = (lane & M) != 0;
#pragma unroll
            for (int i = 0; i < NV / 2; ++i) {
                const float send = up ? v[i] : v[i + NV / 2];
                const float keep = up ? v[i + NV / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(DEC_FULL, send, M);
            }
            transpose_reduce<NV / 2, M / 2>(v, lane);
        } else {
            v[0] += __shfl_xor_sync(DEC_FULL, v[0], M);
            transpose_reduce<1, M / 2>(v, lane);
        }
    }
}

// Loop shape per head dim, row tile and load path: keys per warp step and steps per iteration.
// PIPE = 0: the register path (UNROLL steps of K and V loaded into registers, then used; nothing in
// flight while the block computes). PIPE = 1: the cp.async path (sm_80+): each thread streams its own
// 16-byte K and V vectors into a private STAGES-deep ring in shared memory, STAGES - 1 iterations
// ahead of the one it computes on (no __syncthreads: a thread reads only what it copied itself).
template <int D, int ROWS, int PIPE>
struct DecodeShape {
    static constexpr int LANES_PER_KEY = D / 8;                     // 16-byte vectors per key row
    static constexpr int KEYS_PER_STEP = 32 / LANES_PER_KEY;        // keys a warp covers per load
    static constexpr int UNROLL = PIPE ? (ROWS <= 8 ? 2 : 1)        // steps per iteration
                                       : (ROWS <= 4 ? 4 : (ROWS == 8 ? 2 : 1));   // register path: loads in flight
    static constexpr int STAGES = PIPE ? 4 : 0;                     // ring depth (iterations) of the cp.async path
    static constexpr int KEYS_PER_ITER = DEC_WARPS * KEYS_PER_STEP * UNROLL;
    static constexpr bool Q_IN_SMEM = ROWS > 8;                     // registers: ROWS * 8 q + ROWS * 8 acc
    static constexpr int NV = ROWS > LANES_PER_KEY ? ROWS / LANES_PER_KEY : 1;   // rows a lane owns (transpose_reduce)
    static constexpr int REPLICAS = ROWS < LANES_PER_KEY ? LANES_PER_KEY / ROWS : 1;   // lanes per owned row and key
    static constexpr int RING_BYTES = STAGES * UNROLL * 2 * DEC_THREADS * 16;
    static constexpr int SLICE_BYTES = ROWS * D * 4;                // one warp's O in the block merge
    static constexpr int SLICES = (PIPE || DEC_WARPS * SLICE_BYTES <= 32768) ? DEC_WARPS : 1;   // 1: warps add in turn
    static constexpr int WTS_BYTES = ROWS * DEC_MAX_SPLITS * 4;     // the fused merge's split weights
    static constexpr int POOL_A = RING_BYTES > SLICES * SLICE_BYTES ? RING_BYTES : SLICES * SLICE_BYTES;
    static constexpr int POOL_BYTES = POOL_A > WTS_BYTES ? POOL_A : WTS_BYTES;   // ring, then slices, then weights
    static_assert(D == 64 || D == 128 || D == 256, "head dim D must be 64, 128 or 256");
    static_assert(ROWS == 4 || ROWS == 8 || ROWS == 16, "ROWS (query rows per tile) must be 4, 8 or 16");
    static_assert(PIPE == 0 || PIPE == 1, "PIPE must be 0 (registers) or 1 (cp.async ring)");
    static_assert(!PIPE || DEC_WARPS * SLICE_BYTES <= RING_BYTES, "PIPE: the warps' O slices live in the ring");
};

// ---- kernels

template <typename T, int D, int ROWS, int PIPE>
__global__ void __launch_bounds__(DEC_THREADS, ROWS == 4 ? (PIPE ? DEC_PIPE_MIN_BLOCKS : 3) : 1) decode_splitkv(
    const T* __restrict__ q, long long q_sb, long long q_sh, long long q_sn,  // [B, Hq, Nq, D], unit stride in D
    const T* __restrict__ k, long long k_s0, long long k_sh, long long k_sn,  // [B, Hkv, Nmax, D] or [pages, Hkv, page, D]
    const T* __restrict__ v, long long v_s0, long long v_sh, long long v_sn,  // as k (own strides)
    const int* __restrict__ seqlens,                                          // [B] keys of each sequence (L_b)
    int uniform_len,                                                          // >= 0: every L_b (seqlens unread)
    int paged,                                                                // 0: contiguous cache, 1: paged
    const int* __restrict__ block_table, long long table_stride,              // [B, pages per sequence]; paged only
    int num_pages, int page_shift,                                            // pages in the cache, log2 page size
    float* __restrict__ o_part,                                               // [B, Hq, Nq, S, D] normalised partial O
    float* __restrict__ lse_part,                                             // [B, Hq, Nq, S] natural log
    unsigned* __restrict__ counters,                                          // fused: [B, row tiles], zero between launches
    int fused,                                                                // 1: merge here; 0: decode_merge merges
    T* __restrict__ out, float* __restrict__ lse,                             // fused: [B, Hq, Nq, D], [B, Hq, Nq]
    int Hq, int Hkv, int Nq, int chunk, float scale_log2, int band_lo, int band_hi,
    int evict_first,                                                          // L2 priority of the K/V stream
    int heads_inner) {                                                        // grid order (below)

    using Shape = DecodeShape<D, ROWS, PIPE>;
    constexpr int LPK = Shape::LANES_PER_KEY, KPS = Shape::KEYS_PER_STEP, U = Shape::UNROLL;
    constexpr int KPI = Shape::KEYS_PER_ITER, STAGES = Shape::STAGES, NV = Shape::NV, REP = Shape::REPLICAS;
    constexpr int SLICES = Shape::SLICES;
    __shared__ __align__(16) unsigned char pool[Shape::POOL_BYTES];  // the K/V ring (PIPE), then O slices, then weights
    uint4* ring = reinterpret_cast<uint4*>(pool);     // [STAGES][U][K, V][DEC_THREADS]: a thread's own slots
    float (*slice)[ROWS][D] = reinterpret_cast<float (*)[ROWS][D]>(pool);   // [SLICES][ROWS][D]
    float (*wts)[DEC_MAX_SPLITS] = reinterpret_cast<float (*)[DEC_MAX_SPLITS]>(pool);   // [ROWS][DEC_MAX_SPLITS]
    __shared__ float red_m[DEC_WARPS][ROWS], red_l[DEC_WARPS][ROWS];
    __shared__ float tile_m[ROWS], tile_l[ROWS];      // the block's max and sum per row (log2 units)
    __shared__ int last_block;
    __shared__ __align__(16) float q_sm[Shape::Q_IN_SMEM ? ROWS : 1][D];

    // grid (S, tiles, B), or (tiles, S, B) with heads_inner: then the blocks that start together are
    // the K/V heads of one split, which read the same keys (the heads of a key are one row in
    // flash-attn's (B, N, Hkv, d) cache)
    const int S = heads_inner ? gridDim.y : gridDim.x, s = heads_inner ? blockIdx.y : blockIdx.x;
    const int tiles = heads_inner ? gridDim.x : gridDim.y, tile_id = heads_inner ? blockIdx.x : blockIdx.y;
    const int b = blockIdx.z;
    const int hkv = tile_id % Hkv, row0 = (tile_id / Hkv) * ROWS;
    const int G = Hq / Hkv, R = G * Nq;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kg = lane / LPK, c = lane % LPK;        // key of the step, 16-byte column of the key row
    const int kgb = lane & ~(LPK - 1);                // the key group's first lane
    const int L = uniform_len >= 0 ? uniform_len : seqlens[b];
    const unsigned long long pol = l2_stream_policy(evict_first);

    // keys of this split that some row sees: band of row 0 .. row Nq - 1 (all < 2**30: host checks)
    const long long lo_key = (long long)L - Nq + band_lo, hi_key = (long long)L - 1 + band_hi;
    const int k0 = (int)max((long long)s * chunk, max(lo_key, 0LL));
    const int k1 = (int)min(min((long long)s * chunk + chunk, (long long)L), hi_key + 1);

    // q rows of the tile (all ROWS: every lane forms every row's partial dot), scaled into log2 units;
    // rows past R are zero and never written
    float qr[Shape::Q_IN_SMEM ? 1 : ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + r;
        const bool real = row < R;
        const int g = real ? row / Nq : 0, i = real ? row % Nq : 0;
        const T* qp = q + b * q_sb + (long long)(hkv * G + g) * q_sh + (long long)i * q_sn;
        if constexpr (Shape::Q_IN_SMEM) {
            for (int e = threadIdx.x; e < D; e += DEC_THREADS)
                q_sm[r][e] = real ? elem_to_float(qp[e]) * scale_log2 : 0.0f;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[r][e] = real ? elem_to_float(qp[c * 8 + e]) * scale_log2 : 0.0f;
        }
    }
    // the rows this lane owns after transpose_reduce: softmax state and band offsets for those only
    int diag[NV];                                     // visible iff band_lo <= j - diag <= band_hi
    float m[NV], l[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int row = row0 + (ROWS <= LPK ? c / REP : c * NV + i);
        diag[i] = (row < R ? row % Nq : 0) + L - Nq;
        m[i] = DEC_NEG_INF;
        l[i] = 0.0f;
    }
    float acc[ROWS][8];                               // every row's O over this lane's 8 columns
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
    if constexpr (Shape::Q_IN_SMEM) __syncthreads();

    // K/V addresses: this thread's column of head hkv; contiguous: of sequence b, key j at j * k_sn;
    // paged: page p of the cache at p * k_s0, key j at (j & page_mask) * k_sn
    const T* kb = k + (paged ? 0 : b * k_s0) + hkv * k_sh + c * 8;
    const T* vb = v + (paged ? 0 : b * v_s0) + hkv * v_sh + c * 8;
    const int* table = paged ? block_table + b * table_stride : block_table;
    const int page_mask = (1 << page_shift) - 1;
    auto page_of = [&](int j) {                       // clamped: never outside the cache
        const int page = j < k1 ? table[j >> page_shift] : 0;
        return (unsigned)page < (unsigned)num_pages ? page : 0;
    };
    auto key_of = [&](int it, int u) { return k0 + it * KPI + (u * DEC_WARPS + warp) * KPS + kg; };
    auto addr = [&](int j, int page, const T*& kp, const T*& vp) {
        if (paged) {
            const long long off = j & page_mask;
            kp = kb + (long long)page * k_s0 + off * k_sn;
            vp = vb + (long long)page * v_s0 + off * v_sn;
        } else {
            kp = kb + (long long)(unsigned)j * k_sn;
            vp = vb + (long long)(unsigned)j * v_sn;
        }
    };

    // PIPE: page indices of the iteration issued next, read one iteration before its copies (the
    // block-table load never sits between the issue of two K/V copies)
    int pg[PIPE ? U : 1];
    auto issue = [&](int it) {                        // iteration it's K and V vectors into its ring slot
        uint4* slot = ring + (it % (STAGES ? STAGES : 1)) * (U * 2 * DEC_THREADS) + threadIdx.x;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = key_of(it, u);
            const bool ok = j < k1;
            const T* kp = kb;                         // a key past the split: zero fill from a valid address
            const T* vp = vb;
            if (ok) addr(j, pg[PIPE ? u : 0], kp, vp);
            cp_async16(slot + (u * 2) * DEC_THREADS, kp, ok ? 16 : 0, pol);
            cp_async16(slot + (u * 2 + 1) * DEC_THREADS, vp, ok ? 16 : 0, pol);
        }
        cp_async_commit();
    };
    if constexpr (PIPE) {                             // prologue: STAGES - 1 iterations in flight
        int pre[STAGES > 1 ? STAGES - 1 : 1][U];      // their page indices, loaded together
        if (paged) {
#pragma unroll
            for (int p = 0; p < STAGES - 1; ++p)
#pragma unroll
                for (int u = 0; u < U; ++u) pre[p][u] = page_of(key_of(p, u));
        }
#pragma unroll
        for (int p = 0; p < STAGES - 1; ++p) {
#pragma unroll
            for (int u = 0; u < U; ++u) pg[u] = paged ? pre[p][u] : 0;
            issue(p);
        }
        if (paged) {
#pragma unroll
            for (int u = 0; u < U; ++u) pg[u] = page_of(key_of(STAGES - 1, u));
        }
    }

    int it = 0;                                       // the iteration computed on
    for (int base = k0; base < k1; base += KPI, ++it) {
        uint4 kv[U], vv[U];
        if constexpr (PIPE) {
            issue(it + STAGES - 1);                   // keys past k1: zero-filled, never read
            if (paged) {
#pragma unroll
                for (int u = 0; u < U; ++u) pg[u] = page_of(key_of(it + STAGES, u));
            }
            cp_async_wait<STAGES - 1>();              // this thread's copies of iteration it have landed
            const uint4* slot = ring + (it % STAGES) * (U * 2 * DEC_THREADS) + threadIdx.x;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                kv[u] = slot[(u * 2) * DEC_THREADS];
                vv[u] = slot[(u * 2 + 1) * DEC_THREADS];
            }
        } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {             // every load of the iteration issued before any use
                const int j = key_of(it, u);
                kv[u] = make_uint4(0, 0, 0, 0);
                vv[u] = make_uint4(0, 0, 0, 0);
                if (j < k1) {
                    const T* kp;
                    const T* vp;
                    addr(j, paged ? page_of(j) : 0, kp, vp);
                    kv[u] = ld_stream16(kp, pol);
                    vv[u] = ld_stream16(vp, pol);
                }
            }
        }
        // scores of the owned rows: every row's partial dot over this lane's 8 columns, reduced
        // over the key's lanes by transpose_reduce (one shuffle per kept value per level)
        float sc[U][NV];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            unpack8<T>(kv[u], kf);
            float part[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float qe[8];
                if constexpr (Shape::Q_IN_SMEM) {         // two 16-byte broadcast reads
                    const float4 a = *reinterpret_cast<const float4*>(&q_sm[r][c * 8]);
                    const float4 z = *reinterpret_cast<const float4*>(&q_sm[r][c * 8 + 4]);
                    qe[0] = a.x; qe[1] = a.y; qe[2] = a.z; qe[3] = a.w; qe[4] = z.x; qe[5] = z.y; qe[6] = z.z; qe[7] = z.w;
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) qe[e] = qr[Shape::Q_IN_SMEM ? 0 : r][e];
                }
                float dot = qe[0] * kf[0];
#pragma unroll
                for (int e = 1; e < 8; ++e) dot = fmaf(qe[e], kf[e], dot);
                part[r] = dot;
            }
            transpose_reduce<ROWS, LPK / 2>(part, lane);
            const int key = key_of(it, u);
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int rel = key - diag[i];
                const bool seen = key < k1 && rel >= band_lo && rel <= band_hi;
                sc[u][i] = seen ? part[i] : DEC_NEG_INF;
            }
        }
        // online softmax of the owned rows; the running max is warp-wide (max over the key groups)
        float m_new[NV], m_use[NV];
        bool grow = false;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            float mx = sc[0][i];
#pragma unroll
            for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u][i]);
#pragma unroll
            for (int o = LPK; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(DEC_FULL, mx, o));
            m_new[i] = fmaxf(m[i], mx);               // NaN scores are dropped here and kept by p below
            grow |= m_new[i] > m[i];
            m_use[i] = m_new[i] == DEC_NEG_INF ? 0.0f : m_new[i];   // nothing seen yet: no -inf - -inf
        }
        // rescale only when some row's max grew (alpha == 1 exactly otherwise): warp-uniform
        if (__any_sync(DEC_FULL, grow)) {
            float alpha[NV];
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                alpha[i] = dec_exp2(m[i] - m_use[i]);
                l[i] *= alpha[i];
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float a = __shfl_sync(DEC_FULL, alpha[ROWS <= LPK ? 0 : r % NV],
                                            kgb + (ROWS <= LPK ? r * REP : r / NV));
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] *= a;
            }
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            m[i] = m_new[i];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                sc[u][i] = dec_exp2(sc[u][i] - m_use[i]);   // p; 0 for a key not seen
                l[i] += sc[u][i];
            }
        }
        // O += p v: every row's p of the step's key from the lane that owns the row
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[8];
            unpack8<T>(vv[u], vf);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float p = __shfl_sync(DEC_FULL, sc[u][ROWS <= LPK ? 0 : r % NV],
                                            kgb + (ROWS <= LPK ? r * REP : r / NV));
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(p, vf[e], acc[r][e]);
            }
        }
    }

    // the warp's keys: sum the key groups of the warp (their max is already the warp's)
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
        for (int i = 0; i < NV; ++i) l[i] += __shfl_xor_sync(DEC_FULL, l[i], o);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][e] += __shfl_xor_sync(DEC_FULL, acc[r][e], o);
    }
    // the block: every warp's O rescaled to the block's max of each row, summed over the warps' slices
    // of shared memory (PIPE: the slices are the ring's memory: every copy landed (the tail's zero
    // fills too) and every thread done reading before the barrier)
    if constexpr (PIPE) cp_async_wait<0>();
    if (kg == 0 && (ROWS > LPK || c % REP == 0)) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int r = ROWS <= LPK ? c / REP : c * NV + i;
            red_m[warp][r] = m[i];
            red_l[warp][r] = l[i];
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float mb = red_m[0][r];
#pragma unroll
        for (int w = 1; w < DEC_WARPS; ++w) mb = fmaxf(mb, red_m[w][r]);
        const float a = dec_exp2(red_m[warp][r] - (mb == DEC_NEG_INF ? 0.0f : mb));   // 0: the warp saw none of it
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] *= a;
    }
    if constexpr (SLICES == DEC_WARPS) {
        if (kg == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                *reinterpret_cast<float4*>(&slice[warp][r][c * 8]) = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
                *reinterpret_cast<float4*>(&slice[warp][r][c * 8 + 4]) = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
            }
        }
    } else {                                          // one slice: the warps add in turn
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
            if (warp == w && kg == 0) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int e = 0; e < 8; ++e) slice[0][r][c * 8 + e] = (w ? slice[0][r][c * 8 + e] : 0.0f) + acc[r][e];
            }
            if (w + 1 < DEC_WARPS) __syncthreads();
        }
    }
    if (threadIdx.x < ROWS) {
        const int r = threadIdx.x;
        float mb = red_m[0][r];
#pragma unroll
        for (int w = 1; w < DEC_WARPS; ++w) mb = fmaxf(mb, red_m[w][r]);
        const float mu = mb == DEC_NEG_INF ? 0.0f : mb;
        float lt = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) lt += dec_exp2(red_m[w][r] - mu) * red_l[w][r];
        tile_m[r] = mu;
        tile_l[r] = lt;
    }
    __syncthreads();
    // the block's rows: the whole row when fused with one split, else the split's partial (normalised
    // O only where the row saw a key: the merges weigh a split with lse = -inf by 0 and never read it)
    const bool direct = fused && S == 1;
    for (int x = threadIdx.x; x < ROWS * (D / 4); x += DEC_THREADS) {
        const int r = x / (D / 4), col = (x % (D / 4)) * 4, row = row0 + r;
        if (row >= R) continue;
        const int g = row / Nq, i = row % Nq;
        const long long orow = (long long)(b * Hq + hkv * G + g) * Nq + i;      // [B, Hq, Nq] row
        float4 o = *reinterpret_cast<const float4*>(&slice[0][r][col]);
#pragma unroll
        for (int w = 1; w < SLICES; ++w) {
            const float4 z = *reinterpret_cast<const float4*>(&slice[w][r][col]);
            o.x += z.x; o.y += z.y; o.z += z.z; o.w += z.w;
        }
        const float lt = tile_l[r];
        if (lt == 0.0f) {                             // the row saw no key here: O = 0
            o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        } else {
            const float inv = 1.0f / lt;
            o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
        }
        const float lse_row = lt == 0.0f ? DEC_NEG_INF : DEC_LN2 * (tile_m[r] + log2f(lt));
        if (direct) {
            store4(out + orow * D + col, o);
            if (col == 0) lse[orow] = lse_row;
        } else {
            const long long prow = orow * S + s;
            if (lt != 0.0f) __stcg(reinterpret_cast<float4*>(o_part + prow * D + col), o);
            if (col == 0) __stcg(lse_part + prow, lse_row);
        }
    }
    if (!fused || S == 1) return;

    // fused merge: the last block of this (sequence, row tile) to finish merges the S partials
    // (the counter is per (b, tile_id), zero at launch; that block resets it for the next launch on
    // the stream; the fences order every block's partials before its count and the reads after it)
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned* ctr = counters + (long long)b * tiles + tile_id;
        const bool last = atomicAdd(ctr, 1u) == (unsigned)(S - 1);
        if (last) {
            atomicExch(ctr, 0u);
            __threadfence();
        }
        last_block = last;
    }
    __syncthreads();
    if (!last_block) return;
    constexpr float LOG2E = 1.4426950408889634f;
    // weights: per row, w_s = exp(lse_s - M) over the splits (warp r % DEC_WARPS), sum and lse
    for (int r = warp; r < ROWS; r += DEC_WARPS) {
        const int row = row0 + r;
        if (row >= R) continue;
        const long long orow = (long long)(b * Hq + hkv * G + row / Nq) * Nq + row % Nq;
        const float* ls = lse_part + orow * S;
        float xs[DEC_MAX_SPLITS / 32];
        float M = DEC_NEG_INF;
#pragma unroll
        for (int j = 0; j < DEC_MAX_SPLITS / 32; ++j) {
            const int t = lane + 32 * j;
            xs[j] = t < S ? __ldcg(ls + t) : DEC_NEG_INF;
            M = fmaxf(M, xs[j]);                      // NaN dropped here, kept by the weights
        }
        for (int t = DEC_MAX_SPLITS + lane; t < S; t += 32) M = fmaxf(M, __ldcg(ls + t));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(DEC_FULL, M, o));
        const float M0 = M == DEC_NEG_INF ? 0.0f : M;
        float total = 0.0f;
#pragma unroll
        for (int j = 0; j < DEC_MAX_SPLITS / 32; ++j) {
            const int t = lane + 32 * j;
            const float w = dec_exp2((xs[j] - M0) * LOG2E);   // 0 for a split that saw nothing
            if (t < S) wts[r][t] = w;
            total += w;
        }
        for (int t = DEC_MAX_SPLITS + lane; t < S; t += 32) total += dec_exp2((__ldcg(ls + t) - M0) * LOG2E);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(DEC_FULL, total, o);
        if (lane == 0) {
            tile_m[r] = M0;
            tile_l[r] = total;
            lse[orow] = total == 0.0f ? DEC_NEG_INF : M0 + logf(total);   // no split saw a key (NaN is not dead)
        }
    }
    __syncthreads();
    // out = sum_s w_s O_s / sum_s w_s, 16 bytes of a row per thread, MU splits' loads in flight (the
    // loop's registers are free by now: S = 64 is 4 round trips to the L2)
    constexpr int MU = 16;
    for (int x = threadIdx.x; x < ROWS * (D / 4); x += DEC_THREADS) {
        const int r = x / (D / 4), col = (x % (D / 4)) * 4, row = row0 + r;
        if (row >= R) continue;
        const long long orow = (long long)(b * Hq + hkv * G + row / Nq) * Nq + row % Nq;
        const float* op = o_part + orow * S * D + col;
        const float M0 = tile_m[r], total = tile_l[r];
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int t0 = 0; t0 < S; t0 += MU) {
            float w[MU];
            float4 z[MU];
#pragma unroll
            for (int j = 0; j < MU; ++j) {
                const int t = t0 + j;
                w[j] = t >= S ? 0.0f : t < DEC_MAX_SPLITS ? wts[r][t]
                                     : dec_exp2((__ldcg(lse_part + orow * S + t) - M0) * LOG2E);
                z[j] = w[j] != 0.0f ? __ldcg(reinterpret_cast<const float4*>(op + (long long)t * D))
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int j = 0; j < MU; ++j) {
                a.x = fmaf(w[j], z[j].x, a.x); a.y = fmaf(w[j], z[j].y, a.y);
                a.z = fmaf(w[j], z[j].z, a.z); a.w = fmaf(w[j], z[j].w, a.w);
            }
        }
        const float inv = total == 0.0f ? 0.0f : 1.0f / total;
        a.x *= inv; a.y *= inv; a.z *= inv; a.w *= inv;
        store4(out + orow * D + col, a);
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(DEC_THREADS) decode_merge(
    const float* __restrict__ o_part,     // [rows, S, D], rows = B * Hq * Nq
    const float* __restrict__ lse_part,   // [rows, S]
    T* __restrict__ out,                  // [rows, D] (out [B, Hq, Nq, D] contiguous)
    float* __restrict__ lse,              // [rows]
    int S) {
    const long long row = blockIdx.x;
    const float* ls = lse_part + row * S;
    float M = DEC_NEG_INF;
    for (int t = 0; t < S; ++t) M = fmaxf(M, ls[t]);              // NaN dropped here, kept by the weights
    const float M0 = M == DEC_NEG_INF ? 0.0f : M;
    for (int e = threadIdx.x; e < D; e += DEC_THREADS) {
        float total = 0.0f, o = 0.0f;
        for (int t = 0; t < S; ++t) {
            const float w = expf(ls[t] - M0);                   // 0 for a split that saw nothing
            total += w;
            if (w != 0.0f) o = fmaf(w, o_part[(row * S + t) * D + e], o);
        }
        const bool dead = total == 0.0f;                          // no split saw a key (NaN is not dead)
        store_elem(out + row * D + e, dead ? 0.0f : o / total);
        if (e == 0) lse[row] = dead ? DEC_NEG_INF : M0 + logf(total);
    }
}
