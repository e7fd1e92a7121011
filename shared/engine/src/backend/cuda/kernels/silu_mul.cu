// SwiGLU activation: out[r, c] = silu(g) * u with g = gu[r, c], u = gu[r, im + c] (the fused
// gate_up GEMM's output, rows 2*im long); silu(g) = g / (1 + exp(-g)) as cpu_ops::silu_mul.
extern "C" __global__ void silu_mul_f32(float* out, const float* gu, int rows, int im) {
    const long long n = (long long)rows * im;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long r = idx / im;
        const long long c = idx % im;
        const float g = gu[r * 2 * im + c];
        const float u = gu[r * 2 * im + im + c];
        out[idx] = g / (1.0f + expf(-g)) * u;
    }
}
