// The CLIP vision tower's own kernels (backend/cuda/vision.rs), in f32 like model/vision.rs:
// the patch unfold and the embeddings, LayerNorm, bias + activation, and the row softmax of the
// unmasked attention (its two products are cuBLAS batched GEMMs).

// Unfolds `n` images [3, size, size] into patch rows [n * grid * grid, 3 * patch * patch], each
// row in the convolution weight's (channel, y, x) order, patches in row-major grid order.
extern "C" __global__ void vision_patches_f32(const float* img, float* patches, int n, int size, int patch, int grid) {
    GRID_DEPENDENCY_SYNC();
    const int k = 3 * patch * patch;
    const long long total = (long long)n * grid * grid * k;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long row = idx / k;
        const int col = (int)(idx % k);
        const int image = (int)(row / (grid * grid));
        const int cell = (int)(row % (grid * grid));
        const int py = cell / grid, px = cell % grid;
        const int c = col / (patch * patch);
        const int ky = (col / patch) % patch, kx = col % patch;
        const long long src = (((long long)image * 3 + c) * size + (py * patch + ky)) * size + px * patch + kx;
        patches[idx] = img[src];
    }
}

// x[image, r, :] = (r == 0 ? class : patch_out[image * (t - 1) + r - 1, :]) + positions[r, :]
// for `n` images of `t` tokens (the class token and t - 1 patches) of width `h`.
extern "C" __global__ void vision_embed_f32(float* x, const float* patch_out, const float* cls, const float* pos, int n, int t, int h) {
    GRID_DEPENDENCY_SYNC();
    const long long total = (long long)n * t * h;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(idx % h);
        const long long row = idx / h;
        const int image = (int)(row / t);
        const int r = (int)(row % t);
        const float v = r == 0 ? cls[c] : patch_out[((long long)image * (t - 1) + r - 1) * h + c];
        x[idx] = v + pos[(long long)r * h + c];
    }
}

// LayerNorm of each `dim`-long row (one block per row): out = (x - mean) / sqrt(var + eps) * w + b,
// the variance over the centred values (two passes, as torch computes it).
extern "C" __global__ void layer_norm_f32(float* out, const float* x, const float* w, const float* b, int dim, float eps) {
    GRID_DEPENDENCY_SYNC();
    const long long base = (long long)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += x[base + i];
    const float mean = block_sum(s) / (float)dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = x[base + i] - mean;
        ss += d * d;
    }
    const float r = rsqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        out[base + i] = (x[base + i] - mean) * r * w[i] + b[i];
    }
}

// x[r, c] = act(x[r, c] + b[c]) over `rows` rows of `cols` (blocks stride over rows, threads
// over columns: no index division); act 0: none, 1: quick_gelu (x * sigmoid(1.702 x)), 2: the
// exact erf GELU.
extern "C" __global__ void bias_act_f32(float* x, const float* b, int rows, int cols, int act) {
    GRID_DEPENDENCY_SYNC();
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        float* r = x + (long long)row * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = r[c] + b[c];
            if (act == 1) {
                v = v / (1.0f + expf(-1.702f * v));
            } else if (act == 2) {
                v = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
            }
            r[c] = v;
        }
    }
}

// Softmax of each `cols`-long row in place (one block per row), the row's maximum subtracted
// first.
extern "C" __global__ void softmax_rows_f32(float* s, int cols) {
    GRID_DEPENDENCY_SYNC();
    __shared__ float warp_max[32];
    __shared__ float row_max;
    const long long base = (long long)blockIdx.x * cols;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, s[base + i]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = warp_max[0];
        for (int w = 1; w < (int)((blockDim.x + 31) >> 5); w++) v = fmaxf(v, warp_max[w]);
        row_max = v;
    }
    __syncthreads();
    const float mx = row_max;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float e = expf(s[base + i] - mx);
        s[base + i] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s[base + i] *= inv;
}
