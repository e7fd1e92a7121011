// GEMMs of 17–128 rows on the tensor cores: out[r, n] = Σ_k x[r, k] · w[n, k] (decode steps
// of 9–64 sequences in bf16x2, whose GEMM inputs are stacked hi and lo rows; 17–128 in bf16),
// 16-bit x and w, f32 accumulation. cuBLAS's tiles cover such a GEMM in 8–48 blocks on 132 SMs
// and its kernels start only when the kernel before them has ended: a decode step of 64
// sequences spent 1.3 ms in them against ~0.4 ms of weight bytes (H100). Here a block owns a
// 128 × 64 output tile and one of S slices of k; the S blocks of a tile form a thread-block
// cluster and sum their partial tiles over distributed shared memory, in a fixed order (the
// same bits on every run, as graph replays need). The weights of a block's first stages,
// which no earlier kernel writes, are asked for before the PDL wait, so their DRAM latency
// overlaps the kernel before; x (the previous kernel's output) after it.
//
// Operands stage through shared memory in a ring of MG_STAGES k-chunks of 64 (cp.async), rows
// of 128 bytes whose 16-byte chunks are XOR-swizzled by the row's low three bits (ldmatrix
// then reads eight rows of one column chunk from eight different bank groups). Eight warps:
// 4 along m × 2 along n, each a 32 × 32 tile of m16n8k16 MMAs. Needs attention_prefill.cu's
// mma / ldmatrix / cp.async helpers and attention_cluster.cu's cluster primitives.
#define MG_BM 128
#define MG_BN 64
#define MG_BK 64
#define MG_STAGES 4
#define MG_THREADS 256
#define MG_A_ELEMS (MG_BM * MG_BK)
#define MG_B_ELEMS (MG_BN * MG_BK)
#define MG_STAGE_ELEMS (MG_A_ELEMS + MG_B_ELEMS)

// Most blocks of a tile's cluster (the portable cluster size).
#define MG_MAX_SPLITS 8

#if FD_CLUSTERS
__device__ __forceinline__ float4 mg_cluster_load4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
#endif

// Element offset of (row, 16-byte chunk c) in a swizzled 64-wide tile.
__device__ __forceinline__ int mg_swz(int row, int c) { return row * MG_BK + ((c ^ (row & 7)) << 3); }

// One stage's ROWS rows r0 .. r0 + ROWS - 1 of a row-major matrix of `rows` rows of k (x, or
// the weights) over k0 .. k0 + 63, swizzled; rows past `rows` read as zeros.
template <int ROWS>
__device__ __forceinline__ void mg_load(e16_t* dst, const e16_t* src, int rows, int k, int r0, int k0) {
#pragma unroll
    for (int j = 0; j < ROWS * 8 / MG_THREADS; ++j) {
        const int i = threadIdx.x + j * MG_THREADS;
        const int r = i >> 3, c = i & 7;
        const bool valid = r0 + r < rows;
        cp_async16(dst + mg_swz(r, c), src + (valid ? (long long)(r0 + r) * k + k0 + c * 8 : 0), valid);
    }
}
__device__ __forceinline__ void mg_load_w(e16_t* sb, const e16_t* w, int n, int k, int n0, int k0) {
    mg_load<MG_BN>(sb, w, n, k, n0, k0);
}
__device__ __forceinline__ void mg_load_x(e16_t* sa, const e16_t* x, int m, int k, int m0, int k0) {
    mg_load<MG_BM>(sa, x, m, k, m0, k0);
}

// A thread's accumulators: eight m16n8 fragments (four f32 each) of the block's 128 × 64 tile.
// With mma.sync warp (wm = warp % 4, wn = warp / 4) holds the 32 × 32 tile at
// (32 wm, 32 wn), fragment i its m16 tile i / 4 and n8 tile i % 4; with sm_90a's warpgroup
// MMA warpgroup warp / 4 holds rows 64 (warp / 4) .. + 63 by 64 columns, and
// wgmma's accumulator layout gives warp w % 4 rows 16 (w % 4) .. + 15 of it, fragment i the
// n8 tile i. mg_frag_row / mg_frag_col: the tile position of element e of fragment i.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(TANDEM_FP8_KV)
#define MG_WGMMA 1
#else
#define MG_WGMMA 0
#endif

