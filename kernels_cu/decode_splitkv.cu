// decode_splitkv.cu: split-KV decoding against a contiguous or paged KV cache, one launch for the
// whole batch plus one small merge launch (the fast rung of sandbox/decode.py).
//
// Seed: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference",
// 2023; not among the seeds): with a handful of query rows, parallelise over the KEY axis; each
// split computes a partial softmax(q k^T) v with its own log-sum-exp, and a second pass merges the
// splits by log-sum-exp,
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
// fragment shuffles or padding of 4 rows to an m16 tile. The cost shows at many rows (ROWS = 16:
// 64 fp32 accumulators of O per thread and 16 reductions per key pair); a tensor-core rung is the
// next step for Nq * G >= 16 and is not built yet.
//
// Memory: every thread loads 16-byte vectors (8 halves of one key row: D / 8 lanes per key,
// 32 / (D / 8) keys per warp per step) and issues UNROLL steps of K and of V loads before it uses
// any (2 * UNROLL * 16 bytes in flight per thread, 4 warps per block, several blocks per SM: the
// ~16 KB per SM that Little's law asks for at ~3 TB/s), no shared memory in the key loop. Keys of
// a split are cut between the 4 warps; each warp keeps its own running max, the warps merge once
// at the end through shared memory (rescaled to the block's max), and the block writes its
// normalised partial O (fp32) and lse. K/V rows need 16-byte alignment (checked on the host).
//
// Kernels
//   decode_splitkv<T, D, ROWS, PIPE>   grid (S splits, Hkv * ceil(G * Nq / ROWS), B), 128 threads.
//       Split s of sequence b covers keys [s * chunk, min(L_b, (s + 1) * chunk)), further cut to the
//       keys some row can see (causal and window as a band, bottom-right aligned per sequence:
//       query i sees key j iff lo <= j - i - (L_b - Nq) <= hi, flash-attn's kvcache alignment); a
//       split with no key writes lse = -inf, O = 0.
//   decode_merge<T, D>   grid (B * Hq * Nq), 128 threads: merges the S partials of each row into
//       out (caller dtype, [B, Hq, Nq, D] contiguous) and lse (fp32, natural log).
// Envelope: T __half / __nv_bfloat16; D in {64, 128, 256}; ROWS in {4, 8, 16} (UNROLL 4, 2, 1:
// what fits in 255 registers without spills); pages of 2**page_shift keys (the host takes powers
// of two up to 2**20, sandbox/decode.py); keys per sequence < 2**29 (host check). Page indices are clamped to [0, num_pages) in the kernel (the host checks
// every page in use beforehand, so the clamp only turns a corrupted table into wrong numbers, never
// into an illegal access). NaN: a NaN score makes its rows' out and lse NaN (fmaxf drops NaN from the
// running max, exp2 of it is NaN in l); dead rows (no visible key) give out 0, lse -inf.
//
// Speed changes (2026-11, predictions; old H100 numbers: B = 1 N = 256k 68% of copy, B = 8 N = 256k 80%):
//  1. PIPE = 1 (default; PIPE = 0 is the old register path, SANDBOX_DECODE_PIPE=0 selects it): a
//     4-stage private cp.async ring, 3 iterations (3 x 8 KB per block at ROWS = 4) in flight while the
//     block computes instead of none; ROWS = 4 at <= 128 registers (launch bounds) -> 4 blocks / SM,
//     ~96 KB of loads outstanding per SM (was <= 48 KB, and only between computes). Predicted: every
//     memory-bound row (B = 8, 64; B = 1 N >= 32k) at >= 85-90% of copy.
//  2. Page indices read one iteration before their copies are issued (PIPE): paged within ~5% of
//     contiguous (was 10-15% behind).
//  3. plan_splits (sandbox/decode.py) fills whole waves of resident blocks (occupancy from the
//     compiled kernel's registers / shared memory): B = 1 N = 256k 66 splits x 8 = 528 blocks on 528
//     slots (was 528 blocks on 396: a last wave a third full); predicted +20-30% at B = 1, N >= 32k.
// Resources (NVRTC, sm_90, after 1-3): PIPE = 1: ROWS = 4: 128 registers, 32.8 KB static shared
// (4 blocks / SM), ROWS = 8: 241-255; ROWS = 16 only PIPE = 0; PIPE = 0 ROWS = 4: 158-161 (3 blocks
// / SM); no spills except D = 256 ROWS = 16 on sm_80 (untuned). Before:
// Resources (NVRTC, sm_90): ROWS = 4: 168 registers (3 blocks / SM), ROWS = 8: 246-254, ROWS = 16:
// 247-253 (q in shared memory), no spills; merge: 32 registers.
// Status: compiled and resource-checked on the CPU only; not yet run on a GPU: correctness
// (tests/test_decode_gpu.py) and speed (bench family `decode`, bench/decode_bench.py) pending.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define DEC_NEG_INF (-__int_as_float(0x7f800000))
#define DEC_LN2 0.6931471805599453f          // lse = ln 2 * (m + log2 l): the loop works in log2 units
#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
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
    static constexpr int RING_BYTES = STAGES * UNROLL * 2 * DEC_THREADS * 16;
    static constexpr int RED_BYTES = ROWS * D * 4;                  // the block merge's O (aliases the ring)
    static constexpr int POOL_BYTES = RING_BYTES > RED_BYTES ? RING_BYTES : RED_BYTES;
    static_assert(D == 64 || D == 128 || D == 256, "head dim D must be 64, 128 or 256");
    static_assert(ROWS == 4 || ROWS == 8 || ROWS == 16, "ROWS (query rows per tile) must be 4, 8 or 16");
    static_assert(PIPE == 0 || PIPE == 1, "PIPE must be 0 (registers) or 1 (cp.async ring)");
};

