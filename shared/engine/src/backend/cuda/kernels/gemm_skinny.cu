// Skinny GEMM on the tensor cores: out[r, n] = Σ_k x[r, k] · w[n, k] for m ≤ 16 rows (decode
// steps of 3–8 sequences in bf16x2: their stacked hi and lo rows; of 3–16 in bf16), 16-bit x
// and w, f32 accumulation and output. Such a step is bound by reading the weights once;
// cuBLAS's tiled kernels leave most SMs idle at these shapes and gemv.cu's CUDA-core GEMVs
// spend an FMA per row on every weight element. Here the weights stream from global memory
// straight into mma.sync's B fragments, never through shared memory: the k order inside each
// 32-element chunk is permuted identically for x and w (a sum does not care), so each lane
// reads 16 contiguous bytes of its weight row per chunk — x's rows are read the same way, L2-
// or L1-resident. A block owns 8 · NT output columns; its SG_WARPS warps each take one slice
// of k, and their partial tiles meet in shared memory. k must be a multiple of 32 · SG_WARPS.
#define SG_WARPS 8

// Lane (g = lane / 4, q = lane % 4) of an m16n8k16 MMA: with chunk elements q·8 .. q·8 + 7
// loaded as one uint4 per row, step 0 takes elements 0–3 as k = 2q, 2q + 1, 2q + 8, 2q + 9 and
// step 1 takes elements 4–7 the same way: the A pairs {row g, row g + 8} and the B pair of
// column g then hold matching k in both steps.
template <int MT, int NT>
__device__ __forceinline__ void skinny_chunk(float (&acc)[MT][NT][4], const uint4 (&wv)[NT], const e16_t* x,
                                             int m, int k, int kc) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r0 = mt * 16 + g, r1 = r0 + 8;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const uint4 xa = r0 < m ? __ldg(reinterpret_cast<const uint4*>(x + (long long)r0 * k + kc) + q) : zero;
        const uint4 xb = r1 < m ? __ldg(reinterpret_cast<const uint4*>(x + (long long)r1 * k + kc) + q) : zero;
        const unsigned a0[4] = {xa.x, xb.x, xa.y, xb.y};
        const unsigned a1[4] = {xa.z, xb.z, xa.w, xb.w};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            mma_16816(acc[mt][t], a0, wv[t].x, wv[t].y);
            mma_16816(acc[mt][t], a1, wv[t].z, wv[t].w);
        }
    }
}

// A run of U chunks from chunk c: the NT weight rows' loads first, then the math. Runs of 8,
// then 4, then single chunks: a warp's slice of k = 1024 or 2048 is one run, so it waits on
// DRAM once (3072, the down projection: twice).
template <int NT, int U>
__device__ __forceinline__ void skinny_load(uint4 (&wv)[U][NT], const uint4* const (&wr)[NT], int c) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int t = 0; t < NT; ++t) wv[u][t] = __ldg(wr[t] + 4 * (c + u));
}

template <int MT, int NT, int U>
__device__ __forceinline__ void skinny_math(float (&acc)[MT][NT][4], const uint4 (&wv)[U][NT], const e16_t* x,
                                            int m, int k, int k0, int c) {
#pragma unroll
    for (int u = 0; u < U; ++u) skinny_chunk<MT, NT>(acc, wv[u], x, m, k, k0 + 32 * (c + u));
}

template <int MT, int NT, int U>
__device__ __forceinline__ void skinny_run(float (&acc)[MT][NT][4], const uint4* const (&wr)[NT], const e16_t* x,
                                           int m, int k, int k0, int c) {
    uint4 wv[U][NT];
    skinny_load<NT, U>(wv, wr, c);
    skinny_math<MT, NT, U>(acc, wv, x, m, k, k0, c);
}

// The first run's weights (which no earlier kernel writes) are loaded before the PDL wait, so
// their DRAM latency overlaps the previous kernel's tail: measured on an H100, loading them
// after it was 30% slower at 16 rows (batch 8 of bf16x2: 3,570 against 5,110 tok/s).
template <int MT, int NT, int U>
__device__ __forceinline__ int skinny_first_run(float (&acc)[MT][NT][4], const uint4* const (&wr)[NT],
                                                const e16_t* x, int m, int k, int k0) {
    uint4 wv[U][NT];
    skinny_load<NT, U>(wv, wr, 0);
    GRID_DEPENDENCY_SYNC();
    skinny_math<MT, NT, U>(acc, wv, x, m, k, k0, 0);
    return U;
}

// MT 16-row tiles of x (one in the instances: two measured slower than cuBLAS at 32 rows, their
// x reads doubling while the weights stay the same).
template <int MT, int NT>
__device__ void gemm_skinny_impl(float* out, const e16_t* x, const e16_t* w, int m, int n, int k) {
    __shared__ float red[SG_WARPS][MT * NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * 8 * NT;
    const int kw = k / SG_WARPS;  // this warp's slice of k
    const int k0 = warp * kw;
    const uint4* wr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        // A column past n reads the last row (in bounds) and is never stored.
        const int col = min(n0 + t * 8 + g, n - 1);
        wr[t] = reinterpret_cast<const uint4*>(w + (long long)col * k + k0) + q;
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][t][e] = 0.0f;
    const int chunks = kw >> 5;  // at least 1 (k is a multiple of 32 · SG_WARPS)
    int c;
    if (chunks >= 8) {
        c = skinny_first_run<MT, NT, 8>(acc, wr, x, m, k, k0);
    } else if (chunks >= 4) {
        c = skinny_first_run<MT, NT, 4>(acc, wr, x, m, k, k0);
    } else {
        c = skinny_first_run<MT, NT, 1>(acc, wr, x, m, k, k0);
    }
    for (; c + 8 <= chunks; c += 8) skinny_run<MT, NT, 8>(acc, wr, x, m, k, k0, c);
    for (; c + 4 <= chunks; c += 4) skinny_run<MT, NT, 4>(acc, wr, x, m, k, k0, c);
    for (; c < chunks; ++c) skinny_run<MT, NT, 1>(acc, wr, x, m, k, k0, c);
    // The warps' partial tiles meet in shared memory; then each thread sums some outputs.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[warp][(mt * NT + t) * 4 + e][lane] = acc[mt][t][e];
    __syncthreads();
    for (int i = threadIdx.x; i < MT * NT * 4 * 32; i += blockDim.x) {
        const int idx = i >> 5, l = i & 31;
        float s = 0.0f;
#pragma unroll
        for (int v = 0; v < SG_WARPS; ++v) s += red[v][idx][l];
        const int mt = idx / (NT * 4), t = (idx >> 2) % NT, e = idx & 3;
        const int row = mt * 16 + (l >> 2) + (e >= 2 ? 8 : 0);
        const int col = n0 + t * 8 + 2 * (l & 3) + (e & 1);
        if (row < m && col < n) out[(long long)row * n + col] = s;
    }
}

#define GEMM_SKINNY(NAME, NT)                                                                          \
    extern "C" __global__ void __launch_bounds__(SG_WARPS * 32)                                         \
        NAME(float* out, const e16_t* x, const e16_t* w, int m, int n, int k) {                        \
        gemm_skinny_impl<1, NT>(out, x, w, m, n, k);                                                   \
    }

GEMM_SKINNY(gemm_skinny_n8, 1)
GEMM_SKINNY(gemm_skinny_n16, 2)
