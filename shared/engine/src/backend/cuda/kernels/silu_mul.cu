// SwiGLU activation: out[r, c] = silu(g) * u with g = gu[r, 2c], u = gu[r, 2c + 1] (the fused
// gate_up GEMM's output, rows 2*im long: the backend interleaves the gate and up weight rows,
// which gemv.cu's fused decode GEMV needs); silu(g) = g / (1 + exp(-g)) as cpu_ops::silu_mul.
// silu_mul_bf16 writes bf16: the input of the down projection's bf16 GEMM. in_lo != 0: gu is
// a split GEMM's unfolded output, its lo half in_lo elements on (added here, as fold_rows_f32
// would).
// Grid (x over column pairs, y over rows, striding when rows exceed it), 32-bit indexing in a
// row: with an even im a thread takes columns c and c + 1, their g, u, g, u as one float4
// (16-byte aligned: rows are 2 * im floats); an odd im takes one column per thread.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }
template <typename O>
__device__ void silu_mul_impl(O* out, const float* gu, int rows, int im, long long lo_off, long long in_lo) {
    const bool pairs = (im & 1) == 0;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * (pairs ? 2 : 1);
    if (c >= im) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* in = gu + (long long)r * 2 * im + 2 * c;
        const long long o = (long long)r * im + c;
        if (pairs) {
            float4 v = *reinterpret_cast<const float4*>(in);
            if (in_lo != 0) {
                const float4 l = *reinterpret_cast<const float4*>(in + in_lo);
                v.x += l.x;
                v.y += l.y;
                v.z += l.z;
                v.w += l.w;
            }
            store_in(out, o, silu_times(v.x, v.y), lo_off);
            store_in(out, o + 1, silu_times(v.z, v.w), lo_off);
        } else {
            float g = in[0], u = in[1];
            if (in_lo != 0) {
                g += in[in_lo];
                u += in[in_lo + 1];
            }
            store_in(out, o, silu_times(g, u), lo_off);
        }
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
