// Skinny GEMM on the tensor cores: out[r, n] = Σ_k x[r, k] · w[n, k] for m ≤ 16 rows (decode
// steps of 1–16 sequences), 16-bit w, 16-bit x (bf16, or bf16x2's stacked hi and lo rows) or
// f32 x (bf16x2's rows, split into hi and lo in registers: two MMAs into one accumulator, the
// sum a fold of split halves would give), f32 accumulation and output. The norm forms
// (gemm_skinny_norm_*) normalise their rows first, as gemv.cu's gemv_norm_* do. Such a step is bound by reading the weights once;
// cuBLAS's tiled kernels leave most SMs idle at these shapes and gemv.cu's CUDA-core GEMVs
// spend an FMA per row on every weight element. Here the weights stream from global memory
// straight into mma.sync's B fragments, never through shared memory: the k order inside each
// 32-element chunk is permuted identically for x and w (a sum does not care), so each lane
// reads 16 contiguous bytes of its weight row per chunk — x's rows are read the same way, L2-
// or L1-resident. A block owns 8 · NT output columns; its SG_WARPS warps each take one slice
// of k, and their partial tiles meet in shared memory. k must be a multiple of 32 · SG_WARPS.
#define SG_WARPS 8

// A's rows: 16-bit (one MMA per k step) or f32 split into bf16 hi and lo (two). Row r's chunk
// elements q·8 .. q·8 + 7 at kc, zeros for rows past m; from global memory (G: through the
// read-only path) or from the block's normalised rows in shared memory.
template <typename X>
struct SkinnyRows;

template <>
struct SkinnyRows<e16_t> {
    static constexpr bool SPLIT = false;
    template <bool G>
    __device__ static __forceinline__ void load(const e16_t* x, int r, int m, int ld, int kc, int q, uint4& hi,
                                                uint4& lo) {
        hi = make_uint4(0, 0, 0, 0);
        if (r < m) {
            const uint4* p = reinterpret_cast<const uint4*>(x + (long long)r * ld + kc) + q;
            hi = G ? __ldg(p) : *p;
        }
        lo = hi;
    }
};

// The e16 rounding of a pair and of its remainders, packed as one register each (the first
// element in the low half, as a 16-bit row's load packs it).
__device__ __forceinline__ void split_pair(float a, float b, unsigned& hi, unsigned& lo) {
    const e16_t ha = f32_to_e16(a), hb = f32_to_e16(b);
    const e16_t la = f32_to_e16(a - e16_to_f32(ha)), lb = f32_to_e16(b - e16_to_f32(hb));
    hi = (unsigned)ha | ((unsigned)hb << 16);
    lo = (unsigned)la | ((unsigned)lb << 16);
}

template <>
struct SkinnyRows<float> {
    static constexpr bool SPLIT = true;
    template <bool G>
    __device__ static __forceinline__ void load(const float* x, int r, int m, int ld, int kc, int q, uint4& hi,
                                                uint4& lo) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
        if (r < m) {
            const float4* p = reinterpret_cast<const float4*>(x + (long long)r * ld + kc) + 2 * q;
            a = G ? __ldg(p) : p[0];
            b = G ? __ldg(p + 1) : p[1];
        }
        split_pair(a.x, a.y, hi.x, lo.x);
        split_pair(a.z, a.w, hi.y, lo.y);
        split_pair(b.x, b.y, hi.z, lo.z);
        split_pair(b.z, b.w, hi.w, lo.w);
    }
};

// Lane (g = lane / 4, q = lane % 4) of an m16n8k16 MMA: with chunk elements q·8 .. q·8 + 7
// loaded as one uint4 per row, step 0 takes elements 0–3 as k = 2q, 2q + 1, 2q + 8, 2q + 9 and
// step 1 takes elements 4–7 the same way: the A pairs {row g, row g + 8} and the B pair of
// column g then hold matching k in both steps.
template <int NT>
__device__ __forceinline__ void skinny_mma(float (&acc)[NT][4], const uint4 (&wv)[NT], const uint4& xa,
                                           const uint4& xb) {
    const unsigned a0[4] = {xa.x, xb.x, xa.y, xb.y};
    const unsigned a1[4] = {xa.z, xb.z, xa.w, xb.w};
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        mma_16816(acc[t], a0, wv[t].x, wv[t].y);
        mma_16816(acc[t], a1, wv[t].z, wv[t].w);
    }
}

template <int NT, typename X, bool G>
__device__ __forceinline__ void skinny_chunk(float (&acc)[NT][4], const uint4 (&wv)[NT], const X* x, int m,
                                             int ld, int kc) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    uint4 ha, la, hb, lb;
    SkinnyRows<X>::template load<G>(x, g, m, ld, kc, q, ha, la);
    SkinnyRows<X>::template load<G>(x, g + 8, m, ld, kc, q, hb, lb);
    skinny_mma<NT>(acc, wv, ha, hb);
    if (SkinnyRows<X>::SPLIT) skinny_mma<NT>(acc, wv, la, lb);
}

