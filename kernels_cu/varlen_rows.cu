// varlen_rows.cu: the inputs of packed self-attention's backward with its offsets on the GPU, in one launch
// (sandbox/varlen.py, _backward_document; issue 18 item 3).
//
// That backward runs the packed rows as one sequence under a document mask whose per-token ids come from the
// offsets cu[0..S] on the device (no wait for the stream). A row outside the offsets (before cu[0], from cu[S]),
// or one the forward left NaN (a sequence longer than max_seqlen_q), takes no part: its P is 0, but the GEMMs
// still multiply it by its values (0 x NaN = NaN, torch.empty padding) and would carry NaN into the other
// sequences' dK and dQ. So such rows are zeroed in copies of q, out, dout (query rows) and k, v (key rows), and
// their lse becomes -inf (a dead row: P = 0). One block per packed row does all of it: the row's ids by a
// binary search, the NaN test across its heads' lse, the lse copy, and the five row copies in vectors of V.
//
// Kernel
//   document_rows<I, V>   grid (n), THREADS threads; block r handles packed row r (q and k have n rows each).
//       I: the offsets' type (int or long long); V: the copy vector (uint4, uint2, unsigned or unsigned short:
//       the widest that divides a row's bytes and every pointer's alignment, chosen by the host).
//       q_ids[r] = s with cu[s] <= r < cu[s + 1], -1 before cu[0], S from cu[S]; k_ids[r] the same with -2 and
//       S + 1, so that a query and a key outside the offsets never share an id. Ids never decrease along the
//       rows (document(sorted_ids=True) relies on it). lse and lse_out are [H][n] float32 (flash-attn's varlen
//       layout); each x row holds qrow (query side) or krow (key side) vectors of V.
#include "common.cuh"

template <typename I>
__device__ __forceinline__ int document_id(const I* __restrict__ cu, int S, long long t, int before, int after) {
    if (t < (long long)cu[0]) return before;
    if (t >= (long long)cu[S]) return after;
    int lo = 1, hi = S;                            // the first p in [1, S] with cu[p] > t (cu[S] > t)
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if ((long long)cu[mid] > t) hi = mid; else lo = mid + 1;
    }
    return lo - 1;
}

template <typename V>
__device__ __forceinline__ void keep_or_zero(const V* __restrict__ x, V* __restrict__ y, long long vecs, bool keep) {
    if (keep) {
        for (long long c = threadIdx.x; c < vecs; c += blockDim.x) y[c] = x[c];
    } else {
        const V zero{};
        for (long long c = threadIdx.x; c < vecs; c += blockDim.x) y[c] = zero;
    }
}

template <typename I, typename V>
__global__ void document_rows(const I* __restrict__ cu, int S, const float* __restrict__ lse, int H, int n,
                              int* __restrict__ q_ids, int* __restrict__ k_ids, float* __restrict__ lse_out,
                              const V* __restrict__ q, const V* __restrict__ o, const V* __restrict__ dout,
                              V* __restrict__ q_out, V* __restrict__ o_out, V* __restrict__ dout_out, long long qrow,
                              const V* __restrict__ k, const V* __restrict__ v, V* __restrict__ k_out,
                              V* __restrict__ v_out, long long krow) {
    const long long r = blockIdx.x;
    const int qid = document_id(cu, S, r, -1, S), kid = document_id(cu, S, r, -2, S + 1);
    bool nan = false;
    for (int h = threadIdx.x; h < H; h += blockDim.x) nan |= isnan(lse[(long long)h * n + r]);
    const bool keep_q = !__syncthreads_or(nan) && qid >= 0 && qid < S, keep_k = kid >= 0 && kid < S;
    if (threadIdx.x == 0) {
        q_ids[r] = qid;
        k_ids[r] = kid;
    }
    for (int h = threadIdx.x; h < H; h += blockDim.x)
        lse_out[(long long)h * n + r] = keep_q ? lse[(long long)h * n + r] : NEG_INF;
    keep_or_zero(q + r * qrow, q_out + r * qrow, qrow, keep_q);
    keep_or_zero(o + r * qrow, o_out + r * qrow, qrow, keep_q);
    keep_or_zero(dout + r * qrow, dout_out + r * qrow, qrow, keep_q);
    keep_or_zero(k + r * krow, k_out + r * krow, krow, keep_k);
    keep_or_zero(v + r * krow, v_out + r * krow, krow, keep_k);
}
