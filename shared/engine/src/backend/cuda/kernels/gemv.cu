// Small-batch GEMM for bf16 weights and activations: out[r, n] = Σ_k x[r, k] · w[n, k] for
// r < m ≤ M (1 or 2), f32 accumulation and output. Decode steps of a few sequences are bound by reading
// the weights, which cuBLAS's tiled kernels do with too few blocks at m = 1..8 (a 6 MB matrix
// took ~20 µs, 0.3 TB/s); here one warp per output column reads its weight row with 16-byte
// loads (issued in runs before their math), each used for the m rows of x (L1-resident), and the
// lanes' partial sums meet in a shuffle reduction. k must be a multiple of 8.
#define GEMV_WARPS 8

__device__ __forceinline__ void bf16x8_to_f32(const uint4 v, float (&f)[8]) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16);
    f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16);
    f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// U weight chunks (8 bf16 each) at c, c + 32, ..., loaded, then used for the m rows of x.
template <int M, int U>
__device__ __forceinline__ void gemv_run(float (&acc)[M], const uint4* wr, const bf16_t* x, int m, int k, int c) {
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) wv[u] = __ldg(wr + c + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float wf[8];
        bf16x8_to_f32(wv[u], wf);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if (r < m) {
                float xf[8];
                bf16x8_to_f32(reinterpret_cast<const uint4*>(x + (long long)r * k)[c + 32 * u], xf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r] += wf[e] * xf[e];
            }
        }
    }
}

template <int M>
__device__ void gemv_bf16_impl(float* out, const bf16_t* x, const bf16_t* w, int m, int n, int k) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * GEMV_WARPS + warp;
    if (col >= n) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)col * k);
    const int chunks = k >> 3;
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    int c = lane;
    // Runs of 8, then 4, then single weight loads per lane, each run's loads issued before its
    // math (k = 1024..3072 needs one or two runs: a warp waits on memory about once).
    for (; c + 7 * 32 < chunks; c += 8 * 32) gemv_run<M, 8>(acc, wr, x, m, k, c);
    for (; c + 3 * 32 < chunks; c += 4 * 32) gemv_run<M, 4>(acc, wr, x, m, k, c);
    for (; c < chunks; c += 32) gemv_run<M, 1>(acc, wr, x, m, k, c);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        float v = acc[r];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && r < m) out[(long long)r * n + col] = v;
    }
}

#define GEMV_BF16(NAME, M)                                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
        NAME(float* out, const bf16_t* x, const bf16_t* w, int m, int n, int k) {                       \
        gemv_bf16_impl<M>(out, x, w, m, n, k);                                                          \
    }

GEMV_BF16(gemv_bf16_m1, 1)
GEMV_BF16(gemv_bf16_m2, 2)