// Where a block reads its rows: x (ld elements apart) in global or shared memory.
template <typename X, bool G>
struct SkinnyX {
    const X* x;
    int m, ld;
};

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

template <int NT, int U, typename X, bool G>
__device__ __forceinline__ void skinny_math(float (&acc)[NT][4], const uint4 (&wv)[U][NT], SkinnyX<X, G> xs,
                                            int k0, int c) {
#pragma unroll
    for (int u = 0; u < U; ++u) skinny_chunk<NT, X, G>(acc, wv[u], xs.x, xs.m, xs.ld, k0 + 32 * (c + u));
}

template <int NT, int U, typename X, bool G>
__device__ __forceinline__ void skinny_run(float (&acc)[NT][4], const uint4* const (&wr)[NT], SkinnyX<X, G> xs,
                                           int k0, int c) {
    uint4 wv[U][NT];
    skinny_load<NT, U>(wv, wr, c);
    skinny_math<NT, U>(acc, wv, xs, k0, c);
}

// The first run's weights (which no earlier kernel writes) are loaded before the PDL wait, so
// their DRAM latency overlaps the previous kernel's tail: measured on an H100, loading them
// after it was 30% slower at 16 rows (batch 8 of bf16x2: 3,570 against 5,110 tok/s). After
// the wait, `rows` prepares the block's rows (the norm forms), the whole block at once.
template <int NT, int U, typename X, bool G, typename Rows>
__device__ __forceinline__ int skinny_first_run(float (&acc)[NT][4], const uint4* const (&wr)[NT],
                                                SkinnyX<X, G> xs, int k0, Rows rows) {
    uint4 wv[U][NT];
    skinny_load<NT, U>(wv, wr, 0);
    GRID_DEPENDENCY_SYNC();
    rows();
    skinny_math<NT, U>(acc, wv, xs, k0, 0);
    return U;
}

// The block's partial tiles of its 8 · NT weight rows (from n0 on), summed over k.
template <int NT, typename X, bool G, typename Rows>
__device__ __forceinline__ void skinny_accumulate(float (&acc)[NT][4], const e16_t* w, int nw, int k, int n0,
                                                  SkinnyX<X, G> xs, Rows rows) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int kw = k / SG_WARPS;  // this warp's slice of k
    const int k0 = warp * kw;
    const uint4* wr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        // A weight row past nw reads the last row (in bounds) and is never stored.
        const int col = min(n0 + t * 8 + g, nw - 1);
        wr[t] = reinterpret_cast<const uint4*>(w + (long long)col * k + k0) + q;
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;
    const int chunks = kw >> 5;  // at least 1 (k is a multiple of 32 · SG_WARPS)
    int c;
    if (chunks >= 8) {
        c = skinny_first_run<NT, 8>(acc, wr, xs, k0, rows);
    } else if (chunks >= 4) {
        c = skinny_first_run<NT, 4>(acc, wr, xs, k0, rows);
    } else {
        c = skinny_first_run<NT, 1>(acc, wr, xs, k0, rows);
    }
    for (; c + 8 <= chunks; c += 8) skinny_run<NT, 8>(acc, wr, xs, k0, c);
    for (; c + 4 <= chunks; c += 4) skinny_run<NT, 4>(acc, wr, xs, k0, c);
    for (; c < chunks; ++c) skinny_run<NT, 1>(acc, wr, xs, k0, c);
}

// The warps' partial tiles meet in shared memory; then each thread sums a pair of adjacent
// outputs (weight rows 2j and 2j + 1) and stores them, or with SILU silu(gate) · up of them
// (the gate_up weights' rows interleaved) into out's column j.
template <int NT, bool SILU, typename O>
__device__ __forceinline__ void skinny_store(O* out, float (&red)[SG_WARPS][NT * 4][32], const float (&acc)[NT][4],
                                             int m, int nw, int n0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][t * 4 + e][lane] = acc[t][e];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 2 * 32; i += blockDim.x) {
        const int pair = i >> 5, l = i & 31;  // pair: tile t = pair / 2, rows g (0) or g + 8 (1)
        const int e0 = (pair >> 1) * 4 + (pair & 1) * 2;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int v = 0; v < SG_WARPS; ++v) {
            s0 += red[v][e0][l];
            s1 += red[v][e0 + 1][l];
        }
        const int row = (l >> 2) + (pair & 1) * 8;
        const int col = n0 + (pair >> 1) * 8 + 2 * (l & 3);
        if (row >= m || col >= nw) continue;
        if (SILU) {
            store_f(out, (long long)row * (nw >> 1) + (col >> 1), s0 / (1.0f + expf(-s0)) * s1);
        } else {
            store_f(out, (long long)row * nw + col, s0);
            if (col + 1 < nw) store_f(out, (long long)row * nw + col + 1, s1);
        }
    }
}

