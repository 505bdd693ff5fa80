// fa2_tc_naive.cu: FlashAttention-2 forward on tensor cores, the first rung of the ladder.
//
// Seed: FA2 paper (002) Algorithm 1 (Q-outer loop, online softmax, logsumexp saved), Sec. 3.1 and
// 3.3 (split-Q warps), as in fa2_tc.cu. What this rung leaves out, so that the table shows what
// each step of fa2_tc.cu buys:
//   - operands reach the tensor cores by plain 32-bit (Q, K) and 16-bit (V, pairs along keys)
//     shared-memory loads from unpadded, unswizzled tiles: no ldmatrix, bank conflicts included
//     (a K fragment's 8 rows g = 0..7 sit D * 2 bytes apart: the same bank for D = 64 and 128);
//   - global -> shared copies are synchronous 16-byte loads and stores between two barriers: no
//     cp.async, no overlap of copies with the GEMMs.
// What it keeps: mma.sync.m16n8k16 with fp32 accumulation, P in registers between the GEMMs, the
// softmax, masks, dropout and epilogue of tc_softmax.cuh (shared with fa2_tc.cu).
//
// Status (H100, 6a60f02): 0 failures over 5,005 fp16 examples; 43-50 TFLOP/s, 0.13-0.18x SDPA flash
// and 0.18-0.25x fa2_tc.cu (its default config). Predicted 35-50% of fa2_tc; measured about 20%: every K and V fragment
// load is an 8-way bank conflict (the 8 rows g of a fragment share a bank), V needs two 16-bit
// loads per register, and no copy overlaps a GEMM.
//
// Kernels
//   fa2_tc_naive_forward<T, D, BR, BC, WARPS, R, DROPOUT>   grid (ceil(Nq/BR), B*Hq), WARPS*32 threads.
// Envelope: D in {64, 128} (d <= D, a multiple of 8, zero-filled), BR / WARPS a multiple of 16, BC a
// multiple of 16, rows 16-byte aligned (the copies move 16 bytes).
#include "tc_softmax.cuh"

// ---- device helpers

// Rows [row0, row0 + ROWS) of a [N, d] 16-bit matrix into a plain [ROWS][D] tile; rows >= N and
// 16-byte chunks >= d / 8 are zero-filled.
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile_sync(T* dst, const T* __restrict__ src, long long srow, int row0, int N,
                                               int dchunks) {
    constexpr int CH = D / 8;
    for (int e = threadIdx.x; e < ROWS * CH; e += THREADS) {
        const int r = e / CH, c = e % CH;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (row0 + r < N && c < dchunks) x = *reinterpret_cast<const uint4*>(src + (long long)(row0 + r) * srow + c * 8);
        *reinterpret_cast<uint4*>(dst + r * D + c * 8) = x;
    }
}

// Elements (r, c) and (r, c + 1) of a [*][D] tile as one 32-bit word (c even).
template <typename T, int D>
__device__ __forceinline__ unsigned ld_pair(const T* tile, int r, int c) {
    return *reinterpret_cast<const unsigned*>(tile + r * D + c);
}

// Elements (r, c) and (r + 1, c) packed low / high (V's B fragments pair along keys).
template <typename T, int D>
__device__ __forceinline__ unsigned ld_col_pair(const T* tile, int r, int c) {
    const unsigned short* u = reinterpret_cast<const unsigned short*>(tile);
    return unsigned(u[r * D + c]) | (unsigned(u[(r + 1) * D + c]) << 16);
}

// ---- kernels

