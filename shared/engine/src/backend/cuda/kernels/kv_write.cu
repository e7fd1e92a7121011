// Stores each token's K and V (all KV heads) into the paged pool, at the address function of
// kv/layout.rs (version 1), counted in elements:
//   block * block_e + layer * layer_e + part * part_e + slot * kvd + i
//   part_e = block_size * kvd, layer_e = 2 * part_e, block_e = num_layers * layer_e.
// K is qkv[t, k_off .. k_off + kvd], V the kvd values after it. token_block[t] is the physical
// block of the token (block_table[pos / block_size], resolved on the host), slot = pos % block_size.
// One block per token.
template <typename T>
__device__ void kv_write_impl(T* pool, const float* qkv, int row_stride, int k_off, int kvd,
                              const int* token_block, const int* positions, int block_size,
                              int layer, int num_layers) {
    const int t = blockIdx.x;
    const long long part_e = (long long)block_size * kvd;
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;
    const long long slot = positions[t] % block_size;
    const long long base = (long long)token_block[t] * block_e + (long long)layer * layer_e + slot * kvd;
    const float* row = qkv + (long long)t * row_stride + k_off;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        store_f(pool, base + i, row[i]);
        store_f(pool, base + part_e + i, row[kvd + i]);
    }
}

extern "C" __global__ void kv_write_f32(float* pool, const float* qkv, int row_stride, int k_off, int kvd,
                                        const int* token_block, const int* positions, int block_size,
                                        int layer, int num_layers) {
    GRID_DEPENDENCY_SYNC();
    kv_write_impl(pool, qkv, row_stride, k_off, kvd, token_block, positions, block_size, layer, num_layers);
}

extern "C" __global__ void kv_write_bf16(e16_t* pool, const float* qkv, int row_stride, int k_off, int kvd,
                                         const int* token_block, const int* positions, int block_size,
                                         int layer, int num_layers) {
    GRID_DEPENDENCY_SYNC();
    kv_write_impl(pool, qkv, row_stride, k_off, kvd, token_block, positions, block_size, layer, num_layers);
}

extern "C" __global__ void kv_write_h16(h16_t* pool, const float* qkv, int row_stride, int k_off, int kvd,
                                        const int* token_block, const int* positions, int block_size,
                                        int layer, int num_layers) {
    GRID_DEPENDENCY_SYNC();
    kv_write_impl(pool, qkv, row_stride, k_off, kvd, token_block, positions, block_size, layer, num_layers);
}
