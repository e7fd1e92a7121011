// SwiGLU activation: out[r, c] = silu(g) * u with g = gu[r, 2c], u = gu[r, 2c + 1] (the fused
// gate_up GEMM's output, rows 2*im long: the backend interleaves the gate and up weight rows,
// which gemv.cu's fused decode GEMV needs); silu(g) = g / (1 + exp(-g)) as cpu_ops::silu_mul.
// silu_mul_bf16 writes bf16: the input of the down projection's bf16 GEMM. in_lo != 0: gu is
// a split GEMM's unfolded output, its lo half in_lo elements on (added here, as fold_rows_f32
// would).
template <typename O>
__device__ void silu_mul_impl(O* out, const float* gu, int rows, int im, long long lo_off, long long in_lo) {
    const long long n = (long long)rows * im;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long r = idx / im;
        const long long c = idx % im;
        float g = gu[r * 2 * im + 2 * c];
        float u = gu[r * 2 * im + 2 * c + 1];
        if (in_lo != 0) {
            g += gu[in_lo + r * 2 * im + 2 * c];
            u += gu[in_lo + r * 2 * im + 2 * c + 1];
        }
        store_in(out, idx, g / (1.0f + expf(-g)) * u, lo_off);
    }
}

extern "C" __global__ void silu_mul_f32(float* out, const float* gu, int rows, int im, long long lo_off,
                                        long long in_lo) {
    GRID_DEPENDENCY_SYNC();
    silu_mul_impl(out, gu, rows, im, lo_off, in_lo);
}

extern "C" __global__ void silu_mul_bf16(e16_t* out, const float* gu, int rows, int im, long long lo_off,
                                         long long in_lo) {
    GRID_DEPENDENCY_SYNC();
    silu_mul_impl(out, gu, rows, im, lo_off, in_lo);
}
