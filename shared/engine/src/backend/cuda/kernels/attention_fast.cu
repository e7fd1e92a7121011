// Paged attention, the fast path for decode and prefill alike (flash-decoding style).
//
// Grid (tokens, nkv, splits); block ATT_WARPS warps. One block serves one token and one KV
// head with all the q heads of its group (GQA: each K/V row is read once for the group).
// Each lane owns E = ceil(head_dim / 32) consecutive elements of a head; the warps of the
// block take runs of ATT_UNROLL positions round-robin (all their K/V loads issued before any
// use, so each warp keeps several loads in flight), each keeping a running (max, sum, acc)
// per q head, so the dot product is a warp shuffle reduction with no block barrier per
// position. The warps' states merge in shared memory at the end (dynamic shared memory of
// ATT_WARPS * group * head_dim floats).
//
// Long contexts with few (token, head) pairs split the positions over `splits` blocks
// (blockIdx.z): each writes its partial state to `part_acc` / `part_ml`, and the block that
// finishes last (an atomic counter per (token, head), reset by that block) merges them, so a
// step is still one launch. The math is attention_impl's (online softmax in f32).
#define ATT_WARPS 4
#define ATT_GMAX 8
#define ATT_HDMAX 256
#define ATT_UNROLL 4

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// exp(m - M) as a merge weight, 0 for an empty state (l == 0, m == -inf).
__device__ __forceinline__ float merge_weight(float m, float l, float big) {
    return l > 0.0f ? expf(m - big) : 0.0f;
}

template <typename T, typename O, int E>
__device__ void attention_fast_impl(O* out, const float* qkv, int row_stride, const T* pool,
                                    const int* tables, const int* table_start, const int* positions,
                                    const int* lo_pos, int nq, int nkv, int head_dim, int block_size,
                                    int layer, int num_layers, float scale, float* part_acc,
                                    float* part_ml, unsigned int* counters) {
    const int t = blockIdx.x;
    const int g = blockIdx.y;
    const int s = blockIdx.z;
    const int splits = gridDim.z;
    const int G = nq / nkv;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int d0 = lane * E;
    const long long kvd = (long long)nkv * head_dim;
    const long long part_e = (long long)block_size * kvd;
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;

    float q[ATT_GMAX][E];
    float m[ATT_GMAX], l[ATT_GMAX], acc[ATT_GMAX][E];
    const float* qrow = qkv + (long long)t * row_stride + (long long)g * G * head_dim;
#pragma unroll
    for (int j = 0; j < ATT_GMAX; ++j) {
        m[j] = NEG_INF;
        l[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = d0 + e;
            q[j][e] = (j < G && d < head_dim) ? qrow[j * head_dim + d] : 0.0f;
            acc[j][e] = 0.0f;
        }
    }
    const int* table = tables + table_start[t];
    const int pos = positions[t];
    const int lo = lo_pos[t];
    const int n = pos - lo + 1;
    const int chunk = (n + splits - 1) / splits;
    const int beg = lo + s * chunk;
    const int end = min(pos + 1, beg + chunk);
    for (int p0 = beg + warp * ATT_UNROLL; p0 < end; p0 += ATT_WARPS * ATT_UNROLL) {
        float k[ATT_UNROLL][E], v[ATT_UNROLL][E];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) {
            const int p = p0 + u;
            const bool in = p < end;
            const long long base = in ? (long long)table[p / block_size] * block_e + (long long)layer * layer_e +
                                            (long long)(p % block_size) * kvd + (long long)g * head_dim
                                      : 0;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const int d = d0 + e;
                k[u][e] = (in && d < head_dim) ? load_f(pool, base + d) : 0.0f;
                v[u][e] = (in && d < head_dim) ? load_f(pool, base + part_e + d) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) {
            if (p0 + u >= end) break;  // uniform over the warp
#pragma unroll
            for (int j = 0; j < ATT_GMAX; ++j) {
                if (j >= G) break;
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) dot += q[j][e] * k[u][e];
                const float sc = warp_sum(dot) * scale;
                const float m2 = fmaxf(m[j], sc);
                const float corr = expf(m[j] - m2);
                const float w = expf(sc - m2);
                l[j] = l[j] * corr + w;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[j][e] = acc[j][e] * corr + w * v[u][e];
                m[j] = m2;
            }
        }
    }

    // Merge the warps' states.
    __shared__ float sm_m[ATT_WARPS][ATT_GMAX];
    __shared__ float sm_l[ATT_WARPS][ATT_GMAX];
    extern __shared__ float sm_acc[];  // [ATT_WARPS][G][head_dim]
