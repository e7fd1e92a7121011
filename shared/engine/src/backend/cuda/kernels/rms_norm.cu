// RMSNorm of each `dim`-long row, as Hugging Face's Qwen3RMSNorm computes it in f32:
// out = w * (x * 1/sqrt(mean(x^2) + eps)). With `residual` non-null the residual is added
// first and the sum written back to x (x += residual; out = norm(x)), the decoder's
// "residual add, then the next norm" in one pass. One block per row; `out` may equal `x`.
// rms_norm_bf16 writes its output as bf16: the input of a bf16 GEMM, with no separate cast.
// res_lo != 0: the residual is a split GEMM's unfolded output, its lo half res_lo elements on;
// the halves are added first (as fold_rows_f32 would), saving that launch.
// A row of at most 4 × blockDim.x elements, dim, res_lo and lo_off multiples of 4: one float4
// per thread, held in registers between the sum and the output (x read once), stored by
// store_in4 (a split output as one 8-byte store of the four values and one of their
// remainders: eight 2-byte stores measured slower at prefill sizes than the strided form's,
// bf16x2 2k 0.91 -> 1.18 ms on an H100).
template <typename O>
__device__ void rms_norm_row4(O* out, float* x, const float* residual, const float* w, int dim, float eps,
                              long long lo_off, long long res_lo) {
    const long long base = (long long)blockIdx.x * dim;
    const int i = 4 * threadIdx.x;
    const bool on = i < dim;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (on) {
        v = *reinterpret_cast<const float4*>(x + base + i);
        if (residual != nullptr) {
            float4 r = *reinterpret_cast<const float4*>(residual + base + i);
            if (res_lo != 0) {
                const float4 l = *reinterpret_cast<const float4*>(residual + res_lo + base + i);
                r = make_float4(r.x + l.x, r.y + l.y, r.z + l.z, r.w + l.w);
            }
            v = make_float4(v.x + r.x, v.y + r.y, v.z + r.z, v.w + r.w);
            *reinterpret_cast<float4*>(x + base + i) = v;
        }
    }
    const float ss = block_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    if (on) {
        const float4 wv = *reinterpret_cast<const float4*>(w + i);
        store_in4(out, base + i, make_float4(wv.x * (v.x * r), wv.y * (v.y * r), wv.z * (v.z * r), wv.w * (v.w * r)), lo_off);
    }
}

template <typename O>
__device__ void rms_norm_impl(O* out, float* x, const float* residual, const float* w, int dim, float eps, long long lo_off,
                              long long res_lo) {
    if (dim % 4 == 0 && res_lo % 4 == 0 && lo_off % 4 == 0 && dim <= 4 * (int)blockDim.x) {
        rms_norm_row4(out, x, residual, w, dim, eps, lo_off, res_lo);
        return;
    }
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = x[base + i];
        if (residual != nullptr) {
            float r = residual[base + i];
            if (res_lo != 0) r += residual[res_lo + base + i];
            v += r;
            x[base + i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        store_in(out, base + i, w[i] * (x[base + i] * r), lo_off);
    }
}

extern "C" __global__ void rms_norm_f32(float* out, float* x, const float* residual, const float* w, int dim, float eps, long long lo_off,
                                        long long res_lo) {
    GRID_DEPENDENCY_SYNC();
    rms_norm_impl(out, x, residual, w, dim, eps, lo_off, res_lo);
}

extern "C" __global__ void rms_norm_bf16(e16_t* out, float* x, const float* residual, const float* w, int dim, float eps, long long lo_off,
                                         long long res_lo) {
    GRID_DEPENDENCY_SYNC();
    rms_norm_impl(out, x, residual, w, dim, eps, lo_off, res_lo);
}

// The warp-per-row form for steps of many rows (prefill chunks; ops.rs picks it): warp w of
// block b normalises row b * warps + w, a lane holding up to RMS_WARP_CHUNKS float4 of it
// (dim at most 4 * 32 * RMS_WARP_CHUNKS, dim, res_lo and lo_off multiples of 4), all its
// loads issued before the sum, which is a warp reduction: no block barriers, and eight
// independent rows per block of 256 threads where the block form has one.
#define RMS_WARP_CHUNKS 8
template <typename O>
__device__ void rms_norm_warp_row(O* out, float* x, const float* residual, const float* w, int rows, int dim,
                                  float eps, long long lo_off, long long res_lo) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // uniform over the warp
    const int lane = threadIdx.x & 31;
    const long long base = (long long)row * dim;
    float4 v[RMS_WARP_CHUNKS];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RMS_WARP_CHUNKS; ++j) {
        const int i = 4 * (lane + 32 * j);
        v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < dim) {
            v[j] = *reinterpret_cast<const float4*>(x + base + i);
            if (residual != nullptr) {
                float4 r = *reinterpret_cast<const float4*>(residual + base + i);
                if (res_lo != 0) {
                    const float4 l = *reinterpret_cast<const float4*>(residual + res_lo + base + i);
                    r = make_float4(r.x + l.x, r.y + l.y, r.z + l.z, r.w + l.w);
                }
                v[j] = make_float4(v[j].x + r.x, v[j].y + r.y, v[j].z + r.z, v[j].w + r.w);
                *reinterpret_cast<float4*>(x + base + i) = v[j];
            }
        }
        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) / (float)dim + eps);
#pragma unroll
    for (int j = 0; j < RMS_WARP_CHUNKS; ++j) {
        const int i = 4 * (lane + 32 * j);
        if (i < dim) {
            const float4 wv = *reinterpret_cast<const float4*>(w + i);
            const float4 o = make_float4(wv.x * (v[j].x * r), wv.y * (v[j].y * r), wv.z * (v[j].z * r),
                                         wv.w * (v[j].w * r));
            store_in4(out, base + i, o, lo_off);
        }
    }
}

extern "C" __global__ void rms_norm_rows_f32(float* out, float* x, const float* residual, const float* w, int rows,
                                             int dim, float eps, long long lo_off, long long res_lo) {
    GRID_DEPENDENCY_SYNC();
    rms_norm_warp_row(out, x, residual, w, rows, dim, eps, lo_off, res_lo);
}

extern "C" __global__ void rms_norm_rows_bf16(e16_t* out, float* x, const float* residual, const float* w,
                                              int rows, int dim, float eps, long long lo_off, long long res_lo) {
    GRID_DEPENDENCY_SYNC();
    rms_norm_warp_row(out, x, residual, w, rows, dim, eps, lo_off, res_lo);
}
