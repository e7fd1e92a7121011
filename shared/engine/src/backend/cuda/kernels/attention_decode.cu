// Decode attention on tensor cores over a 16-bit pool (bf16, or f16 in the f16 program): the
// single-token rows of a step (decode), when there are enough of them to fill the GPU.
//
// Grid (rows, nkv, splits); block 4 warps. Block x serves token token_list[x] and one KV head.
// The products are computed transposed, S^T = K·Q^T and O^T = V^T·P^T, so that the keys and
// the head dimension fill the m16 side of mma.sync m16n8k16 and the group's q heads (at most 8
// per n8 tile, NH tiles) the narrow side: a group of two heads in m16 rows wasted 7/8 of each
// mma and held 16 × 8 output registers per lane where 8 × 4 do now. K comes in as A fragments
// (ldmatrix), V^T as A fragments (ldmatrix.trans), Q^T as B fragments from registers, and the
// probabilities' accumulator fragment becomes P^T's B fragment by an in-register transpose
// (movmatrix). The keys [lo, pos] are cut into runs of FA_BK, whole runs per split
// (blockIdx.z); the block stages each run as attention_prefill.cu does (stage_kv_run:
// cp.async, double buffered, or single buffered when the launch gives shared memory for one
// stage) and warp w computes keys 16w .. 16w + 16 of it with its own
// online softmax. The four warps' states merge in shared memory, and with splits > 1 the
// splits merge as in attention_fast.cu (the last block of a (row, head) does it).
// Needs attention_prefill.cu (staging, mma, ldmatrix, exp2 helpers), attention_fast.cu
// (merge_split_states) and attention_cluster.cu (merge_cluster_states) before it in the
// program.
#define FD_WARPS 4
#define FD_WK (FA_BK / FD_WARPS)
// Row stride (floats) of the warps' output states in shared memory: padded so that the four
// lanes of a quad (heads 2qc, 2qc + 1) store to different banks.
#define FD_SO_PAD 4

// An 8×8 b16 matrix in fragment layout (lane: row lane / 4, columns 2 (lane % 4) and + 1),
// transposed across the warp.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Q^T as B fragments (k16 × n8 per (tile, k chunk)): the lane's column is q head
// g * group + 8 nt + qr (heads past the group repeat the group's first, and are dropped), its
// rows the head dimensions 16 kc + 2 qc, + 1 and the same + 8.
template <int HD, int NH>
__device__ __forceinline__ void load_q_b_fragments(unsigned (&qb)[NH][HD / 16][2], const float* qrow, int g,
                                                   int group) {
    const int qr = (threadIdx.x & 31) >> 2;
    const int qc = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < NH; ++nt) {
        const int j = nt * 8 + qr;
        const float* q = qrow + (long long)(g * group + (j < group ? j : 0)) * HD + 2 * qc;
#pragma unroll
        for (int kc = 0; kc < HD / 16; ++kc) {
            const float2 lo = *reinterpret_cast<const float2*>(q + kc * 16);
            const float2 hi = *reinterpret_cast<const float2*>(q + kc * 16 + 8);
            qb[nt][kc][0] = pack_e16(lo.x, lo.y);
            qb[nt][kc][1] = pack_e16(hi.x, hi.y);
        }
    }
}

// The keys [beg, end) of split `sp` of `splits` over a row's keys [lo, pos], in whole runs of
// FA_BK spread evenly (split sp takes runs [sp·runs / splits, (sp + 1)·runs / splits)); with
// more splits than runs some take none, beg >= end.
__device__ __forceinline__ int2 split_keys(int lo, int pos, int splits, int sp) {
    const int runs = (pos - lo + FA_BK) / FA_BK;
    const int beg = lo + (sp * runs / splits) * FA_BK;
    return make_int2(beg, min(pos + 1, lo + ((sp + 1) * runs / splits) * FA_BK));
}

