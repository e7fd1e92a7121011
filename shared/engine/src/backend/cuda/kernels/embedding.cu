// Embedding gather: out[t, :] = table[ids[t], :] as f32. One block per token.
// Token ids are checked against the vocabulary on the host before the launch.
template <typename T>
__device__ void embedding_impl(float* out, const T* table, const unsigned int* ids, int hidden) {
    const long long row = blockIdx.x;
    const long long id = ids[row];
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[row * hidden + i] = load_f(table, id * hidden + i);
    }
}

extern "C" __global__ void embedding_f32(float* out, const float* table, const unsigned int* ids, int hidden) {
    GRID_DEPENDENCY_SYNC();
    embedding_impl(out, table, ids, hidden);
}

extern "C" __global__ void embedding_bf16(float* out, const e16_t* table, const unsigned int* ids, int hidden) {
    GRID_DEPENDENCY_SYNC();
    embedding_impl(out, table, ids, hidden);
}

// Row gather of f32 rows (the rows whose logits a step wants) into the lm_head GEMM's input
// type: out[r, :] = src[rows[r], :]. One block per output row.
template <typename O>
__device__ void gather_rows_impl(O* out, const float* src, const unsigned int* rows, int width, long long lo_off) {
    const long long r = blockIdx.x;
    const long long from = rows[r];
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        store_in(out, r * width + i, src[from * width + i], lo_off);
    }
}

extern "C" __global__ void gather_rows_f32(float* out, const float* src, const unsigned int* rows, int width, long long lo_off) {
    GRID_DEPENDENCY_SYNC();
    gather_rows_impl(out, src, rows, width, lo_off);
}

extern "C" __global__ void gather_rows_bf16(e16_t* out, const float* src, const unsigned int* rows, int width, long long lo_off) {
    GRID_DEPENDENCY_SYNC();
    gather_rows_impl(out, src, rows, width, lo_off);
}

// x[r, c] += b[c] for rows x cols (Qwen2's q/k/v and o biases after their GEMMs).
extern "C" __global__ void bias_add_f32(float* x, const float* b, int rows, int cols) {
    GRID_DEPENDENCY_SYNC();
    const long long n = (long long)rows * cols;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        x[idx] += b[idx % cols];
    }
}

// x[i] += x[half + i] for i < half: adds the lo-row half of a split-bf16 GEMM's output to its
// hi-row half (see store_in in the prelude).
extern "C" __global__ void fold_rows_f32(float* x, long long half) {
    GRID_DEPENDENCY_SYNC();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < half;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += x[half + i];
    }
}
