// Thread-block clusters for the decode attention (attention_decode.cu's cluster variant): the
// PTX of sm_90's cluster registers, barrier and distributed shared memory, and the merge of a
// (row, KV head)'s split states over it. Needs attention_prefill.cu (fast_exp2) before it.

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
// Thread-block clusters (sm_90): the block's rank and the cluster's size, a barrier over the
// whole cluster (the release / acquire make each block's shared-memory writes before it
// visible to the others' reads after it), and loads from another block's shared memory.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_size() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The address of `p` (this block's shared memory) in the shared memory of cluster block `rank`.
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
__device__ __forceinline__ float cluster_load(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float2 cluster_load2(unsigned addr) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}
#define FD_CLUSTERS 1
#else
#define FD_CLUSTERS 0
#endif

// Most blocks of a cluster (the non-portable size of sm_90).
#define FD_MAX_CLUSTER 16

// The cluster variant's merge of the splits: every block of the cluster (one per split of a
// (row, KV head)) has its state in its own shared memory, the output `so_out[j][d]`
// (SO_ROW floats a head) and (max in log2 units, sum) in `ml[j]`; block `rank` merges its
// share of the group × HD outputs from all of them over DSMEM and stores it. No global
// partials, fence or counter: what the launch-wide merge pays for on its critical path.
template <typename O, int HD, int SO_ROW>
__device__ __forceinline__ void merge_cluster_states(O* out, const float* so_out, const float2* ml, int t, int g,
                                                     int group, int nq, long long lo_off) {
#if FD_CLUSTERS
    cluster_barrier();
    const int n = (int)cluster_size();
    const int rank = (int)cluster_rank();
    const int total = group * HD;
    const int share = (total + n - 1) / n;
    const int first = rank * share;
    const int last = min(total, first + share);
    for (int idx = first + (int)threadIdx.x; idx < last; idx += blockDim.x) {
        const int j = idx / HD;
        const int d = idx % HD;
        float a[FD_MAX_CLUSTER];
        float2 s[FD_MAX_CLUSTER];
        // Unrolled to the most blocks, so that every load is in flight at once.
#pragma unroll
        for (int x = 0; x < FD_MAX_CLUSTER; ++x) {
            if (x < n) {
                a[x] = cluster_load(cluster_map(so_out + j * SO_ROW + d, x));
                s[x] = cluster_load2(cluster_map(ml + j, x));
            }
        }
        float big = NEG_INF;
#pragma unroll
        for (int x = 0; x < FD_MAX_CLUSTER; ++x)
            if (x < n && s[x].y > 0.0f) big = fmaxf(big, s[x].x);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int x = 0; x < FD_MAX_CLUSTER; ++x) {
            if (x < n && s[x].y > 0.0f) {
                const float f = fast_exp2(s[x].x - big);
                num += a[x] * f;
                den += s[x].y * f;
            }
        }
        store_in(out, ((long long)t * nq + g * group + j) * HD + d, num / den, lo_off);
    }
    // No block leaves (its shared memory with it) before every block has read it.
    cluster_barrier();
#else
    __trap();  // the host launches the cluster variant on sm_90 and later only
#endif
}
