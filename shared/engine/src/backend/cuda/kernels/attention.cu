// Paged attention, straightforward (correct, not yet fast): one block per (token, q head),
// one thread per element of the head (blockDim.x = head_dim rounded up to 32). The token at
// position pos attends to positions lo_pos[t] ..= pos of its sequence, read from the paged
// pool through its block table (tables[table_start[t] + p / block_size]), so decode, prefill
// and chunked prefill over a cached prefix take the same path; this step's K/V must already
// be in the pool (kv_write). Softmax is the online (running max) form, in f32. Grouped-query:
// q head h reads KV head h / (nq / nkv). q is qkv[t, h*head_dim ..] (rows row_stride apart);
// out is [tokens, nq * head_dim].
template <typename T>
__device__ void attention_impl(float* out, const float* qkv, int row_stride, const T* pool,
                               const int* tables, const int* table_start, const int* positions,
                               const int* lo_pos, int nq, int nkv, int head_dim, int block_size,
                               int layer, int num_layers, float scale) {
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int kvh = h / (nq / nkv);
    const int i = threadIdx.x;
    const bool active = i < head_dim;
    const long long kvd = (long long)nkv * head_dim;
    const long long part_e = (long long)block_size * kvd;
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;
    const float q = active ? qkv[(long long)t * row_stride + (long long)h * head_dim + i] : 0.0f;
    const int* table = tables + table_start[t];
    float m = NEG_INF;
    float l = 0.0f;
    float acc = 0.0f;
    const int pos = positions[t];
    for (int p = lo_pos[t]; p <= pos; ++p) {
        const long long base = (long long)table[p / block_size] * block_e + (long long)layer * layer_e +
                               (long long)(p % block_size) * kvd + (long long)kvh * head_dim;
        const float k = active ? load_f(pool, base + i) : 0.0f;
        const float s = block_sum(q * k) * scale;
        const float m2 = fmaxf(m, s);
        const float corr = expf(m - m2);
        const float e = expf(s - m2);
        const float v = active ? load_f(pool, base + part_e + i) : 0.0f;
        acc = acc * corr + e * v;
        l = l * corr + e;
        m = m2;
    }
    if (active) out[(long long)t * nq * head_dim + (long long)h * head_dim + i] = acc / l;
}

extern "C" __global__ void attention_f32(float* out, const float* qkv, int row_stride, const float* pool,
                                         const int* tables, const int* table_start, const int* positions,
                                         const int* lo_pos, int nq, int nkv, int head_dim, int block_size,
                                         int layer, int num_layers, float scale) {
    attention_impl(out, qkv, row_stride, pool, tables, table_start, positions, lo_pos, nq, nkv, head_dim,
                   block_size, layer, num_layers, scale);
}

extern "C" __global__ void attention_bf16(float* out, const float* qkv, int row_stride, const bf16_t* pool,
                                          const int* tables, const int* table_start, const int* positions,
                                          const int* lo_pos, int nq, int nkv, int head_dim, int block_size,
                                          int layer, int num_layers, float scale) {
    attention_impl(out, qkv, row_stride, pool, tables, table_start, positions, lo_pos, nq, nkv, head_dim,
                   block_size, layer, num_layers, scale);
}
