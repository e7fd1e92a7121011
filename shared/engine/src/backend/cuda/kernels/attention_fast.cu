// Paged attention, the fast path for decode and prefill alike (flash-decoding style).
//
// Grid (tokens, nkv, splits); block ATT_WARPS warps. One block serves one token and one KV
// head with all the q heads of its group (GQA: each K/V row is read once for the group).
// Each lane owns E = ceil(head_dim / 32) consecutive elements of a head; the warps of the
// block take runs of ATT_UNROLL positions round-robin (the next run's K/V loads issued before
// the current run's math, so each warp keeps two runs of loads in flight), each keeping a running (max, sum, acc)
// per q head, so the dot product is a warp shuffle reduction with no block barrier per
// position. The warps' states merge in shared memory at the end (dynamic shared memory of
// ATT_WARPS * group * head_dim floats).
//
// Long contexts with few (token, head) pairs split the positions over `splits` blocks
// (blockIdx.z): each writes its partial state to `part_acc` / `part_ml`, and the block that
// finishes last (an atomic counter per (token, head), reset by that block) merges them, so a
// step is still one launch. Online softmax in f32, as the CPU decoder's attention.
#define ATT_WARPS 4
#define ATT_HDMAX 256
#ifndef ATT_UNROLL
#define ATT_UNROLL 4
#endif

// A lane's E elements of a head row as loaded (converted to f32 only when used, so a run of
// prefetched rows costs half the registers in bf16): four bf16 are one 8-byte load.
template <typename T, int E>
struct RowRaw {
    T v[E];
};
template <>
struct RowRaw<e16_t, 4> {
    uint2 v;
};
template <>
struct RowRaw<h16_t, 4> {
    uint2 v;
};

// Loads elements d0 .. d0+E of the head row starting at element `base` (zero past head_dim).
template <typename T, int E>
__device__ __forceinline__ void load_raw(const T* pool, long long base, int d0, int head_dim, RowRaw<T, E>& out) {
#pragma unroll
    for (int e = 0; e < E; ++e) out.v[e] = d0 + e < head_dim ? pool[base + d0 + e] : T{};
}
__device__ __forceinline__ void load_raw(const e16_t* pool, long long base, int d0, int head_dim, RowRaw<e16_t, 4>& out) {
    if ((head_dim & 3) == 0 && d0 + 4 <= head_dim) {
        out.v = *reinterpret_cast<const uint2*>(pool + base + d0);
    } else {
        unsigned int e[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) e[i] = d0 + i < head_dim ? pool[base + d0 + i] : 0u;
        out.v = make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
    }
}

__device__ __forceinline__ void load_raw(const h16_t* pool, long long base, int d0, int head_dim, RowRaw<h16_t, 4>& out) {
    load_raw(reinterpret_cast<const e16_t*>(pool), base, d0, head_dim, *reinterpret_cast<RowRaw<e16_t, 4>*>(&out));
}

template <typename T, int E>
__device__ __forceinline__ void unpack(const RowRaw<T, E>& r, float (&out)[E]) {
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = load_f(r.v, e);
}
__device__ __forceinline__ void unpack(const RowRaw<e16_t, 4>& r, float (&out)[4]) {
    out[0] = e16_lo(r.v.x);
    out[1] = e16_hi(r.v.x);
    out[2] = e16_lo(r.v.y);
    out[3] = e16_hi(r.v.y);
}
__device__ __forceinline__ void unpack(const RowRaw<h16_t, 4>& r, float (&out)[4]) {
    out[0] = h16_to_f32((unsigned short)(r.v.x & 0xffffu));
    out[1] = h16_to_f32((unsigned short)(r.v.x >> 16));
    out[2] = h16_to_f32((unsigned short)(r.v.y & 0xffffu));
    out[3] = h16_to_f32((unsigned short)(r.v.y >> 16));
}

// exp(m - M) as a merge weight, 0 for an empty state (l == 0, m == -inf).
__device__ __forceinline__ float merge_weight(float m, float l, float big) {
    return l > 0.0f ? expf(m - big) : 0.0f;
}

