// tiles.cuh: what every tiled kernel (exact and tensor-core tier) shares about the host's tile
// table and the band: the tile classes of sandbox/masks.py and the tile ranges a band can see.
#pragma once

#define TILE_EMPTY 0      // nothing visible: skipped, never loaded
#define TILE_FULL 1       // everything visible (for j < Nk): no per-element mask
#define TILE_PARTIAL 2    // some visible: the element predicate is applied
#define TILE_BAND 3       // partial under the band / block mask, while a mask modifier sees all of it: the
                          // forwards with modifiers (tc_mods.cuh mod_scores) and fa3_bwd2 test the band only;
                          // every other reader takes it as PARTIAL
#define TILE_CAUSAL 4     // partial, and the mask modifier shows exactly the bottom-right causal part of what the
                          // band / block mask show (j - i <= Nk - Nq): a model's causal mask given as a dense mask
                          // (sandbox/torch.py). The forwards with modifiers test the band and that compare, not
                          // the predicate; every other reader (fa3_bwd2 included: tried, slower) takes it as PARTIAL

// ---- device helpers

// Column-tile range [t0, t1] that rows [r0, r1] can see under the band lo <= j - i <= hi.
__device__ __forceinline__ void band_tiles(int r0, int r1, int lo, int hi, int Nk, int BCOLS, int& t0, int& t1) {
    const long long jlo = max(0LL, (long long)r0 + lo), jhi = min((long long)Nk - 1, (long long)r1 + hi);
    t0 = (int)(jlo / BCOLS);
    t1 = jlo > jhi ? t0 - 1 : (int)(jhi / BCOLS);
}

// Row-tile range [t0, t1] that can see columns [c0, c1].
__device__ __forceinline__ void band_row_tiles(int c0, int c1, int lo, int hi, int Nq, int BROWS, int& t0, int& t1) {
    const long long ilo = max(0LL, (long long)c0 - hi), ihi = min((long long)Nq - 1, (long long)c1 - lo);
    t0 = (int)(ilo / BROWS);
    t1 = ilo > ihi ? t0 - 1 : (int)(ihi / BROWS);
}

// The first tile t' in [t, t1] whose class (at cls[t' * stride]) is not EMPTY; t1 + 1 if none.
__device__ __forceinline__ int next_live_tile(const signed char* cls, int t, int t1, int stride = 1) {
    while (t <= t1 && cls[t * stride] == TILE_EMPTY) ++t;     // one head's table: int offsets
    return t;
}

// Warp-parallel scans for the runs of EMPTY tiles that a mask modifier leaves around the live ones (a document mask
// over a packed batch: the other sequences' tiles, sandbox/varlen.py's backward), where next_live_tile's serial
// scan costs a dependent load per skipped tile: 32 classes per step, one per lane, found by a ballot. Every lane of
// the warp calls them, with the same arguments (a warp-uniform call). cls(t): tile t's class, t0 <= t <= t1.
// The first live tile in [t0, t1], t1 + 1 if none (the forward's walk starts there: the earlier sequences' tiles).
template <typename Cls>
__device__ __forceinline__ int first_live_tile(Cls cls, int t0, int t1) {
    const int lane = threadIdx.x & 31;
    for (int t = t0; t <= t1; t += 32) {
        const unsigned live = __ballot_sync(0xffffffffu, t + lane <= t1 && cls(t + lane) != TILE_EMPTY);
        if (live) return t + __ffs(live) - 1;
    }
    return t1 + 1;
}
// The last live tile in [t0, t1], t0 - 1 if none (the backward's walk ends there: the later sequences' tiles).
template <typename Cls>
__device__ __forceinline__ int last_live_tile(Cls cls, int t0, int t1) {
    const int lane = threadIdx.x & 31;
    for (int t = t1; t >= t0; t -= 32) {
        const unsigned live = __ballot_sync(0xffffffffu, t - lane >= t0 && cls(t - lane) != TILE_EMPTY);
        if (live) return t - (__ffs(live) - 1);
    }
    return t0 - 1;
}