__device__ __forceinline__ int mg_frag_row(int warp, int lane, int i, int e) {
    const int r = (lane >> 2) + (e >= 2 ? 8 : 0);
#if MG_WGMMA
    return (warp >> 2) * 64 + (warp & 3) * 16 + r;
#else
    return (warp & 3) * 32 + (i >> 2) * 16 + r;
#endif
}
__device__ __forceinline__ int mg_frag_col(int warp, int lane, int i, int e) {
    const int c = 2 * (lane & 3) + (e & 1);
#if MG_WGMMA
    return i * 8 + c;
#else
    return (warp >> 2) * 32 + (i & 3) * 8 + c;
#endif
}

#if MG_WGMMA
// The warpgroup's 64 × 64 tile over one staged chunk: four k16 steps of wgmma m64n64k16, x and
// the weights both K-major in the ring's 128-byte swizzle (attention_prefill_wg.cu's
// layout: rows 128 bytes apart, 8 rows a 1024-byte core-matrix group), issued as one group
// and waited for (the slot refills next iteration).
__device__ __forceinline__ void mg_chunk(float (&acc)[8][4], const e16_t* sa, const e16_t* sb, int warp) {
    const unsigned char* a = reinterpret_cast<const unsigned char*>(sa) + (warp >> 2) * 64 * 128;
    const unsigned char* b = reinterpret_cast<const unsigned char*>(sb);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < MG_BK / 16; ++kk)
        wg_mma_ss_n64(acc, wg_desc(a + kk * 32, 16, 1024), wg_desc(b + kk * 32, 16, 1024), 1);
    wg_commit();
    wg_wait<0>();
    wg_touch(acc);
}
#else
// The warp's 32 × 32 tile over one staged chunk: four k16 steps of 2 × 4 mma.sync, the
// fragments by ldmatrix.
__device__ __forceinline__ void mg_chunk(float (&acc)[8][4], const e16_t* sa, const e16_t* sb, int warp) {
    const int lane = threadIdx.x & 31;
    const int wm = warp & 3, wn = warp >> 2;
#pragma unroll
    for (int kk = 0; kk < MG_BK / 16; ++kk) {
        unsigned a[2][4], b[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            // Matrices: rows 0–7 / 8–15 of the m16 tile at k chunks 2kk, then 2kk + 1.
            const int row = wm * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ldsm_x4(a[mt], sa + mg_swz(row, kk * 2 + (lane >> 4)));
        }
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            // Matrices: columns 0–7 at k chunks 2kk, 2kk + 1, then columns 8–15 the same.
            const int row = wn * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8;
            ldsm_x4(b[np], sb + mg_swz(row, kk * 2 + ((lane >> 3) & 1)));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned* bp = b[(i & 3) >> 1] + (i & 1) * 2;
            mma_16816(acc[i], a[i >> 2], bp[0], bp[1]);
        }
    }
}
#endif

// Stores one output value: 0 writes f32, 1 adds into f32, 2 writes the 16-bit element.
template <int MODE>
__device__ __forceinline__ void mg_store(void* out, long long i, float v) {
    if (MODE == 0) {
        reinterpret_cast<float*>(out)[i] = v;
    } else if (MODE == 1) {
        reinterpret_cast<float*>(out)[i] += v;
    } else {
        reinterpret_cast<e16_t*>(out)[i] = f32_to_e16(v);
    }
}