// 16 bytes global -> shared, asynchronous; src_bytes 0 fills zeros (a key past the split's end).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(sa), "l"(gmem), "r"(src_bytes) : "memory");
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

// ---- kernels

template <typename T, int D, int ROWS, int PIPE>
__global__ void __launch_bounds__(DEC_THREADS, ROWS == 4 ? (PIPE ? DEC_PIPE_MIN_BLOCKS : 3) : 1) decode_splitkv(
    const T* __restrict__ q, long long q_sb, long long q_sh, long long q_sn,  // [B, Hq, Nq, D], unit stride in D
    const T* __restrict__ k, long long k_s0, long long k_sh, long long k_sn,  // [B, Hkv, Nmax, D] or [pages, Hkv, page, D]
    const T* __restrict__ v, long long v_s0, long long v_sh, long long v_sn,  // as k (own strides)
    const int* __restrict__ seqlens,                                          // [B] keys of each sequence (L_b)
    int paged,                                                                // 0: contiguous cache, 1: paged
    const int* __restrict__ block_table, long long table_stride,              // [B, pages per sequence]; paged only
    int num_pages, int page_shift,                                            // pages in the cache, log2 page size
    float* __restrict__ o_part,                                               // [B, Hq, Nq, S, D] normalised partial O
    float* __restrict__ lse_part,                                             // [B, Hq, Nq, S] natural log
    int Hq, int Hkv, int Nq, int chunk, float scale_log2, int band_lo, int band_hi) {
    using Shape = DecodeShape<D, ROWS, PIPE>;
    constexpr int LPK = Shape::LANES_PER_KEY, KPS = Shape::KEYS_PER_STEP, U = Shape::UNROLL;
    constexpr int KPI = Shape::KEYS_PER_ITER, STAGES = Shape::STAGES;
    __shared__ __align__(16) unsigned char pool[Shape::POOL_BYTES];  // the K/V ring (PIPE), then red_o
    float (*red_o)[D] = reinterpret_cast<float (*)[D]>(pool);       // the warps' O, summed after rescaling
    uint4* ring = reinterpret_cast<uint4*>(pool);     // [STAGES][U][K, V][DEC_THREADS]: a thread's own slots
    __shared__ float red_m[DEC_WARPS][ROWS];
    __shared__ float red_l[ROWS];
    __shared__ __align__(16) float q_sm[Shape::Q_IN_SMEM ? ROWS : 1][D];

    const int S = gridDim.x, s = blockIdx.x, b = blockIdx.z;
    const int hkv = blockIdx.y % Hkv, row0 = (blockIdx.y / Hkv) * ROWS;
    const int G = Hq / Hkv, R = G * Nq;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kg = lane / LPK, c = lane % LPK;        // key of the step, 16-byte column of the key row
    const int L = seqlens[b];

    // keys of this split that some row sees: band of row 0 .. row Nq - 1
    long long lo_key = (long long)L - Nq + band_lo, hi_key = (long long)L - 1 + band_hi;
    long long k0 = max((long long)s * chunk, max(lo_key, 0LL));
    long long k1 = min(min((long long)s * chunk + chunk, (long long)L), hi_key + 1);

    // q rows of the tile, scaled into log2 units; rows past R are zero and never written
    float qr[Shape::Q_IN_SMEM ? 1 : ROWS][8];
    int diag[ROWS];                                   // visible iff band_lo <= j - diag[r] <= band_hi
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + r;
        const bool real = row < R;
        const int g = real ? row / Nq : 0, i = real ? row % Nq : 0;
        diag[r] = i + L - Nq;
        const T* qp = q + b * q_sb + (long long)(hkv * G + g) * q_sh + (long long)i * q_sn;
        if constexpr (Shape::Q_IN_SMEM) {
            for (int e = threadIdx.x; e < D; e += DEC_THREADS)
                q_sm[r][e] = real ? elem_to_float(qp[e]) * scale_log2 : 0.0f;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[r][e] = real ? elem_to_float(qp[c * 8 + e]) * scale_log2 : 0.0f;
        }
    }
    if constexpr (Shape::Q_IN_SMEM) __syncthreads();

    float m[ROWS], l[ROWS], acc[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = DEC_NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
    }

    const T* kb = k + (paged ? 0 : b * k_s0) + hkv * k_sh + c * 8;
    const T* vb = v + (paged ? 0 : b * v_s0) + hkv * v_sh + c * 8;
    const int* table = paged ? block_table + b * table_stride : block_table;
    const int page_mask = (1 << page_shift) - 1;

    // PIPE: page indices of the iteration issued next, read one iteration before its copies (the
    // block-table load never sits between the issue of two K/V copies)
    int pg[PIPE ? U : 1];
    auto load_pages = [&](int it) {
#pragma unroll
        for (int u = 0; u < (PIPE ? U : 1); ++u) {
            const long long j = k0 + (long long)it * KPI + (u * DEC_WARPS + warp) * KPS + kg;
            int page = j < k1 ? table[j >> page_shift] : 0;
            pg[u] = (unsigned)page < (unsigned)num_pages ? page : 0;   // never outside the cache
        }
    };
    auto issue = [&](int it) {                        // iteration it's K and V vectors into its ring slot
        uint4* slot = ring + (it % (STAGES ? STAGES : 1)) * (U * 2 * DEC_THREADS) + threadIdx.x;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long j = k0 + (long long)it * KPI + (u * DEC_WARPS + warp) * KPS + kg;
            const bool ok = j < k1;
            long long ko = 0, vo = 0;
            if (ok) {
                if (paged) {
                    const long long off = j & page_mask;
                    ko = (long long)pg[PIPE ? u : 0] * k_s0 + off * k_sn;
                    vo = (long long)pg[PIPE ? u : 0] * v_s0 + off * v_sn;
                } else {
                    ko = j * k_sn;
                    vo = j * v_sn;
                }
            }
            cp_async16(slot + (u * 2) * DEC_THREADS, kb + ko, ok ? 16 : 0);
            cp_async16(slot + (u * 2 + 1) * DEC_THREADS, vb + vo, ok ? 16 : 0);
        }
        cp_async_commit();
    };
    if constexpr (PIPE) {                             // prologue: STAGES - 1 iterations in flight
        if (paged) load_pages(0);
#pragma unroll
        for (int p = 0; p < STAGES - 1; ++p) {
            issue(p);
            if (paged) load_pages(p + 1);
        }
    }

    int it = 0;                                       // PIPE: the iteration computed on
    for (long long base = k0; base < k1; base += KPI, ++it) {
        uint4 kv[U], vv[U];
        int key[U];
        if constexpr (PIPE) {
            issue(it + STAGES - 1);                   // keys past k1: zero-filled, never read
            if (paged) load_pages(it + STAGES);
            cp_async_wait<STAGES - 1>();              // this thread's copies of iteration it have landed
            const uint4* slot = ring + (it % STAGES) * (U * 2 * DEC_THREADS) + threadIdx.x;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                key[u] = (int)(base + (u * DEC_WARPS + warp) * KPS + kg);
                kv[u] = slot[(u * 2) * DEC_THREADS];
                vv[u] = slot[(u * 2 + 1) * DEC_THREADS];
            }
        } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {                 // every load of the iteration issued before any use
            const long long j = base + (long long)(u * DEC_WARPS + warp) * KPS + kg;
            key[u] = (int)j;
            kv[u] = make_uint4(0, 0, 0, 0);
            vv[u] = make_uint4(0, 0, 0, 0);
            if (j < k1) {
                long long ko, vo;
                if (paged) {                          // uniform branch: one build serves both layouts
                    int page = table[j >> page_shift];
                    page = (unsigned)page < (unsigned)num_pages ? page : 0;   // never outside the cache
                    const long long off = j & page_mask;
                    ko = page * k_s0 + off * k_sn;
                    vo = page * v_s0 + off * v_sn;
                } else {
                    ko = j * k_sn;
                    vo = j * v_sn;
                }
                kv[u] = __ldg(reinterpret_cast<const uint4*>(kb + ko));
                vv[u] = __ldg(reinterpret_cast<const uint4*>(vb + vo));
            }
        }
        }
        float sc[U][ROWS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            unpack8<T>(kv[u], kf);
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
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) dot = fmaf(qe[e], kf[e], dot);
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                const int rel = key[u] - diag[r];
                const bool seen = key[u] < k1 && rel >= band_lo && rel <= band_hi;
                sc[u][r] = seen ? dot : DEC_NEG_INF;
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float mx = sc[0][r];
#pragma unroll
            for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u][r]);
