// philox.cuh: Philox4x32-R counter-based RNG and the dropout keep decision (docs/ARCHITECTURE.md "Dropout and the RNG contract").
//
// Salmon et al., SC'11 (Random123); R = 10 is the standard generator (cuRAND's Philox), R = 7 is
// the cheaper one flash-attn uses. Bit-identical to sandbox/philox.py and the Numba device
// function; tests/test_gpu_rng.py checks it against NumPy on the GPU, known-answer vectors included.
//
// Counter layout: element (b, h, i, j) of a (B, H, Nq, Nk) score matrix draws word j % 4 of
//   philox((j / 4, i, b * H + h, offset), (seed & 0xffffffff, seed >> 32))
// and is kept iff that word >= floor(p * 2^32). Block sizes and warp layout never enter.
#pragma once

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u   // golden ratio
#define PHILOX_W1 0xBB67AE85u   // sqrt(3) - 1

// ---- device helpers

template <int ROUNDS>
__device__ __forceinline__ uint4 philox4x32(uint4 c, uint2 k) {
    static_assert(ROUNDS == 7 || ROUNDS == 10, "Philox rounds: 10 (contract) or 7 (flash-attn)");
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        if (r) { k.x += PHILOX_W0; k.y += PHILOX_W1; }
        const unsigned hi0 = __umulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
        const unsigned hi1 = __umulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// Dropout parameters as one kernel-argument bundle of plain scalars.
struct Dropout {
    unsigned threshold;        // floor(p * 2^32); 0 = dropout off
    float inv_keep;            // 1 / (1 - p)
    unsigned long long seed;
    unsigned offset;
};

// The four keep words of columns 4*j4 .. 4*j4+3 of row i of head bh = b * H + h.
template <int ROUNDS>
__device__ __forceinline__ uint4 dropout_words(const Dropout& dp, int bh, int i, int j4) {
    return philox4x32<ROUNDS>(make_uint4((unsigned)j4, (unsigned)i, (unsigned)bh, dp.offset),
                              make_uint2((unsigned)(dp.seed & 0xffffffffull), (unsigned)(dp.seed >> 32)));
}

__device__ __forceinline__ unsigned word_of(const uint4& w, int t) {
    return t == 0 ? w.x : t == 1 ? w.y : t == 2 ? w.z : w.w;
}

// Scale factor for one element: 0 if dropped, 1 / (1 - p) if kept (1 when dropout is off).
__device__ __forceinline__ float dropout_factor(const Dropout& dp, unsigned word) {
    return dp.threshold == 0u ? 1.0f : (word >= dp.threshold ? dp.inv_keep : 0.0f);
}
