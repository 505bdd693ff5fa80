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
//   mask_tiles<THREADS>   grid (ceil(Nk / Bc), ceil(Nq / Br), Bm * Hm), THREADS threads; block (tc, tr, z) classes
//       tile (tr, tc) of table row z = bm * Hm + hm, the predicate seen at batch entry bm and head hm (Bm = 1:
//       the predicate does not depend on the batch entry, so b = 0 stands for every one; Hm likewise).
//       Every in-range element (i < Nq, j < Nk) is tested: mask_mod (a buffer indexed by i or j is never read
//       out of range), band and block layout. Columns past Nk count as visible for FULL and invisible for EMPTY,
//       rows past Nq not at all: the host's rule (masks._tile_row_classes). A partial tile whose elements
//       mask_mod all sees is TILE_BAND (tiles.cuh: the forwards test the band alone there). __syncthreads_or /
//       _and reduce the block's flags.
// The host side: sandbox/mask_tiles.py (launch, cache, the table's extent from the modifier's NumPy form).
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
    const int tc = blockIdx.x, tr = blockIdx.y, z = blockIdx.z;
    const int b = z / tile_heads, h = z % tile_heads;
    const Mask mask = MASK_FROM_PARAMS;
    const int r0 = tr * BR, c0 = tc * BC;
    const int rows = min(BR, Nq - r0), cols = min(BC, Nk - c0);
    int some = 0, every = 1, mod_every = 1;
    for (int e = threadIdx.x; e < rows * cols; e += THREADS) {
        const int i = r0 + e / cols, j = c0 + e % cols;
        const bool m = mask_mod(b, h, i, j FA_MM_ARGS);
        const bool v = m && mask.visible(h, i, j);
        some |= v;
        every &= v;
        mod_every &= m;
    }
    some = __syncthreads_or(some);
    every = __syncthreads_and(every);
    mod_every = __syncthreads_and(mod_every);
    if (threadIdx.x == 0)
        out[((long long)z * n_row_tiles + tr) * n_col_tiles + tc] =
            !some ? TILE_EMPTY : every ? TILE_FULL : mod_every ? TILE_BAND : TILE_PARTIAL;
}