// x: m rows of k (16-bit or f32) in global memory; out: m rows of n (f32).
template <int NT, typename X>
__device__ void gemm_skinny_impl(float* out, const X* x, const e16_t* w, int m, int n, int k) {
    __shared__ float red[SG_WARPS][NT * 4][32];
    const int n0 = blockIdx.x * 8 * NT;
    float acc[NT][4];
    skinny_accumulate<NT>(acc, w, n, k, n0, SkinnyX<X, true>{x, m, k}, [] {});
    skinny_store<NT, false>(out, red, acc, m, n, n0);
}

// Padding of each normalised row in shared memory (32 bytes): rows g and g + 1 of a quarter
// warp's loads then fall in different banks.
template <typename X>
__device__ __forceinline__ int skinny_norm_ld(int k) {
    return k + 32 / (int)sizeof(X);
}

// The norm forms: the rows x + residual (stored to x_out by block 0) normalised by norm_w into
// shared memory as X (16-bit as rms_norm rounds them, or f32), then the GEMM over them into
// out's n columns (f32), or with SILU silu(gate) · up into n columns of O from 2n interleaved
// weight rows. Every block normalises all rows itself: taken for few rows only.
template <int NT, typename X, bool SILU, typename O>
__device__ void gemm_skinny_norm_impl(O* out, const float* x, const float* residual, float* x_out,
                                      const float* norm_w, float eps, const e16_t* w, int m, int n, int k) {
    __shared__ float red[SG_WARPS][NT * 4][32];
    extern __shared__ __align__(16) unsigned char skinny_smem[];
    X* xs = reinterpret_cast<X*>(skinny_smem);  // [m][ld]
    const int ld = skinny_norm_ld<X>(k);
    const int nw = SILU ? 2 * n : n;
    const int n0 = blockIdx.x * 8 * NT;
    auto normalise = [&] {
        for (int r = 0; r < m; ++r) norm_row(xs + (long long)r * ld, x, residual, x_out, norm_w, eps, r, k);
        __syncthreads();
    };
    float acc[NT][4];
    skinny_accumulate<NT>(acc, w, nw, k, n0, SkinnyX<X, false>{xs, m, ld}, normalise);
    skinny_store<NT, SILU>(out, red, acc, m, nw, n0);
}

#define GEMM_SKINNY(NAME, NT, X)                                                                       \
    extern "C" __global__ void __launch_bounds__(SG_WARPS * 32)                                         \
        NAME(float* out, const X* x, const e16_t* w, int m, int n, int k) {                            \
        gemm_skinny_impl<NT, X>(out, x, w, m, n, k);                                                   \
    }

GEMM_SKINNY(gemm_skinny_n8, 1, e16_t)
GEMM_SKINNY(gemm_skinny_n16, 2, e16_t)
GEMM_SKINNY(gemm_skinny_xf32_n8, 1, float)
GEMM_SKINNY(gemm_skinny_xf32_n16, 2, float)

#define GEMM_SKINNY_NORM(NAME, NT, X, SILU, O)                                                          \
    extern "C" __global__ void __launch_bounds__(SG_WARPS * 32)                                         \
        NAME(O* out, const float* x, const float* residual, float* x_out, const float* norm_w, float eps, \
             const e16_t* w, int m, int n, int k) {                                                     \
        gemm_skinny_norm_impl<NT, X, SILU, O>(out, x, residual, x_out, norm_w, eps, w, m, n, k);        \
    }

// bf16 rows (the bf16 precision) and f32 rows (bf16x2), each plain and with SiLU·mul.
GEMM_SKINNY_NORM(gemm_skinny_norm_bf16_n8, 1, e16_t, false, float)
GEMM_SKINNY_NORM(gemm_skinny_norm_bf16_n16, 2, e16_t, false, float)
GEMM_SKINNY_NORM(gemm_skinny_norm_silu_bf16_n8, 1, e16_t, true, e16_t)
GEMM_SKINNY_NORM(gemm_skinny_norm_silu_bf16_n16, 2, e16_t, true, e16_t)
GEMM_SKINNY_NORM(gemm_skinny_norm_xf32_n8, 1, float, false, float)
GEMM_SKINNY_NORM(gemm_skinny_norm_xf32_n16, 2, float, false, float)
GEMM_SKINNY_NORM(gemm_skinny_norm_silu_xf32_n8, 1, float, true, float)
GEMM_SKINNY_NORM(gemm_skinny_norm_silu_xf32_n16, 2, float, true, float)
