// hopper.cuh: what the Hopper rungs (sm_90a) add to the tensor-core tier: shared-memory matrix
// descriptors for wgmma, the wgmma fences, the async-proxy fence, and tiles laid out in the
// 128-byte-swizzled canonical form that wgmma reads.
//
// Layout of a [ROWS][D] 16-bit tile (D a multiple of 64): D / 64 column panels, each [ROWS][64]
// (128 bytes a row), panel p at p * ROWS * 128 bytes; inside a panel, 16-byte chunk c of row r lives
// at chunk c ^ (r % 8). With panels 1024-byte aligned that is exactly the hardware's 128-byte swizzle
// (address bits 4-6 XOR bits 7-9), so one layout serves
//   K-major operands (Q as A, K as B of S = Q K^T: the GEMM's k runs along a row): rows 8 at a time
//       1024 bytes apart (the stride byte offset), a k16 step 32 bytes further in the row, the next
//       panel after four steps;
//   an MN-major operand (V as B of O += P V with the transpose bit: n runs along a row): k (keys)
//       8 rows at a time 1024 bytes apart, n 64 columns at a time one panel apart (the leading byte
//       offset), a k16 step 16 rows (2048 bytes) further.
// (PTX ISA "Matrix Descriptor Format" and "Shared Memory Matrix Layout"; FA3 paper Sec. 3 keeps the
// same operand placement: Q, K, V in shared memory, P in registers as the A operand.)
#pragma once
#include "mma.cuh"
#include "tc_softmax.cuh"
#include "wgmma_ops.cuh"

// ---- descriptors and fences

