// mask_tiles.cu: a mask modifier's tile classes, evaluated on the GPU (issue 18 item 2: "the block-level
// visibility is derived from it, evaluated on the GPU once per mask, cached").
//
// The tiled kernels walk a table of tile classes (tiles.cuh: EMPTY tiles are never loaded, FULL ones run no
// predicate, PARTIAL ones the element predicate). With a mask modifier the class of a tile is that of
// band AND block mask AND mask_mod over its elements: sandbox/masks.py classify_tiles_mod computes it on the host
// from the modifier's NumPy form, one pass over the score matrix in NumPy (3.6 s for a document mask at
// N = 32k, 5.9 s for a (4, 1, 4k, 4k) dense mask on this repository's CI machine), which a training loop with a
// new mask per batch would pay per step. This kernel computes the same table from the modifier's CUDA form.
//
// Kernel
//   mask_tiles<THREADS>   grid (ceil(Nk / Bc) * Bm * Hm, ceil(Nq / Br)), THREADS threads; block (x, tr) classes
//       tile (tr, tc = x % n_col_tiles) of table row z = x / n_col_tiles = bm * Hm + hm (x, not z: Bm * Hm may
//       pass the 65535 blocks of grid z), the predicate seen at batch entry bm and head hm (Bm = 1: the predicate
//       does not depend on the batch entry, so b = 0 stands for every one; Hm likewise).
//       Every in-range element (i < Nq, j < Nk) is tested: band and block layout, then mask_mod where they show
//       it, as the forwards test it (a buffer indexed by i or j is never read out of range, nor a table indexed
//       by i - j outside the band). Columns past Nk count as visible for FULL and invisible for EMPTY, rows
//       past Nq not at all: the host's rule (masks._tile_row_classes). A partial tile where mask_mod is true
//       wherever the band and block layout show is TILE_BAND (tiles.cuh: the forwards test the band alone
//       there); else one where it shows exactly j - i <= Nk - Nq of what they show is TILE_CAUSAL (the forwards
//       test that compare instead). A warp reduction and a shared atomicOr reduce the block's flags.
// The host side: variants/mask_tiles.py (launch, cache, the table's extent from the modifier's NumPy form).
#include "common.cuh"
#include "tiles.cuh"

#ifndef FA_MM_PARAMS             // a mask modifier without buffers
#define FA_MM_PARAMS
#define FA_MM_ARGS
#endif
FA_MOD_FUNCS

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
mask_tiles(signed char* __restrict__ out, int tile_heads, int Nq, int Nk, int BR, int BC, int n_row_tiles,
           int n_col_tiles, MASK_PARAMS FA_MM_PARAMS) {
    const int tc = blockIdx.x % n_col_tiles, tr = blockIdx.y, z = blockIdx.x / n_col_tiles;
    const int b = z / tile_heads, h = z % tile_heads;
    const Mask mask = MASK_FROM_PARAMS;
    const int r0 = tr * BR, c0 = tc * BC;
    const int rows = min(BR, Nq - r0), cols = min(BC, Nk - c0);
    // flags, set where some element says so: SOME visible, NOT_EVERY visible, MOD_HIDES (the predicate hides
    // something the band shows), NOT_CAUSAL (it differs from bottom-right causal where the band shows); one int
    // reduced by warp then through shared memory (four __syncthreads_or / _and spilled 8 bytes under NVRTC 13)
    enum { SOME = 1, NOT_EVERY = 2, MOD_HIDES = 4, NOT_CAUSAL = 8 };
    __shared__ int block_flags;
    if (threadIdx.x == 0) block_flags = 0;
    int flags = 0;
    for (int e = threadIdx.x; e < rows * cols; e += THREADS) {
        const int i = r0 + e / cols, j = c0 + e % cols;
        const bool shown = mask.visible(h, i, j);
        const bool v = shown && mask_mod(b, h, i, j FA_MM_ARGS);
        flags |= (v ? SOME : NOT_EVERY) | (v != shown ? MOD_HIDES : 0) |
                 (v != (shown && j - i <= Nk - Nq) ? NOT_CAUSAL : 0);
    }
    flags = __reduce_or_sync(0xffffffffu, flags);
    __syncthreads();
    if ((threadIdx.x & 31) == 0 && flags) atomicOr(&block_flags, flags);
    __syncthreads();
    if (threadIdx.x == 0)
        out[((long long)z * n_row_tiles + tr) * n_col_tiles + tc] =
            !(block_flags & SOME) ? TILE_EMPTY : !(block_flags & NOT_EVERY) ? TILE_FULL
            : !(block_flags & MOD_HIDES) ? TILE_BAND : !(block_flags & NOT_CAUSAL) ? TILE_CAUSAL : TILE_PARTIAL;
}
