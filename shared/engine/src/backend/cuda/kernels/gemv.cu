// Small-batch GEMM for bf16 weights and activations: out[r, n] = Σ_k x[r, k] · w[n, k] for
// r < m ≤ M (1 or 2), f32 accumulation and output. Decode steps of a few sequences are bound by reading
// the weights, which cuBLAS's tiled kernels do with too few blocks at m = 1..8 (a 6 MB matrix
// took ~20 µs, 0.3 TB/s); here one warp per output column reads its weight row with 16-byte
// loads (issued in runs before their math), each used for the m rows of x (L1-resident), and the
// lanes' partial sums meet in a shuffle reduction. k must be a multiple of 8.
#define GEMV_WARPS 8

__device__ __forceinline__ void e16x8_to_f32(const uint4 v, float (&f)[8]) {
    f[0] = e16_lo(v.x);
    f[1] = e16_hi(v.x);
    f[2] = e16_lo(v.y);
    f[3] = e16_hi(v.y);
    f[4] = e16_lo(v.z);
    f[5] = e16_hi(v.z);
    f[6] = e16_lo(v.w);
    f[7] = e16_hi(v.w);
}

// Chunk c (8 elements) of an activation row as f32: bf16 (the bf16 GEMM input) or f32 (the
// bf16x2 precision's GEMVs, whose activations are never rounded: at one or two rows the
// weights are the traffic, so reading f32 rows from L1 costs nothing measurable).
__device__ __forceinline__ void x8_to_f32(const e16_t* row, int c, float (&f)[8]) {
    e16x8_to_f32(reinterpret_cast<const uint4*>(row)[c], f);
}
__device__ __forceinline__ void x8_to_f32(const float* row, int c, float (&f)[8]) {
    const float4 a = reinterpret_cast<const float4*>(row)[2 * c];
    const float4 b = reinterpret_cast<const float4*>(row)[2 * c + 1];
    f[0] = a.x;
    f[1] = a.y;
    f[2] = a.z;
    f[3] = a.w;
    f[4] = b.x;
    f[5] = b.y;
    f[6] = b.z;
    f[7] = b.w;
}

// U weight chunks (8 bf16 each) at c, c + 32, ..., loaded, then used for the m rows of x.
template <int M, int U, typename X>
__device__ __forceinline__ void gemv_run(float (&acc)[M], const uint4* wr, const X* x, int m, int k, int c) {
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) wv[u] = __ldg(wr + c + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float wf[8];
        e16x8_to_f32(wv[u], wf);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if (r < m) {
                float xf[8];
                x8_to_f32(x + (long long)r * k, c + 32 * u, xf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r] += wf[e] * xf[e];
            }
        }
    }
}

// Column `col` of out[r, col] = Σ_k x[r, k] · w[col, k] for the m rows of x: runs of 12, 8,
// then 4, then single weight loads per lane, each run's loads issued before its math, then
// the lanes' sums meet in a shuffle reduction and lane 0 stores them (f32 or bf16). k = 1024,
// 2048 and 3072 (the down projection) each take one run, so a warp waits on DRAM once.
template <int M, typename O, typename X>
__device__ __forceinline__ void gemv_column(O* out, const X* x, const e16_t* w, int m, int n, int k, int col) {
    const int lane = threadIdx.x & 31;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)col * k);
    const int chunks = k >> 3;
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    int c = lane;
    for (; c + 11 * 32 < chunks; c += 12 * 32) gemv_run<M, 12, X>(acc, wr, x, m, k, c);
    for (; c + 7 * 32 < chunks; c += 8 * 32) gemv_run<M, 8, X>(acc, wr, x, m, k, c);
    for (; c + 3 * 32 < chunks; c += 4 * 32) gemv_run<M, 4, X>(acc, wr, x, m, k, c);
    for (; c < chunks; c += 32) gemv_run<M, 1, X>(acc, wr, x, m, k, c);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        float v = acc[r];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && r < m) store_f(out, (long long)r * n + col, v);
    }
}

template <int M, typename X>
__device__ void gemv_sync_bf16_impl(float* out, const X* x, const e16_t* w, int m, int n, int k) {
    GRID_DEPENDENCY_SYNC();
    const int col = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (col >= n) return;
    gemv_column<M, float, X>(out, x, w, m, n, k, col);
}