// A wgmma shared-memory matrix descriptor: start address, leading and stride byte offsets (all in
// 16-byte units, 14 bits each), base offset 0 (panels are 1024-byte aligned), swizzle mode 1 (128 B).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_byte_addr, unsigned lbo_bytes,
                                                         unsigned sbo_bytes) {
    return (unsigned long long)((smem_byte_addr & 0x3FFFF) >> 4) |
           ((unsigned long long)((lbo_bytes & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// wgmma_desc(a + off, lbo, sbo) from wgmma_desc(a, lbo, sbo), for a 16-byte multiple off: the address field is
// (a & 0x3FFFF) >> 4 in the low 14 bits, and a shared-memory address stays below 2^18 (at most 227 KB a block plus
// the 1 KB the system reserves on sm_90), so adding off >> 4 to the low word never carries out of the field (off must
// be a multiple of 16: its low 4 bits are dropped): one add per wgmma instead of the mask, shift and merge
// of wgmma_desc on the uniform datapath (a dependent chain in front of every wgmma of a GEMM: Nsight Compute's
// stall sampling put ~9% of fa3's forward warp time there at d = 64; bench/results/h100/2026-11-27-session-22.md).
__device__ __forceinline__ unsigned long long wgmma_desc_at(unsigned long long desc, unsigned off_bytes) {
    return desc + (off_bytes >> 4);
}

// Before a warpgroup's first wgmma of a batch: its accumulator and A registers were written by
// ordinary instructions (the softmax rescale, P) and must be visible to the async tensor cores.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// Shared memory written through the generic proxy (cp.async, ordinary stores) and read next by
// wgmma (the async proxy): each writing thread fences before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keep the compiler from moving accumulator reads or writes across an in-flight wgmma.
template <int NT>
__device__ __forceinline__ void fence_accumulators(float (&d)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e]) :: "memory");
}

// ---- tiles

// Rows [row0, row0 + ROWS) of a [N, d] 16-bit matrix (row stride srow, unit stride along d) into
// the panelled, swizzled [ROWS][D] tile at `dst`, asynchronously; rows >= N and chunks >= d / 8 are
// zero-filled. Where THREADS is a multiple of 8 D / 8 (D = 64, 128; D = 256 with 256 threads), thread i
// copies chunk column i % (D / 8) of every (THREADS / (D / 8))-th row; otherwise (D = 192, or D = 256 with
// 128 threads) the copy goes panel by panel, thread i taking chunk i % 8 of every (THREADS / 8)-th row of
// each. Either way a thread's row % 8, hence its swizzled offset, is the same in every step.
template <int ROWS, int D, int THREADS, typename T>
__device__ __forceinline__ void load_panels_async(unsigned dst, const T* __restrict__ src, long long srow,
                                                  int row0, int N, int dchunks) {
    constexpr int CH = D / 8;
    static_assert(D % 64 == 0 && THREADS % 64 == 0, "64-column panels, 8 chunk columns each");
    if constexpr (THREADS % CH == 0 && (THREADS / CH) % 8 == 0) {
        constexpr int STEP = THREADS / CH;
        const int c = threadIdx.x % CH, r = threadIdx.x / CH;
        const bool col_in = c < dchunks;
        const T* g = src + (long long)(row0 + r) * srow + c * 8;
        const unsigned s = dst + (c / 8) * ROWS * 128 + r * 128 + (((c % 8) ^ (r % 8)) << 4);
#pragma unroll
        for (int it = 0; it < (ROWS + STEP - 1) / STEP; ++it) {
            if (ROWS % STEP != 0 && r + it * STEP >= ROWS) break;
            const bool in = col_in && row0 + r + it * STEP < N;
            cp_async_16(s + it * STEP * 128, in ? g : src, in ? 16 : 0);
            g += STEP * srow;
        }
    } else {
        constexpr int STEP = THREADS / 8;
        const int c = threadIdx.x % 8, r = threadIdx.x / 8;
#pragma unroll
        for (int p = 0; p < D / 64; ++p) {
            const bool col_in = p * 8 + c < dchunks;
            const T* g = src + (long long)(row0 + r) * srow + p * 64 + c * 8;
            const unsigned s = dst + p * ROWS * 128 + r * 128 + ((c ^ (r % 8)) << 4);
#pragma unroll
            for (int it = 0; it < (ROWS + STEP - 1) / STEP; ++it) {
                if (ROWS % STEP != 0 && r + it * STEP >= ROWS) break;
                const bool in = col_in && row0 + r + it * STEP < N;
                cp_async_16(s + it * STEP * 128, in ? g : src, in ? 16 : 0);
                g += STEP * srow;
            }
        }
    }
}

// ---- the two GEMMs of one warpgroup (issued, committed; the caller waits)

// s = Q_wg K^T: A = the warpgroup's 64 rows of the Q tile (at q_rows, panel stride QROWS * 128), B = the
// BC keys of the K tile (K-major both); s is overwritten (the first k-step does not accumulate), or with
// SEEDED added to (tc_mods.cuh seed_scores: a distance bias where the accumulator starts).
template <typename T, int D, int BC, int QROWS, bool SEEDED = false>
__device__ __forceinline__ void wg_gemm_qk(float (&s)[BC / 8][4], unsigned q_rows, unsigned k_tile) {
    const unsigned long long da0 = wgmma_desc(q_rows, 16, 1024), db0 = wgmma_desc(k_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned off = (kk % 4) * 32;                 // bytes into the 128-byte row
        Wgmma<T, BC, false>::ss(s, wgmma_desc_at(da0, (kk / 4) * QROWS * 128 + off),
                                wgmma_desc_at(db0, (kk / 4) * BC * 128 + off), SEEDED || kk > 0);
    }
}

// o += P V: A = P from registers (pa[kk]: keys 16 kk .. 16 kk + 15 of the warp's 16 rows), B = the
// BC x D V tile, MN-major (the transpose bit): a k16 step is 16 rows, 2048 bytes; panels BC * 128 apart.
template <typename T, int D, int BC>
__device__ __forceinline__ void wg_gemm_pv(float (&o)[D / 8][4], const unsigned (&pa)[BC / 16][4], unsigned v_tile) {
    const unsigned long long db0 = wgmma_desc(v_tile, BC * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
        Wgmma<T, D, true>::rs(o, pa[kk], wgmma_desc_at(db0, kk * 2048), 1);
}

// o += P V with P from shared memory (fa3_ws.cu FA_P_SMEM): A = the warpgroup's 64 rows of P at p_rows, laid out as
// a [64][BC] tile of this header (BC / 64 panels 64 * 128 bytes apart; K-major, as Q in wg_gemm_qk), B as in
// wg_gemm_pv. The same products as the register form: P is the same 16-bit values, only where they are read from.
template <typename T, int D, int BC>
__device__ __forceinline__ void wg_gemm_pv_ss(float (&o)[D / 8][4], unsigned p_rows, unsigned v_tile) {
    static_assert(BC % 64 == 0, "P from shared memory: whole 64-key panels");
    const unsigned long long da0 = wgmma_desc(p_rows, 16, 1024), db0 = wgmma_desc(v_tile, BC * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
        Wgmma<T, D, true>::ss(o, wgmma_desc_at(da0, (kk / 4) * 64 * 128 + (kk % 4) * 32),
                              wgmma_desc_at(db0, kk * 2048), 1);
}

// Four 8 x 8 16-bit matrices from the warp's registers into shared memory (stmatrix, sm_90): lane l holds row
// l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i in r[i]; lanes 8 i .. 8 i + 7 give the addresses of
// matrix i's rows (16 bytes each, 16-byte aligned).
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// The warp's 16 rows of P (fp32 scores after the softmax, rounded to T as p_operands rounds them) into the
// warpgroup's [64][BC] P tile at p_rows (wg_gemm_pv_ss's A), rows wrow .. wrow + 15. One stmatrix.x4 per 16 keys:
// its four matrices are p_fragments' four registers (rows 0-7 / 8-15 by keys 0-7 / 8-15 of the k16 step), lane l
// addressing row wrow + l % 8 + 8 ((l / 8) % 2), keys 16 kk + 8 (l / 16). Row r's 16-byte chunk c lands at chunk
// c ^ (r % 8) (the 128-byte swizzle): the eight rows of one matrix hit eight different chunks, no bank conflict.
// The caller fences (the wgmma reads through the async proxy) and syncs the warp before the GEMM (each warp's
// rows of P feed its own rows of O).
template <typename T, int NT>
__device__ __forceinline__ void store_p(unsigned p_rows, const float (&s)[1][NT][4], int wrow, int lane) {
    static_assert(NT % 8 == 0, "P from shared memory: whole 64-key panels");
    const int r = wrow + lane % 8 + 8 * ((lane / 8) % 2);
    const unsigned row_at = p_rows + r * 128, sw = r % 8;
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        unsigned frag[1][4];
        p_fragments<T>(frag, s, kk);
        const int chunk = 2 * kk + lane / 16;            // 16-byte chunk of 8 keys along the row
        stmatrix_x4(row_at + (chunk / 8) * 64 * 128 + (((chunk % 8) ^ sw) << 4), frag[0]);
    }
}

// ---- a consumer warpgroup's softmax state

// O = 0, m = -inf, l = 0 for the warp's 16 rows (one m16 slice: the wgmma accumulator layout).
template <int ND>
__device__ __forceinline__ void zero_state(float (&o)[1][ND][4], float (&m)[1][2], float (&l)[1][2]) {
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[0][n][e] = 0.0f;
    m[0][0] = m[0][1] = NEG_INF;
    l[0][0] = l[0][1] = 0.0f;
}

// P (fp32 scores after the softmax) as the A operands of O += P V: pa[kk] holds keys 16 kk .. 16 kk + 15.
template <typename T, int NT>
__device__ __forceinline__ void p_operands(unsigned (&pa)[NT / 2][4], const float (&s)[1][NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        unsigned frag[1][4];
        p_fragments<T>(frag, s, kk);
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[kk][e] = frag[0][e];
    }
}

// ---- TMA, mbarriers, register reallocation (the warp-specialized rungs: fa3_ws.cu)

// A CUtensorMap as the kernel sees it: 128 opaque bytes, built on the host by cuTensorMapEncodeTiled
// and passed by value as a __grid_constant__ parameter (NVRTC has no cuda.h, hence this stand-in of
// the same size and alignment).
struct __align__(64) TmaDesc {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Make barrier initialisation visible to the async proxy (TMA completes on these barriers).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` of TMA traffic the phase must see land.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed (phases alternate 0, 1, 0, ...).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n"
                 "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// A box of a 4-D tensor (coordinates innermost first) into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDesc& map, unsigned bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(bar) : "memory");
}

// `bytes` (a multiple of 16) of global memory at `src` (16-byte aligned) into shared memory at `dst` (16-byte
// aligned), one bulk copy completing on `bar` (cp.async.bulk, PTX ISA 8.0, sm_90).
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Move registers between warpgroups (sm_90a): the producer gives up, the consumers take.
template <int N>
__device__ __forceinline__ void regs_release() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void regs_claim() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N)); }

// Named barriers (ids 1..15; 0 is __syncthreads'): `sync` waits until `threads` threads have reached the
// barrier (arrivals included), `arrive` counts without waiting. Ping-pong scheduling of two consumer
// warpgroups (FA3 paper Sec. 3.1) is one sync on its own barrier and one arrive on the other's.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// ---- bulk reductions into global memory (fa3_bwd2.cu's dQ)

// dst[0 .. bytes / 4) += the fp32 words at shared address `src`, element-wise, by the copy engine
// (cp.reduce.async.bulk, PTX ISA 8.0, sm_90): both addresses 16-byte aligned, bytes a multiple of 16.
// Shared memory written by ordinary stores needs fence_proxy_async() (and the barrier that publishes
// it) before; the issuing thread tracks completion with its bulk groups.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's bulk groups are still reading their shared memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory"); }
// Wait until at most N of this thread's bulk groups are incomplete (writes included).
template <int N>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory"); }