template <typename O, int HD, int NH, bool CLUSTER>
__device__ void attention_decode_impl(O* out, const float* qkv, int row_stride, const kv_t* pool,
                                      const int* tables, const int* table_start, const int* positions,
                                      const int* lo_pos, const int* token_list, int nq, int nkv, int group,
                                      int block_size, int layer, int num_layers, float scale, float* part_acc,
                                      float* part_ml, unsigned int* counters, long long lo_off) {
    constexpr int ROW = HD + FA_PAD;
    constexpr int SO_ROW = HD + FD_SO_PAD;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    e16_t* smem = reinterpret_cast<e16_t*>(fa_smem);
    const int bx = blockIdx.x;
    const int t = token_list[bx];
    const int g = blockIdx.y;
    const int sp = blockIdx.z;
    // Blocks past the row's runs of keys do nothing, and the merge counts only the others
    // (the grid's splits are fixed when a graph is captured, the context grows under it;
    // idle blocks in the merge cost batch 1 2%). The cluster variant keeps them all (its
    // barriers count every block of the cluster).
    const int splits =
        CLUSTER ? (int)gridDim.z : min((int)gridDim.z, (positions[t] - lo_pos[t] + FA_BK) / FA_BK);
    if (sp >= splits) return;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int qr = lane >> 2;
    const int qc = lane & 3;
    const int mi = lane >> 3;  // ldmatrix: the matrix this lane addresses
    const int mr = lane & 7;   // and its row
    const long long kvd = (long long)nkv * HD;
    const long long part_e = kv_part_e<kv_t>(block_size, kvd, nkv);
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;
#ifdef TANDEM_FP8_KV
    // FP8: the runs are staged as bytes after one 16-bit slot, which each run is dequantised
    // into before the math (stage_kv_run_fp8, dequant_kv_run); `st` then names a byte stage.
    unsigned char* raw = fa_smem + FP8_WIDE_BYTES(HD);
    constexpr int RAW = FP8_RAW_BYTES(HD);
#endif

    // The block's keys, staged before the q fragments.
    int2 keys = make_int2(0, 0);
    // Two shared-memory stages (the next run loads while this one computes) when the launch
    // gave the memory for them, else one (more blocks per SM hide each other's loads instead).
    // early2: the block's first two runs were both staged before the wait.
    bool ring = false, early2 = false;
    {
        const int* table = tables + table_start[t];
        const int pos = positions[t];
        const long long layer_off = (long long)layer * layer_e;
        keys = split_keys(lo_pos[t], pos, splits, sp);
        const int beg = keys.x;
        const int end = keys.y;
        unsigned smem_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
#ifdef TANDEM_FP8_KV
        ring = smem_bytes >= FP8_WIDE_BYTES(HD) + 2 * RAW;
#else
        ring = smem_bytes >= 2 * 2 * FA_BK * ROW * sizeof(e16_t);
#endif
        early2 = ring && beg + FA_BK < end;
        // The first run (and with two stages the second) into shared memory before the wait on
        // the kernel before this one (the q/k norm, whose KV write is the only write to these
        // keys in this step, at `pos`): every other key was written by an earlier step, so its
        // DRAM latency overlaps that kernel. The row of `pos` follows after the wait, into the
        // stage that holds it. (A block with two runs otherwise met the second's latency after
        // the wait, while a cluster's other blocks waited for it at the barrier.)
#ifdef TANDEM_FP8_KV
        if (beg < end)
            stage_kv_run_fp8<HD, true>(raw, pool, table, beg, end, block_size, block_e, layer_off, kvd, part_e, g,
                                       pos);
        if (early2)
            stage_kv_run_fp8<HD, true>(raw + RAW, pool, table, beg + FA_BK, end, block_size, block_e, layer_off, kvd,
                                       part_e, g, pos);
#else
        if (beg < end)
            stage_kv_run<HD, true>(smem, pool, table, beg, end, block_size, block_e, layer_off, kvd, part_e, g, pos);
        if (early2)
            stage_kv_run<HD, true>(smem + 2 * FA_BK * ROW, pool, table, beg + FA_BK, end, block_size, block_e,
                                   layer_off, kvd, part_e, g, pos);
#endif
        GRID_DEPENDENCY_SYNC();
        const int r = pos - beg;  // the own key's row in the staged runs: stage r / FA_BK
#ifdef TANDEM_FP8_KV
        if (beg < end && r < (early2 ? 2 : 1) * FA_BK) {
            const unsigned char* p8 = reinterpret_cast<const unsigned char*>(pool);
            const long long part = (long long)table[pos / block_size] * block_e + layer_off;
            const long long slot = pos % block_size;
            unsigned char* st8 = raw + (r / FA_BK) * RAW;
            const int kr = r % FA_BK;
            if (threadIdx.x < HD / 16) {
                const int c = threadIdx.x * 16;
                const long long at = part + slot * kvd + (long long)g * HD + c;
                cp_async16(st8 + kr * HD + c, p8 + at, true);
                cp_async16(st8 + FA_BK * HD + kr * HD + c, p8 + at + part_e, true);
            } else if (threadIdx.x == HD / 16) {
                const long long sat = part + (long long)block_size * kvd + (slot * nkv + g) * 4;
                float* sc = reinterpret_cast<float*>(st8 + 2 * FA_BK * HD);
                cp_async4(sc + kr, p8 + sat, true);
                cp_async4(sc + FA_BK + kr, p8 + sat + part_e, true);
            }
            cp_async_commit();
        }
#else
        if (beg < end && r < (early2 ? 2 : 1) * FA_BK) {
            if (threadIdx.x < HD / 8) {
                const int c = threadIdx.x * 8;
                const long long at = (long long)table[pos / block_size] * block_e + layer_off +
                                     (long long)(pos % block_size) * kvd + (long long)g * HD + c;
                e16_t* sk = smem + (r < FA_BK ? r : r + FA_BK) * ROW + c;
                cp_async16(sk, pool + at, true);
                cp_async16(sk + FA_BK * ROW, pool + at + part_e, true);
            }
            cp_async_commit();
        }
#endif
    }
    unsigned qb[NH][HD / 16][2];
    load_q_b_fragments<HD, NH>(qb, qkv + (long long)t * row_stride, g, group);
    // O^T per (head tile, 16 dimensions): element e is dimension 16 dt + qr + 8 (e >> 1) of
    // head 8 nt + 2 qc + (e & 1).
    float o[NH][HD / 16][4];
#pragma unroll
    for (int nt = 0; nt < NH; ++nt)
#pragma unroll
        for (int dt = 0; dt < HD / 16; ++dt) o[nt][dt][0] = o[nt][dt][1] = o[nt][dt][2] = o[nt][dt][3] = 0.0f;
    // Running max (log2 units, see fast_exp2) and this lane's share of the sum, per head
    // 8 nt + 2 qc + i.
    float m[NH][2], l[NH][2];
#pragma unroll
    for (int nt = 0; nt < NH; ++nt) m[nt][0] = m[nt][1] = NEG_INF, l[nt][0] = l[nt][1] = 0.0f;
    const float scale_log2 = scale * LOG2E_F;

    const int* table = tables + table_start[t];
    const int pos = positions[t];
    const int beg = keys.x;
    const int end = keys.y;
    const long long layer_off = (long long)layer * layer_e;

    auto stage = [&](int st, int k0) {
#ifdef TANDEM_FP8_KV
        stage_kv_run_fp8<HD>(raw + st * RAW, pool, table, k0, end, block_size, block_e, layer_off, kvd, part_e, g);
#else
        stage_kv_run<HD>(smem + (long long)st * 2 * FA_BK * ROW, pool, table, k0, end, block_size, block_e,
                         layer_off, kvd, part_e, g);
#endif
    };
    int st = 0;
    for (int k0 = beg; k0 < end; k0 += FA_BK) {
        if (early2 && k0 == beg) {
            cp_async_wait<0>();  // the next run is staged already
        } else if (ring && k0 + FA_BK < end) {
            stage(st ^ 1, k0 + FA_BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
#ifdef TANDEM_FP8_KV
        dequant_kv_run<HD>(smem, raw + st * RAW);
        __syncthreads();
        // With one byte stage it is free again now: the next run loads during this one.
        if (!ring && k0 + FA_BK < end) stage(st, k0 + FA_BK);
        const e16_t* slot = smem;
#else
        const e16_t* slot = smem + (long long)st * 2 * FA_BK * ROW;
#endif
        const int kw = k0 + warp * FD_WK;  // this warp's first key of the run
        if (kw < end) {
            const e16_t* sk = slot + warp * FD_WK * ROW;
            const e16_t* sv = sk + FA_BK * ROW;
            // S^T for the warp's 16 keys: element e is key qr + 8 (e >> 1), head 2 qc + (e & 1)
            // of tile nt. Even and odd k chunks in two accumulators, so that the dependent
            // mma of one tile overlap.
            float s[NH][4], s2[NH][4];
#pragma unroll
            for (int nt = 0; nt < NH; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = s2[nt][e] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < HD / 16; ++kc) {
                unsigned a[4];
                ldsm_x4(a, sk + ((mi & 1) * 8 + mr) * ROW + kc * 16 + (mi >> 1) * 8);
#pragma unroll
                for (int nt = 0; nt < NH; ++nt) {
                    if (kc & 1) {
                        mma_16816(s2[nt], a, qb[nt][kc][0], qb[nt][kc][1]);
                    } else {
                        mma_16816(s[nt], a, qb[nt][kc][0], qb[nt][kc][1]);
                    }
                }
            }
            const bool full = kw + FD_WK <= end;  // warp-uniform: no key of the warp masked
#pragma unroll
            for (int nt = 0; nt < NH; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kw + qr + 8 * (e >> 1);
                    const float v = (s[nt][e] + s2[nt][e]) * scale_log2;
                    s[nt][e] = full || key < end ? v : NEG_INF;
                }
            }
            // Online softmax per head (a column: the maxima over the lanes of other qr).
            unsigned pb[NH][2];
#pragma unroll
            for (int nt = 0; nt < NH; ++nt) {
                float corr[2], base[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float mx = fmaxf(s[nt][i], s[nt][i + 2]);
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                    const float big = fmaxf(m[nt][i], mx);
                    base[i] = big == NEG_INF ? 0.0f : big;
                    corr[i] = fast_exp2(m[nt][i] - base[i]);
                    m[nt][i] = big;
                    l[nt][i] *= corr[i];
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = fast_exp2(s[nt][e] - base[e & 1]);
                    l[nt][e & 1] += s[nt][e];
                }
#pragma unroll
                for (int dt = 0; dt < HD / 16; ++dt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[nt][dt][e] *= corr[e & 1];
                }
                // P^T's B fragment (keys 2 qc, + 1 and + 8 of head qr) by transposing the two
                // 8 × 8 halves (keys 0-7, 8-15) of the probabilities' fragment.
                pb[nt][0] = movmatrix_trans(pack_e16(s[nt][0], s[nt][1]));
                pb[nt][1] = movmatrix_trans(pack_e16(s[nt][2], s[nt][3]));
            }
            // O^T += V^T · P^T: V^T's A fragment per 16 dimensions (ldmatrix.trans of the
            // staged V rows: keys 0-7 / 8-15 × dimensions lo / hi 8).
#pragma unroll
            for (int dt = 0; dt < HD / 16; ++dt) {
                unsigned a[4];
                ldsm_x4_t(a, sv + ((mi >> 1) * 8 + mr) * ROW + dt * 16 + (mi & 1) * 8);
#pragma unroll
                for (int nt = 0; nt < NH; ++nt) mma_16816(o[nt][dt], a, pb[nt][0], pb[nt][1]);
            }
        }
        __syncthreads();  // this stage is refilled: two runs on, or next with one stage
        if (ring) {
            st ^= 1;
        } else if (k0 + FA_BK < end) {
#ifndef TANDEM_FP8_KV
            stage(st, k0 + FA_BK);
#endif
        }
    }

    // The warps' states into shared memory (the stages are free: the loop ended on a barrier,
    // or never ran), [warp][head][SO_ROW] and (m, l) per (warp, head); heads past the group
    // unused. A lane's sum covers its keys qr, qr + 8: summed over the column.
    float* so = reinterpret_cast<float*>(fa_smem);
    float* sml = so + FD_WARPS * 16 * SO_ROW;
#pragma unroll
    for (int nt = 0; nt < NH; ++nt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l[nt][i] += __shfl_xor_sync(0xffffffffu, l[nt][i], 4);
            l[nt][i] += __shfl_xor_sync(0xffffffffu, l[nt][i], 8);
            l[nt][i] += __shfl_xor_sync(0xffffffffu, l[nt][i], 16);
        }
#pragma unroll
        for (int dt = 0; dt < HD / 16; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = nt * 8 + 2 * qc + (e & 1);
                so[(warp * 16 + j) * SO_ROW + dt * 16 + qr + 8 * (e >> 1)] = o[nt][dt][e];
            }
        }
        if (qr == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int j = nt * 8 + 2 * qc + i;
                sml[2 * (warp * 16 + j)] = m[nt][i];
                sml[2 * (warp * 16 + j) + 1] = l[nt][i];
            }
        }
    }
    __syncthreads();
    // The cluster variant's (max, sum) per head of the block's merged state (its output goes
    // to warp 0's rows of `so`: each (head, dimension) is read and written by one thread).
    __shared__ float2 cluster_ml[CLUSTER ? NH * 8 : 1];
    // Slots by the grid's z extent, not `splits`: rows of fewer runs merge fewer splits, and
    // their states must not run into the next row's. (The cluster variant merges every split
    // of the grid: the same number, kept as `splits` for its register budget.)
    const int slots = CLUSTER ? splits : (int)gridDim.z;
    const long long pi = ((long long)bx * nkv + g) * slots + sp;
    for (int idx = threadIdx.x; idx < group * HD; idx += blockDim.x) {
        const int j = idx / HD;
        const int d = idx % HD;
        float big = NEG_INF;
        for (int w = 0; w < FD_WARPS; ++w) big = fmaxf(big, sml[2 * (w * 16 + j)]);
        float sum = 0.0f, a = 0.0f;
        for (int w = 0; w < FD_WARPS; ++w) {
            const float wl = sml[2 * (w * 16 + j) + 1];
            // merge_weight in log2 units
            const float f = wl > 0.0f ? fast_exp2(sml[2 * (w * 16 + j)] - big) : 0.0f;
            sum += wl * f;
            a += so[(w * 16 + j) * SO_ROW + d] * f;
        }
        if (CLUSTER) {
            so[j * SO_ROW + d] = a;
            if (d == 0) cluster_ml[j] = make_float2(big, sum);
        } else if (splits == 1) {
            store_in(out, ((long long)t * nq + g * group + j) * HD + d, a / sum, lo_off);
        } else {
            part_acc[(pi * group + j) * HD + d] = a;
            if (d == 0) {
                // merge_split_states works in natural units (shared with attention_fast).
                part_ml[(pi * group + j) * 2] = big * LN2_F;
                part_ml[(pi * group + j) * 2 + 1] = sum;
            }
        }
    }
    if (CLUSTER) {
        merge_cluster_states<O, HD, HD + FD_SO_PAD>(out, so, cluster_ml, t, g, group, nq, lo_off);
        return;
    }
    if (splits == 1) return;
    merge_split_states(out, part_acc, part_ml, counters, bx, g, nkv, splits, slots, group, HD, t, nq, lo_off);
}