template <int MODE>
__device__ void gemm_mid_impl(void* out, const e16_t* x, const e16_t* w, int m, int n, int k, int kslice) {
    extern __shared__ __align__(16) unsigned char mg_smem[];
    e16_t* smem = reinterpret_cast<e16_t*>(mg_smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = blockIdx.x * MG_BN, m0 = blockIdx.y * MG_BM;
    const int kbase = blockIdx.z * kslice;
    const int chunks = kslice / MG_BK;
    // The weights of every slot of the ring before the wait; x after it. Chunk c's group
    // holds its x (and, from MG_STAGES on, its weights); the first group every early weight.
#pragma unroll
    for (int s = 0; s < MG_STAGES; ++s)
        if (s < chunks) mg_load_w(smem + s * MG_STAGE_ELEMS + MG_A_ELEMS, w, n, k, n0, kbase + s * MG_BK);
    GRID_DEPENDENCY_SYNC();
#pragma unroll
    for (int s = 0; s < MG_STAGES - 1; ++s) {
        if (s < chunks) mg_load_x(smem + s * MG_STAGE_ELEMS, x, m, k, m0, kbase + s * MG_BK);
        cp_async_commit();
    }
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<MG_STAGES - 2>();
#if MG_WGMMA
        fence_smem_async();  // this thread's copies, visible to the warpgroup MMA's reads
#endif
        __syncthreads();  // chunk c is in; every warp is past chunk c - 1, whose slot refills
        const int next = c + MG_STAGES - 1;
        if (next < chunks) {
            e16_t* st = smem + (next % MG_STAGES) * MG_STAGE_ELEMS;
            if (next >= MG_STAGES) mg_load_w(st + MG_A_ELEMS, w, n, k, n0, kbase + next * MG_BK);
            mg_load_x(st, x, m, k, m0, kbase + next * MG_BK);
        }
        cp_async_commit();
        const e16_t* st = smem + (c % MG_STAGES) * MG_STAGE_ELEMS;
        mg_chunk(acc, st, st + MG_A_ELEMS, warp);
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: it holds the partial tile now
#if FD_CLUSTERS
    const unsigned splits = cluster_size();
#else
    const unsigned splits = 1;  // launched without clusters: one slice of k
#endif
    if (splits == 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + mg_frag_row(warp, lane, i, e);
                const int col = n0 + mg_frag_col(warp, lane, i, e);
                if (row < m && col < n) mg_store<MODE>(out, (long long)row * n + col, acc[i][e]);
            }
        return;
    }
#if FD_CLUSTERS
    // Split k: each block's partial tile in its shared memory (row-major, MG_BN + 4 floats a
    // row: float4-aligned, rows four banks apart), then every block sums its share of the
    // rows over the cluster's tiles, four columns at a time, every block's values asked for
    // before the sum, which takes them in rank order.
    float* part = reinterpret_cast<float*>(mg_smem);
    const int stride = MG_BN + 4;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mg_frag_row(warp, lane, i, 2 * h), col = mg_frag_col(warp, lane, i, 2 * h);
            *reinterpret_cast<float2*>(part + r * stride + col) = make_float2(acc[i][2 * h], acc[i][2 * h + 1]);
        }
    cluster_barrier();
    const int rank = (int)cluster_rank();
    const int rows = MG_BM / (int)splits;
    for (int i = threadIdx.x; i < rows * (MG_BN / 4); i += MG_THREADS) {
        const int r = rank * rows + i / (MG_BN / 4), col = (i % (MG_BN / 4)) * 4;
        const float* p = part + r * stride + col;
        float4 v[MG_MAX_SPLITS];
#pragma unroll
        for (int b = 0; b < MG_MAX_SPLITS; ++b)
            if (b < (int)splits) v[b] = mg_cluster_load4(cluster_map(p, b));
        float4 sum = v[0];
#pragma unroll
        for (int b = 1; b < MG_MAX_SPLITS; ++b)
            if (b < (int)splits) {
                sum.x += v[b].x;
                sum.y += v[b].y;
                sum.z += v[b].z;
                sum.w += v[b].w;
            }
        const int row = m0 + r, c0 = n0 + col;
        if (row < m) {
            const long long at = (long long)row * n + c0;
            if (c0 < n) mg_store<MODE>(out, at, sum.x);
            if (c0 + 1 < n) mg_store<MODE>(out, at + 1, sum.y);
            if (c0 + 2 < n) mg_store<MODE>(out, at + 2, sum.z);
            if (c0 + 3 < n) mg_store<MODE>(out, at + 3, sum.w);
        }
    }
    cluster_barrier();  // no block leaves while another still reads its tile
#endif
}

#define GEMM_MID(NAME, MODE)                                                                            \
    extern "C" __global__ void __launch_bounds__(MG_THREADS, 2)                                         \
        NAME(void* out, const e16_t* x, const e16_t* w, int m, int n, int k, int kslice) {            \
        gemm_mid_impl<MODE>(out, x, w, m, n, k, kslice);                                                \
    }

GEMM_MID(gemm_mid_f32, 0)
GEMM_MID(gemm_mid_add_f32, 1)
GEMM_MID(gemm_mid_e16, 2)