#pragma unroll
            for (int o = LPK; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[r], mx);
            const float m_use = m_new == DEC_NEG_INF ? 0.0f : m_new;     // nothing seen yet: no -inf - -inf
            const float alpha = exp2f(m[r] - m_use);
            m[r] = m_new;
            l[r] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
#pragma unroll
            for (int u = 0; u < U; ++u) sc[u][r] = exp2f(sc[u][r] - m_use);   // p; 0 for a key not seen
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[8];
            unpack8<T>(vv[u], vf);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                l[r] += sc[u][r];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(sc[u][r], vf[e], acc[r][e]);
            }
        }
    }

    // the warp's keys: sum the key groups of the warp (their max is already the warp's)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int o = LPK; o < 32; o <<= 1) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
        }
    }
    // the block: rescale every warp to the block's max, then sum in shared memory (PIPE: red_o is
    // the ring's memory: every copy landed (the tail's zero fills too) and every thread done reading)
    if constexpr (PIPE) {
        cp_async_wait<0>();
        __syncthreads();
    }
    for (int x = threadIdx.x; x < ROWS * D; x += DEC_THREADS) red_o[x / D][x % D] = 0.0f;
    if (threadIdx.x < ROWS) red_l[threadIdx.x] = 0.0f;
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) red_m[warp][r] = m[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float mb = red_m[0][r];
#pragma unroll
        for (int w = 1; w < DEC_WARPS; ++w) mb = fmaxf(mb, red_m[w][r]);
        const float alpha = exp2f(m[r] - (mb == DEC_NEG_INF ? 0.0f : mb));
        if (kg == 0) {
#pragma unroll
            for (int e = 0; e < 8; ++e) atomicAdd(&red_o[r][c * 8 + e], acc[r][e] * alpha);
        }
        if (lane == 0) atomicAdd(&red_l[r], l[r] * alpha);
        m[r] = mb;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < ROWS * D; x += DEC_THREADS) {
        const int r = x / D, e = x % D, row = row0 + r;
        if (row >= R) continue;
        const int g = row / Nq, i = row % Nq;
        const long long prow = ((long long)(b * Hq + hkv * G + g) * Nq + i) * S + s;
        const float lt = red_l[r];
        o_part[prow * D + e] = lt == 0.0f ? 0.0f : red_o[r][e] / lt;     // l == 0: the row saw no key here
        if (e == 0) {
            float mb = red_m[0][r];
#pragma unroll
            for (int w = 1; w < DEC_WARPS; ++w) mb = fmaxf(mb, red_m[w][r]);
            lse_part[prow] = lt == 0.0f ? DEC_NEG_INF : DEC_LN2 * ((mb == DEC_NEG_INF ? 0.0f : mb) + log2f(lt));
        }
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