// One entry point per (output type, q heads per KV head up to NH × 8, head size).
#define ATTENTION_DECODE(NAME, O, NH, HD)                                                                    \
    extern "C" __global__ void __launch_bounds__(FD_WARPS * 32) NAME(                                        \
        O* out, const float* qkv, int row_stride, const kv_t* pool, const int* tables,                      \
        const int* table_start, const int* positions, const int* lo_pos, const int* token_list, int nq,      \
        int nkv, int group, int block_size, int layer, int num_layers, float scale, float* part_acc,         \
        float* part_ml, unsigned int* counters, long long lo_off) {                                          \
        attention_decode_impl<O, HD, NH, false>(out, qkv, row_stride, pool, tables, table_start, positions,  \
                                                lo_pos, token_list, nq, nkv, group, block_size, layer,       \
                                                num_layers, scale, part_acc, part_ml, counters, lo_off);     \
    }

// The cluster variant: launched with clusters of (1, 1, gridDim.z), one cluster per (row,
// KV head), its splits merged over distributed shared memory (merge_cluster_states). 16-bit
// output in the main program (f32 and split bf16 too in the half-KV one); the part_* and
// counter arguments are unused (kept for one argument list).
#define ATTENTION_DECODE_CLUSTER(NAME, O, NH, HD)                                                            \
    extern "C" __global__ void __launch_bounds__(FD_WARPS * 32) NAME(                                        \
        O* out, const float* qkv, int row_stride, const kv_t* pool, const int* tables,                      \
        const int* table_start, const int* positions, const int* lo_pos, const int* token_list, int nq,      \
        int nkv, int group, int block_size, int layer, int num_layers, float scale, float* part_acc,         \
        float* part_ml, unsigned int* counters, long long lo_off) {                                          \
        attention_decode_impl<O, HD, NH, true>(                                                              \
            out, qkv, row_stride, pool, tables, table_start, positions, lo_pos, token_list, nq, nkv, group,  \
            block_size, layer, num_layers, scale, part_acc, part_ml, counters, lo_off);                      \
    }