// A decode step's RMSNorm and the GEMV after it in one launch (m ≤ M rows, k ≤ 8 · blockDim
// elements per row in shared memory): every block normalises the rows itself — x + residual
// (the decoder's fused residual add), times w_norm / rms — into shared memory as the bf16 that
// rms_norm_bf16 writes, and block 0 stores the sum to x_out (a second residual buffer: no block
// reads a row another writes), then its warps take output columns as gemv_bf16 does. With SILU
// the weight rows are the gate and up rows interleaved (2c gate c, 2c + 1 up c, read as one row
// of 2k) and a warp writes silu(g) · u as bf16, the down projection's input: norm, gate_up and
// SiLU·mul in one launch. Re-normalising per block reads the row from L2 (4 KB at hidden 1024)
// beside the 16 KB of weights the block streams. The warp's first GEMV_RUN weight chunks per
// lane (a whole row up to 2,048 elements) are loaded before the norm, which does not need
// them, so their DRAM latency and the norm's reductions overlap.
#define GEMV_RUN 8
template <int M, bool SILU, typename X>
__device__ __forceinline__ void gemv_norm_chunk(float (&acc)[M], float (&up)[M], const uint4 wv, const X* xs,
                                                int m, int k, int c) {
    const int kc = k >> 3;
    const bool is_up = SILU && c >= kc;
    const int xc = is_up ? c - kc : c;
    float wf[8];
    e16x8_to_f32(wv, wf);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        if (r < m) {
            float xf[8];
            x8_to_f32(xs + r * k, xc, xf);
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) d += wf[e] * xf[e];
            if (is_up) {
                up[r] += d;
            } else {
                acc[r] += d;
            }
        }
    }
}

// A lane's first RUN weight chunks of its column (chunks lane, lane + 32, ...).
template <int RUN = GEMV_RUN>
__device__ __forceinline__ void gemv_load_first(uint4 (&first)[RUN], const uint4* wr, bool valid, int row_chunks) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
        const int c = lane + 32 * u;
        if (valid && c < row_chunks) first[u] = __ldg(wr + c);
    }
}

// A lane's share of its column: the first chunks (loaded already), then the rest of a longer
// row (past 32 · RUN chunks) in runs of RUN loads issued before their math. acc: the plain
// sum, or the gate's with SILU (chunks below k / 8), up the up's.
template <int M, bool SILU, typename X, int RUN = GEMV_RUN>
__device__ __forceinline__ void gemv_accumulate(float (&acc)[M], float (&up)[M], const uint4 (&first)[RUN],
                                                const uint4* wr, const X* xs, int m, int k, int row_chunks) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = up[r] = 0.0f;
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
        const int c = lane + 32 * u;
        if (c < row_chunks) gemv_norm_chunk<M, SILU, X>(acc, up, first[u], xs, m, k, c);
    }
    for (int c0 = lane + 32 * RUN; c0 < row_chunks; c0 += 32 * RUN) {
        uint4 wv[RUN];
#pragma unroll
        for (int u = 0; u < RUN; ++u) {
            const int c = c0 + 32 * u;
            if (c < row_chunks) wv[u] = __ldg(wr + c);
        }
#pragma unroll
        for (int u = 0; u < RUN; ++u) {
            const int c = c0 + 32 * u;
            if (c < row_chunks) gemv_norm_chunk<M, SILU, X>(acc, up, wv[u], xs, m, k, c);
        }
    }
}

// A GEMV whose lanes hold their weight rows' first RUN chunks each (whole rows up to 32 · 8 ·
// RUN elements) loaded before the wait on the kernel before when EARLY (PDL: weights never
// depend on it, so their DRAM latency overlaps that kernel's tail), then the rest in runs of
// RUN. Without EARLY it waits first: the runs alone (the two-row GEMV over f32 rows, where
// ptxas otherwise interleaved gemv_column's loads with their math: 32 registers, one load in
// flight at a time; batch 2 ran at 75% of bf16's).
template <int M, typename X, bool EARLY, int RUN>
__device__ void gemv_runs_impl(float* out, const X* x, const e16_t* w, int m, int n, int k) {
    if (!EARLY) GRID_DEPENDENCY_SYNC();
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int chunks = k >> 3;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)min(col, n - 1) * k);
    uint4 first[RUN];
    gemv_load_first<RUN>(first, wr, col < n, chunks);
    if (EARLY) GRID_DEPENDENCY_SYNC();
    if (col >= n) return;
    float acc[M], unused[M];
    gemv_accumulate<M, false, X, RUN>(acc, unused, first, wr, x, m, k, chunks);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        float v = acc[r];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && r < m) out[(long long)r * n + col] = v;
    }
}

// Runs of 12 weight loads (a k = 3072 row in one run), waiting first.
template <int M, typename X>
__device__ void gemv_runs12_impl(float* out, const X* x, const e16_t* w, int m, int n, int k) {
    gemv_runs_impl<M, X, false, 12>(out, x, w, m, n, k);
}

// Runs of 12 weight loads, the first before the PDL wait: a k = 3072 row (the down
// projection) is one run, one DRAM round trip instead of runs of 8 and 4 (H200, A/B in one
// lease: batch 1 +4.2% in bf16x2, +1.9% in bf16; 80-90 registers, 3 blocks per SM).
template <int M, typename X>
__device__ void gemv_early12_impl(float* out, const X* x, const e16_t* w, int m, int n, int k) {
    gemv_runs_impl<M, X, true, 12>(out, x, w, m, n, k);
}

