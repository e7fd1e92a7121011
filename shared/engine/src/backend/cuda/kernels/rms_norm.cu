// RMSNorm of each `dim`-long row, as Hugging Face's Qwen3RMSNorm computes it in f32:
// out = w * (x * 1/sqrt(mean(x^2) + eps)). With `residual` non-null the residual is added
// first and the sum written back to x (x += residual; out = norm(x)), the decoder's
// "residual add, then the next norm" in one pass. One block per row; `out` may equal `x`.
// rms_norm_bf16 writes its output as bf16: the input of a bf16 GEMM, with no separate cast.
// res_lo != 0: the residual is a split GEMM's unfolded output, its lo half res_lo elements on;
// the halves are added first (as fold_rows_f32 would), saving that launch.
template <typename O>
__device__ void rms_norm_impl(O* out, float* x, const float* residual, const float* w, int dim, float eps, long long lo_off,
                              long long res_lo) {
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
