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
    embedding_impl(out, table, ids, hidden);
}

extern "C" __global__ void embedding_bf16(float* out, const bf16_t* table, const unsigned int* ids, int hidden) {
    embedding_impl(out, table, ids, hidden);
}