ATTENTION_DECODE(attention_decode_f32_n8_hd64, float, 1, 64)
ATTENTION_DECODE(attention_decode_bf16_n8_hd64, e16_t, 1, 64)
ATTENTION_DECODE(attention_decode_f32_n8_hd128, float, 1, 128)
ATTENTION_DECODE(attention_decode_bf16_n8_hd128, e16_t, 1, 128)
ATTENTION_DECODE(attention_decode_f32_n16_hd64, float, 2, 64)
ATTENTION_DECODE(attention_decode_bf16_n16_hd64, e16_t, 2, 64)
ATTENTION_DECODE(attention_decode_f32_n16_hd128, float, 2, 128)
ATTENTION_DECODE(attention_decode_bf16_n16_hd128, e16_t, 2, 128)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_bf16_n8_hd64, e16_t, 1, 64)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_bf16_n8_hd128, e16_t, 1, 128)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_bf16_n16_hd64, e16_t, 2, 64)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_bf16_n16_hd128, e16_t, 2, 128)
#ifdef TANDEM_HALF_KV
// The half-KV program (an f16 pool beside bf16 weights): split-bf16 outputs for the bf16x2
// GEMMs; its `_f32_` entry points above feed the GEMVs that read f32 activations.
ATTENTION_DECODE(attention_decode_b16_n8_hd64, b16_t, 1, 64)
ATTENTION_DECODE(attention_decode_b16_n8_hd128, b16_t, 1, 128)
ATTENTION_DECODE(attention_decode_b16_n16_hd64, b16_t, 2, 64)
ATTENTION_DECODE(attention_decode_b16_n16_hd128, b16_t, 2, 128)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_f32_n8_hd64, float, 1, 64)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_f32_n8_hd128, float, 1, 128)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_f32_n16_hd64, float, 2, 64)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_f32_n16_hd128, float, 2, 128)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_b16_n8_hd64, b16_t, 1, 64)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_b16_n8_hd128, b16_t, 1, 128)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_b16_n16_hd64, b16_t, 2, 64)
ATTENTION_DECODE_CLUSTER(attention_decode_cluster_b16_n16_hd128, b16_t, 2, 128)
#endif