#pragma unroll
    for (int j = 0; j < ATT_GMAX; ++j) {
        if (j >= G) break;
        if (lane == 0) {
            sm_m[warp][j] = m[j];
            sm_l[warp][j] = l[j];
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = d0 + e;
            if (d < head_dim) sm_acc[(warp * G + j) * head_dim + d] = acc[j][e];
        }
    }
    __syncthreads();
    const long long pi = ((long long)t * nkv + g) * splits + s;
    for (int idx = threadIdx.x; idx < G * head_dim; idx += blockDim.x) {
        const int j = idx / head_dim;
        const int d = idx % head_dim;
        float big = NEG_INF;
        for (int w = 0; w < ATT_WARPS; ++w) big = fmaxf(big, sm_m[w][j]);
        float sum = 0.0f, a = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) {
            const float f = merge_weight(sm_m[w][j], sm_l[w][j], big);
            sum += sm_l[w][j] * f;
            a += sm_acc[(w * G + j) * head_dim + d] * f;
        }
        if (splits == 1) {
            store_f(out, (long long)t * nq * head_dim + (long long)(g * G + j) * head_dim + d, a / sum);
        } else {
            part_acc[(pi * G + j) * head_dim + d] = a;
            if (d == 0) {
                part_ml[(pi * G + j) * 2] = big;
                part_ml[(pi * G + j) * 2 + 1] = sum;
            }
        }
    }
    if (splits == 1) return;

    // The last split block of this (token, head) merges every split's state.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    unsigned int* counter = counters + (long long)t * nkv + g;
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long long p0 = ((long long)t * nkv + g) * splits;
    for (int idx = threadIdx.x; idx < G * head_dim; idx += blockDim.x) {
        const int j = idx / head_dim;
        const int d = idx % head_dim;
        float big = NEG_INF;
        for (int x = 0; x < splits; ++x) big = fmaxf(big, __ldcg(part_ml + ((p0 + x) * G + j) * 2));
        float sum = 0.0f, a = 0.0f;
        for (int x = 0; x < splits; ++x) {
            const float pm = __ldcg(part_ml + ((p0 + x) * G + j) * 2);
            const float pl = __ldcg(part_ml + ((p0 + x) * G + j) * 2 + 1);
            const float f = merge_weight(pm, pl, big);
            sum += pl * f;
            a += __ldcg(part_acc + ((p0 + x) * G + j) * head_dim + d) * f;
        }
        store_f(out, (long long)t * nq * head_dim + (long long)(g * G + j) * head_dim + d, a / sum);
    }
    if (threadIdx.x == 0) *counter = 0u;  // ready for the next launch
}

// One entry point per (pool type, output type, elements per lane).
#define ATTENTION_FAST(NAME, T, O, E)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) NAME(                                 \
        O* out, const float* qkv, int row_stride, const T* pool, const int* tables,                    \
        const int* table_start, const int* positions, const int* lo_pos, int nq, int nkv, int head_dim, \
        int block_size, int layer, int num_layers, float scale, float* part_acc, float* part_ml,       \
        unsigned int* counters) {                                                                      \
        attention_fast_impl<T, O, E>(out, qkv, row_stride, pool, tables, table_start, positions,       \
                                     lo_pos, nq, nkv, head_dim, block_size, layer, num_layers, scale,  \
                                     part_acc, part_ml, counters);                                     \
    }

ATTENTION_FAST(attention_fast_f32_f32_e1, float, float, 1)
ATTENTION_FAST(attention_fast_f32_f32_e2, float, float, 2)
ATTENTION_FAST(attention_fast_f32_f32_e4, float, float, 4)
ATTENTION_FAST(attention_fast_f32_f32_e8, float, float, 8)
ATTENTION_FAST(attention_fast_f32_bf16_e1, float, bf16_t, 1)
ATTENTION_FAST(attention_fast_f32_bf16_e2, float, bf16_t, 2)
ATTENTION_FAST(attention_fast_f32_bf16_e4, float, bf16_t, 4)
ATTENTION_FAST(attention_fast_f32_bf16_e8, float, bf16_t, 8)
ATTENTION_FAST(attention_fast_bf16_f32_e1, bf16_t, float, 1)
ATTENTION_FAST(attention_fast_bf16_f32_e2, bf16_t, float, 2)
ATTENTION_FAST(attention_fast_bf16_f32_e4, bf16_t, float, 4)
ATTENTION_FAST(attention_fast_bf16_f32_e8, bf16_t, float, 8)
ATTENTION_FAST(attention_fast_bf16_bf16_e1, bf16_t, bf16_t, 1)
ATTENTION_FAST(attention_fast_bf16_bf16_e2, bf16_t, bf16_t, 2)
ATTENTION_FAST(attention_fast_bf16_bf16_e4, bf16_t, bf16_t, 4)
ATTENTION_FAST(attention_fast_bf16_bf16_e8, bf16_t, bf16_t, 8)