// The one-row GEMVs (_early_) load their first weights before the PDL wait (batch 1 +2.7% on
// the H200); the two-row ones wait first (early weights lost 6% there). The _xf32_ ones read
// f32 activations (the bf16x2 precision's one- and two-row steps).
#define GEMV_BF16(NAME, IMPL, M, X)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
        NAME(float* out, const X* x, const e16_t* w, int m, int n, int k) {                             \
        IMPL<M, X>(out, x, w, m, n, k);                                                                 \
    }

GEMV_BF16(gemv_bf16_m2, gemv_sync_bf16_impl, 2, e16_t)
GEMV_BF16(gemv_early_bf16_m1, gemv_early12_impl, 1, e16_t)
GEMV_BF16(gemv_xf32_m2, gemv_runs12_impl, 2, float)
GEMV_BF16(gemv_early_xf32_m1, gemv_early12_impl, 1, float)

// With EARLY the first weight chunks are loaded before the PDL wait (as gemv_runs_impl).
// X: the normalised rows' type in shared memory (bf16 as rms_norm_bf16 rounds them, or f32).
template <int M, bool SILU, bool EARLY, typename O, typename X>
__device__ void gemv_norm_impl(O* out, const float* x, const float* residual, float* x_out,
                               const float* norm_w, float eps, const e16_t* w, int m, int n, int k) {
    if (!EARLY) GRID_DEPENDENCY_SYNC();
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    X* xs = reinterpret_cast<X*>(gemv_smem);  // [M][k]
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * GEMV_WARPS + warp;
    const int row_chunks = (SILU ? 2 : 1) * (k >> 3);  // 8-element weight chunks per column
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)min(col, n - 1) * row_chunks * 8);
    uint4 first[GEMV_RUN];
    gemv_load_first(first, wr, col < n, row_chunks);
    if (EARLY) GRID_DEPENDENCY_SYNC();
#pragma unroll
    for (int r = 0; r < M; ++r) {
        if (r < m) {  // uniform over the block
            const float* xr = x + (long long)r * k;
            const float* rr = residual != nullptr ? residual + (long long)r * k : nullptr;
            float ss = 0.0f;
            for (int i = threadIdx.x; i < k; i += blockDim.x) {
                const float v = rr != nullptr ? xr[i] + rr[i] : xr[i];
                ss += v * v;
            }
            ss = block_sum(ss);
            const float inv = 1.0f / sqrtf(ss / (float)k + eps);
            for (int i = threadIdx.x; i < k; i += blockDim.x) {
                const float v = rr != nullptr ? xr[i] + rr[i] : xr[i];
                if (blockIdx.x == 0) x_out[(long long)r * k + i] = v;
                store_f(xs, r * k + i, norm_w[i] * (v * inv));
            }
        }
    }
    __syncthreads();
    if (col >= n) return;
    float acc[M], up[M];
    gemv_accumulate<M, SILU, X>(acc, up, first, wr, xs, m, k, row_chunks);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        float g = acc[r], u = up[r];
        for (int o = 16; o > 0; o >>= 1) {
            g += __shfl_xor_sync(0xffffffffu, g, o);
            if (SILU) u += __shfl_xor_sync(0xffffffffu, u, o);
        }
        if (lane == 0 && r < m) store_f(out, (long long)r * n + col, SILU ? g / (1.0f + expf(-g)) * u : g);
    }
}

// One row: the first weights before the PDL wait (EARLY); two rows: after it.
#define GEMV_NORM(NAME, M, SILU, EARLY, O, X)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
        NAME(O* out, const float* x, const float* residual, float* x_out, const float* norm_w, float eps, \
             const e16_t* w, int m, int n, int k) {                                                     \
        gemv_norm_impl<M, SILU, EARLY, O, X>(out, x, residual, x_out, norm_w, eps, w, m, n, k);         \
    }

GEMV_NORM(gemv_norm_bf16_m2, 2, false, false, float, e16_t)
GEMV_NORM(gemv_norm_silu_bf16_m2, 2, true, false, e16_t, e16_t)
GEMV_NORM(gemv_norm_early_bf16_m1, 1, false, true, float, e16_t)
GEMV_NORM(gemv_norm_silu_early_bf16_m1, 1, true, true, e16_t, e16_t)
// f32 normalised rows (and f32 SiLU·mul outputs): the bf16x2 precision's one- and two-row steps.
GEMV_NORM(gemv_norm_xf32_m2, 2, false, false, float, float)
GEMV_NORM(gemv_norm_silu_xf32_m2, 2, true, false, float, float)
GEMV_NORM(gemv_norm_early_xf32_m1, 1, false, true, float, float)
GEMV_NORM(gemv_norm_silu_early_xf32_m1, 1, true, true, float, float)
