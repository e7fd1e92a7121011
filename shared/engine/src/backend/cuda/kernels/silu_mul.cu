// SwiGLU activation: out[r, c] = silu(g) * u with g = gu[r, 2c], u = gu[r, 2c + 1] (the fused
// gate_up GEMM's output, rows 2*im long: the backend interleaves the gate and up weight rows,
// which gemv.cu's fused decode GEMV needs); silu(g) = g / (1 + exp(-g)) as cpu_ops::silu_mul.
// silu_mul_bf16 writes bf16: the input of the down projection's bf16 GEMM. in_lo != 0: gu is
// a split GEMM's unfolded output, its lo half in_lo elements on (added here, as fold_rows_f32
// would).
// silu_mul_in16_*: gu in the program's 16-bit element (a GEMM that wrote its output rounded:
// the bf16 and f16 precisions' prefill chunks), never split.
// Grid (x over column pairs, y over rows, striding when rows exceed it), 32-bit indexing in a
// row: with an even im a thread takes columns c and c + 1, their g, u, g, u as one float4
// (16-byte aligned: rows are 2 * im floats; 8 bytes from a 16-bit gu); an odd im takes one
// column per thread.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ __forceinline__ float4 load_gu4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_gu4(const e16_t* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return make_float4(e16_lo(v.x), e16_hi(v.x), e16_lo(v.y), e16_hi(v.y));
}
template <typename O, typename I>
__device__ void silu_mul_impl(O* out, const I* gu, int rows, int im, long long lo_off, long long in_lo) {
    const bool pairs = (im & 1) == 0;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * (pairs ? 2 : 1);
    if (c >= im) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const I* in = gu + (long long)r * 2 * im + 2 * c;
        const long long o = (long long)r * im + c;
        if (pairs) {
            float4 v = load_gu4(in);
            if (in_lo != 0) {
                const float4 l = load_gu4(in + in_lo);
                v.x += l.x;
                v.y += l.y;
                v.z += l.z;
                v.w += l.w;
            }
            store_in(out, o, silu_times(v.x, v.y), lo_off);
            store_in(out, o + 1, silu_times(v.z, v.w), lo_off);
        } else {
            float g = load_f(in, 0), u = load_f(in, 1);
            if (in_lo != 0) {
                g += load_f(in, in_lo);
                u += load_f(in, in_lo + 1);
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

extern "C" __global__ void silu_mul_in16_f32(float* out, const e16_t* gu, int rows, int im, long long lo_off,
                                             long long in_lo) {
    GRID_DEPENDENCY_SYNC();
    silu_mul_impl(out, gu, rows, im, lo_off, in_lo);
}

extern "C" __global__ void silu_mul_in16_bf16(e16_t* out, const e16_t* gu, int rows, int im, long long lo_off,
                                              long long in_lo) {
    GRID_DEPENDENCY_SYNC();
    silu_mul_impl(out, gu, rows, im, lo_off, in_lo);
}