template <typename T, int D, int BR, int BC, int WARPS, int R, bool DROPOUT>
__global__ void __launch_bounds__(WARPS * 32)
fa2_tc_naive_forward(const T* __restrict__ Q, long long q_sb, long long q_sh, long long q_sm,  // [B, Hq, Nq, d]
                     const T* __restrict__ K, long long k_sb, long long k_sh, long long k_sm,  // [B, Hkv, Nk, d]
                     const T* __restrict__ V, long long v_sb, long long v_sh, long long v_sm,  // [B, Hkv, Nk, d]
                     T* __restrict__ O,                        // [B, Hq, Nq, d] contiguous
                     float* __restrict__ LSE,                  // [B, Hq, Nq]
                     const signed char* __restrict__ tiles,    // [tile_heads, ceil(Nq/BR), ceil(Nk/BC)]
                     int tile_heads, int Hq, int group, int Nq, int Nk, int d,
                     float scale_log2,                         // scale * log2(e) > 0 (the host negates K for scale < 0)
                     MASK_PARAMS, DROPOUT_PARAMS) {
    constexpr int THREADS = WARPS * 32;
    constexpr int RW = BR / WARPS;      // query rows per warp
    constexpr int MT = RW / 16;         // m16 slices per warp
    constexpr int NT = BC / 8;          // n8 tiles of S
    constexpr int ND = D / 8;           // n8 tiles of O
    static_assert(D == 64 || D == 128, "head dim padded to 64 or 128");
    static_assert(RW % 16 == 0 && BC % 16 == 0, "each warp needs 16k query rows; BC a multiple of 16");
    extern __shared__ __align__(16) uint4 smem_u4[];
    T* sQ = reinterpret_cast<T*>(smem_u4);   // [BR][D]
    T* sK = sQ + BR * D;                      // [BC][D]
    T* sV = sK + BC * D;                      // [BC][D]

    const Mask mask = MASK_FROM_PARAMS;
    const Dropout drop = DROPOUT_FROM_PARAMS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int tr = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / group;
    const int row0 = tr * BR, wrow = warp * RW, nTc = (Nk + BC - 1) / BC, dch = d / 8;
    const T* Kb = K + b * k_sb + hk * k_sh;
    const T* Vb = V + b * v_sb + hk * v_sh;
    const signed char* trow = tiles + ((long long)(tile_heads == 1 ? 0 : h) * gridDim.x + tr) * nTc;
    int t0, t1;
    band_tiles(row0, min(row0 + BR, Nq) - 1, band_lo, band_hi, Nk, BC, t0, t1);

    load_tile_sync<T, BR, D, THREADS>(sQ, Q + b * q_sb + h * q_sh, q_sm, row0, Nq, dch);

    float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    for (int t = t0; t <= t1; ++t) {
        const int cls = trow[t], col0 = t * BC;
        if (cls == TILE_EMPTY) continue;
        __syncthreads();                              // every warp is done with the previous K and V
        load_tile_sync<T, BC, D, THREADS>(sK, Kb, k_sm, col0, Nk, dch);
        load_tile_sync<T, BC, D, THREADS>(sV, Vb, v_sm, col0, Nk, dch);
        __syncthreads();

        // S = Q K_t^T: A = Q rows (pairs along d), B = K rows (pairs along d)
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int c = kk * 16 + 2 * tq;
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = wrow + mt * 16 + g;
                a[mt][0] = ld_pair<T, D>(sQ, r, c);
                a[mt][1] = ld_pair<T, D>(sQ, r + 8, c);
                a[mt][2] = ld_pair<T, D>(sQ, r, c + 8);
                a[mt][3] = ld_pair<T, D>(sQ, r + 8, c + 8);
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const unsigned bk[2] = {ld_pair<T, D>(sK, n * 8 + g, c), ld_pair<T, D>(sK, n * 8 + g, c + 8)};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_16816<T>(s[mt][n], a[mt], bk);
            }
        }

        if (cls != TILE_FULL || col0 + BC > Nk) mask_scores(s, cls, mask, h, row0 + wrow, col0, Nq, Nk, g, tq);
        online_softmax<DROPOUT>(s, m, l, o, scale_log2);
        if (DROPOUT) apply_dropout<R>(s, drop, bh, row0 + wrow, col0, g, tq);

        // O += P V_t: P from registers, B = V (pairs along keys, two 16-bit loads each)
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            unsigned pa[MT][4];
            p_fragments<T>(pa, s, kk);
            const int r = kk * 16 + 2 * tq;
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                const unsigned bv[2] = {ld_col_pair<T, D>(sV, r, n * 8 + g), ld_col_pair<T, D>(sV, r + 8, n * 8 + g)};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_16816<T>(o[mt][n], pa[mt], bv);
            }
        }
    }

    write_output<T>(o, m, l, O, LSE, bh, row0 + wrow, Nq, d, g, tq);
}
