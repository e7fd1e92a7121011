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

// The FP8 pool's write: grid (tokens, nkv), one warp per (token, KV head), which stores the
// head's K and V codes and their two scales (prelude.cu's rule; the part's scales after its
// slots, see kv/layout.rs).
extern "C" __global__ void kv_write_fp8(f8_t* pool, const float* qkv, int row_stride, int k_off, int kvd,
                                        const int* token_block, const int* positions, int block_size,
                                        int layer, int num_layers) {
    GRID_DEPENDENCY_SYNC();
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int nkv = gridDim.y;
    const int hd = kvd / nkv;
    const int lane = threadIdx.x;
    const long long part_e = kv_part_e<f8_t>(block_size, kvd, nkv);
    const long long slot = positions[t] % block_size;
    const long long base = (long long)token_block[t] * num_layers * 2 * part_e + (long long)layer * 2 * part_e;
    const float* row = qkv + (long long)t * row_stride + k_off + (long long)h * hd;
    for (int part = 0; part < 2; ++part) {
        const float* x = row + part * kvd;
        float amax = 0.0f;
        for (int i = lane; i < hd; i += 32) amax = fmaxf(amax, fabsf(x[i]));
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float inv = e4m3_inv_scale(amax);
        const long long at = base + part * part_e + slot * kvd + (long long)h * hd;
        for (int i = lane; i < hd; i += 32) pool[at + i].bits = f32_to_e4m3(x[i] * inv);
        if (lane == 0) {
            const long long sat = base + part * part_e + (long long)block_size * kvd + (slot * nkv + h) * 4;
            *reinterpret_cast<float*>(&pool[sat]) = e4m3_scale(amax);
        }
    }
}
