// SwiGLU activation: out[r, c] = silu(g) * u with g = gu[r, 2c], u = gu[r, 2c + 1] (the fused
// gate_up GEMM's output, rows 2*im long: the backend interleaves the gate and up weight rows,
// which gemv.cu's fused decode GEMV needs); silu(g) = g / (1 + exp(-g)) as cpu_ops::silu_mul.
// silu_mul_bf16 writes bf16: the input of the down projection's bf16 GEMM. in_lo != 0: gu is
// a split GEMM's unfolded output, its lo half in_lo elements on (added here, as fold_rows_f32
// would).
// silu_mul_in16_*: gu in the program's 16-bit element (a GEMM that wrote its output rounded:
// the bf16 and f16 precisions' prefill chunks), never split.
// Grid (x over a row's columns, y over rows, striding when rows exceed it), 32-bit indexing in
// a row (silu_mul_columns says how many columns a thread takes): with im a multiple of 4 a
// thread takes four columns, their g, u pairs as two float4 (16 bytes from a 16-bit gu) and
// its four outputs as one store (store_in4); with another even im two columns, as one float4
// (8 bytes from a 16-bit gu); an odd im one column per thread.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ __forceinline__ float4 load_gu4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_gu4(const e16_t* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return make_float4(e16_lo(v.x), e16_hi(v.x), e16_lo(v.y), e16_hi(v.y));
}
// Eight consecutive gate_up values (four g, u pairs) as two float4.
__device__ __forceinline__ void load_gu8(const float* p, float4& a, float4& b) {
    a = *reinterpret_cast<const float4*>(p);
    b = *reinterpret_cast<const float4*>(p + 4);
}
__device__ __forceinline__ void load_gu8(const e16_t* p, float4& a, float4& b) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    a = make_float4(e16_lo(v.x), e16_hi(v.x), e16_lo(v.y), e16_hi(v.y));
    b = make_float4(e16_lo(v.z), e16_hi(v.z), e16_lo(v.w), e16_hi(v.w));
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
template <typename O, typename I>
__device__ void silu_mul_impl(O* out, const I* gu, int rows, int im, long long lo_off, long long in_lo) {
    const bool quads = (im & 3) == 0;
    const bool pairs = (im & 1) == 0;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * (quads ? 4 : pairs ? 2 : 1);
    if (c >= im) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const I* in = gu + (long long)r * 2 * im + 2 * c;
        const long long o = (long long)r * im + c;
        if (quads) {
            float4 a, b;
            load_gu8(in, a, b);
            if (in_lo != 0) {
                float4 la, lb;
                load_gu8(in + in_lo, la, lb);
                a = add4(a, la);
                b = add4(b, lb);
            }
            const float4 s = make_float4(silu_times(a.x, a.y), silu_times(a.z, a.w), silu_times(b.x, b.y),
                                         silu_times(b.z, b.w));
            store_in4(out, o, s, lo_off);
        } else if (pairs) {
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