// Splits and q heads per KV head the merge below serves (MAX_SPLITS and the decode kernel's
// group limit on the Rust side).
#define MERGE_MAX_SPLITS 32
#define MERGE_MAX_GROUP 16

// The block of (token x = bx, KV head g) that finishes last of its `splits` merges every
// split's partial state (part_acc / part_ml, `group` q heads of `head_dim`) into the output
// rows of token t; the others return. A pair's states start `slots` states apart (the grid's
// z extent: the decode kernel merges fewer splits than that for a row with fewer runs of keys,
// and each row must keep to its own slots). Its counter is reset for the next launch. The splits'
// weights exp(m - max) / Σ l·exp(m - max) are found once per head (a warp per head, a lane
// per split: one round of loads, not a dependent walk over the splits per output element),
// then each output element sums its splits' accumulators with independent loads.
template <typename O>
__device__ void merge_split_states(O* out, const float* part_acc, const float* part_ml, unsigned int* counters,
                                   int bx, int g, int nkv, int splits, int slots, int group, int head_dim, int t,
                                   int nq, long long lo_off) {
    __shared__ bool last;
    __shared__ float weights[MERGE_MAX_GROUP][MERGE_MAX_SPLITS];
    __threadfence();
    __syncthreads();
    unsigned int* counter = counters + (long long)bx * nkv + g;
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long long p0 = ((long long)bx * nkv + g) * slots;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    for (int j = warp; j < group; j += blockDim.x >> 5) {
        float pm = NEG_INF, pl = 0.0f;
        if (lane < splits) {
            pm = __ldcg(part_ml + ((p0 + lane) * group + j) * 2);
            pl = __ldcg(part_ml + ((p0 + lane) * group + j) * 2 + 1);
        }
        float big = pm;
        for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
        const float f = merge_weight(pm, pl, big);
        const float sum = warp_sum(pl * f);
        if (lane < splits) weights[j][lane] = f / sum;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * head_dim; idx += blockDim.x) {
        const int j = idx / head_dim;
        const int d = idx % head_dim;
        const float* acc = part_acc + (p0 * group + j) * head_dim + d;
        const long long stride = (long long)group * head_dim;
        // Unrolled to the most splits, so that all the loads are in flight at once.
        float a = 0.0f;
#pragma unroll
        for (int x = 0; x < MERGE_MAX_SPLITS; ++x) {
            if (x < splits) a += __ldcg(acc + x * stride) * weights[j][x];
        }
        store_in(out, (long long)t * nq * head_dim + (long long)(g * group + j) * head_dim + d, a, lo_off);
    }
    if (threadIdx.x == 0) *counter = 0u;  // ready for the next launch
}

template <typename T, typename O, int E, int G>
__device__ void attention_fast_impl(O* out, const float* qkv, int row_stride, const T* pool,
                                    const int* tables, const int* table_start, const int* positions,
                                    const int* lo_pos, int nq, int nkv, int head_dim, int block_size,
                                    int layer, int num_layers, float scale, float* part_acc,
                                    float* part_ml, unsigned int* counters, long long lo_off,
                                    const int* token_list) {
    // With a token list, block x serves token token_list[x] (the single-token rows of a step
    // whose prefill chunks go to attention_prefill); the split scratch is indexed by x.
    const int bx = blockIdx.x;
    const int t = token_list != nullptr ? token_list[bx] : bx;
    const int g = blockIdx.y;
    const int s = blockIdx.z;
    const int splits = gridDim.z;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int d0 = lane * E;
    const long long kvd = (long long)nkv * head_dim;
    const long long part_e = (long long)block_size * kvd;
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;

    // Sized by the group (a template parameter), so the per-head state stays in registers
    // and occupancy stays high.
    float q[G][E];
    float m[G], l[G], acc[G][E];
    const float* qrow = qkv + (long long)t * row_stride + (long long)g * G * head_dim;
#pragma unroll
    for (int j = 0; j < G; ++j) {
        m[j] = NEG_INF;
        l[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = d0 + e;
            q[j][e] = d < head_dim ? qrow[j * head_dim + d] : 0.0f;
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
    // Software pipelined: the next run's K/V loads are issued before this run's math, so each
    // warp keeps two runs of loads in flight.
    const int stride = ATT_WARPS * ATT_UNROLL;
    RowRaw<T, E> kn[ATT_UNROLL], vn[ATT_UNROLL];
    auto issue = [&](int p0) {
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) {
            const int p = min(p0 + u, end - 1);  // past the end: a valid row, weight 0 below
            const long long base = (long long)table[p / block_size] * block_e + (long long)layer * layer_e +
                                   (long long)(p % block_size) * kvd + (long long)g * head_dim;
            load_raw(pool, base, d0, head_dim, kn[u]);
            load_raw(pool, base + part_e, d0, head_dim, vn[u]);
        }
    };
    if (beg + warp * ATT_UNROLL < end) issue(beg + warp * ATT_UNROLL);
    for (int p0 = beg + warp * ATT_UNROLL; p0 < end; p0 += stride) {
        float k[ATT_UNROLL][E], v[ATT_UNROLL][E];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) {
            unpack(kn[u], k[u]);
            unpack(vn[u], v[u]);
        }
        if (p0 + stride < end) issue(p0 + stride);
        // Scores of the run (independent shuffle reductions), then one online-softmax update
        // per q head: the serial chain is per run, not per position.
#pragma unroll
        for (int j = 0; j < G; ++j) {
            float sc[ATT_UNROLL];
            float big = m[j];
#pragma unroll
            for (int u = 0; u < ATT_UNROLL; ++u) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) dot += q[j][e] * k[u][e];
                sc[u] = p0 + u < end ? warp_sum(dot) * scale : NEG_INF;
                big = fmaxf(big, sc[u]);
            }
            const float corr = expf(m[j] - big);
            l[j] *= corr;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[j][e] *= corr;
#pragma unroll
            for (int u = 0; u < ATT_UNROLL; ++u) {
                const float w = expf(sc[u] - big);  // 0 past the end
                l[j] += w;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[j][e] += w * v[u][e];
            }
            m[j] = big;
        }
    }

    // Merge the warps' states.
    __shared__ float sm_m[ATT_WARPS][G];
    __shared__ float sm_l[ATT_WARPS][G];
    extern __shared__ float sm_acc[];  // [ATT_WARPS][G][head_dim]
#pragma unroll
    for (int j = 0; j < G; ++j) {
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
    const long long pi = ((long long)bx * nkv + g) * splits + s;
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
            store_in(out, (long long)t * nq * head_dim + (long long)(g * G + j) * head_dim + d, a / sum, lo_off);
        } else {
            part_acc[(pi * G + j) * head_dim + d] = a;
            if (d == 0) {
                part_ml[(pi * G + j) * 2] = big;
                part_ml[(pi * G + j) * 2 + 1] = sum;
            }
        }
    }
    if (splits == 1) return;
    merge_split_states(out, part_acc, part_ml, counters, bx, g, nkv, splits, splits, G, head_dim, t, nq, lo_off);
}

// One entry point per (pool type, output type, elements per lane, q heads per KV head).
#define ATTENTION_FAST(NAME, T, O, E, G)                                                                \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) NAME(                                 \
        O* out, const float* qkv, int row_stride, const T* pool, const int* tables,                    \
        const int* table_start, const int* positions, const int* lo_pos, int nq, int nkv, int head_dim, \
        int block_size, int layer, int num_layers, float scale, float* part_acc, float* part_ml,       \
        unsigned int* counters, long long lo_off, const int* token_list) { GRID_DEPENDENCY_SYNC();                             \
        attention_fast_impl<T, O, E, G>(out, qkv, row_stride, pool, tables, table_start, positions,    \
                                        lo_pos, nq, nkv, head_dim, block_size, layer, num_layers,      \
                                        scale, part_acc, part_ml, counters, lo_off, token_list);       \
    }

// The instances are not listed here: the engine compiles the one a model needs on first use
// (kernels.rs appends `ATTENTION_FAST(name, T, O, E, G)`), since all 96 of them take NVRTC
// and the driver half a minute.
