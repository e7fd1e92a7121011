// Decode attention on tensor cores over a 16-bit pool (bf16, or f16 in the f16 program): the
// single-token rows of a step (decode), when there are enough of them to fill the GPU.
//
// Grid (rows, nkv, splits); block 4 warps. Block x serves token token_list[x] and one KV head;
// the group's q heads are the rows of one m16 A fragment (rows past the group repeat the first
// head and are dropped), so every K/V element staged in shared memory feeds the whole group.
// The keys [lo, pos] are cut into runs of FA_BK, whole runs per split (blockIdx.z); the block
// stages each run as attention_prefill.cu does (stage_kv_run: cp.async, double buffered;
// deeper rings measured slower on an H200, fewer blocks fitting per SM) and warp w computes
// keys 16w .. 16w + 16 of it (QK: 16 mma, PV: 16 mma) with its own online softmax. The four
// warps' states merge in shared memory, and with splits > 1 the splits merge as in
// attention_fast.cu (the last block of a (row, head) does it). A one-token tile of the prefill
// kernel left three of its four warps idle and read K/V faster than its one warp computed.
// Needs attention_prefill.cu (staging, scores, softmax step and P·V helpers) and
// attention_fast.cu (merge_split_states) before it in the program.
#define FD_WARPS 4
#define FD_WK (FA_BK / FD_WARPS)

template <typename O, int HD>
__device__ void attention_decode_impl(O* out, const float* qkv, int row_stride, const e16_t* pool,
                                      const int* tables, const int* table_start, const int* positions,
                                      const int* lo_pos, const int* token_list, int nq, int nkv, int group,
                                      int block_size, int layer, int num_layers, float scale, float* part_acc,
                                      float* part_ml, unsigned int* counters, long long lo_off) {
    constexpr int ROW = HD + FA_PAD;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    e16_t* smem = reinterpret_cast<e16_t*>(fa_smem);
    const int bx = blockIdx.x;
    const int t = token_list[bx];
    const int g = blockIdx.y;
    const int sp = blockIdx.z;
    const int splits = gridDim.z;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int qr = lane >> 2;
    const int qc = lane & 3;
    const long long kvd = (long long)nkv * HD;
    const long long part_e = (long long)block_size * kvd;
    const long long layer_e = 2 * part_e;
    const long long block_e = (long long)num_layers * layer_e;

    // Q as A fragments: fragment row r is q head g * group + r (r < group), else the first.
    unsigned qa[HD / 16][4];
    {
        const float* qrow = qkv + (long long)t * row_stride;
        const int r0 = qr < group ? qr : 0;
        const int r1 = qr + 8 < group ? qr + 8 : 0;
        load_q_fragments<HD>(qa, qrow + (long long)(g * group + r0) * HD, qrow + (long long)(g * group + r1) * HD);
    }
    float o[HD / 8][4];
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF};  // log2 units (see fast_exp2)
    float l[2] = {0.0f, 0.0f};
    const float scale_log2 = scale * LOG2E_F;

    const int* table = tables + table_start[t];
    const int pos = positions[t];
    const int lo = lo_pos[t];
    const int runs = (pos - lo + FA_BK) / FA_BK;
    const int per = (runs + splits - 1) / splits;
    const int beg = lo + sp * per * FA_BK;
    const int end = min(pos + 1, beg + per * FA_BK);
    const long long layer_off = (long long)layer * layer_e;
    auto stage = [&](int st, int k0) {
        stage_kv_run<HD>(smem + (long long)st * 2 * FA_BK * ROW, pool, table, k0, end, block_size, block_e,
                         layer_off, kvd, part_e, g);
    };
    if (beg < end) stage(0, beg);
    int st = 0;
    for (int k0 = beg; k0 < end; k0 += FA_BK, st ^= 1) {
        if (k0 + FA_BK < end) {
            stage(st ^ 1, k0 + FA_BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int kw = k0 + warp * FD_WK;  // this warp's first key of the run
        if (kw < end) {
            const e16_t* sk = smem + (long long)st * 2 * FA_BK * ROW + warp * FD_WK * ROW;
            float s[2][4];
            qk_scores<HD, 2>(s, qa, sk);
            const bool full = kw + FD_WK <= end;  // warp-uniform: no key of the warp masked
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kw + nt * 8 + 2 * qc + (e & 1);
                    s[nt][e] = full || key < end ? s[nt][e] * scale_log2 : NEG_INF;
                }
            }
            softmax_step<HD, 2>(s, m, l, o);
            pv_accumulate<HD, 2>(o, s, 0, sk + FA_BK * ROW);
        }
        __syncthreads();  // this stage is refilled two runs on
    }

    // The warps' states into shared memory (the stages are free: the loop ended on a barrier,
    // or never ran), [warp][row][HD] and (m, l) per (warp, row); rows past the group unused.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    float* so = reinterpret_cast<float*>(fa_smem);
    float* sml = so + FD_WARPS * 16 * HD;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = warp * 16 + qr + 8 * i;
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
            so[r * HD + dn * 8 + 2 * qc] = o[dn][2 * i];
            so[r * HD + dn * 8 + 2 * qc + 1] = o[dn][2 * i + 1];
        }
        if (qc == 0) {
            sml[2 * r] = m[i];
            sml[2 * r + 1] = l[i];
        }
    }
    __syncthreads();
    const long long pi = ((long long)bx * nkv + g) * splits + sp;
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
            a += so[(w * 16 + j) * HD + d] * f;
        }
        if (splits == 1) {
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
    if (splits == 1) return;
    merge_split_states(out, part_acc, part_ml, counters, bx, g, nkv, splits, group, HD, t, nq, lo_off);
}

#define ATTENTION_DECODE(NAME, O, HD)                                                                        \
    extern "C" __global__ void __launch_bounds__(FD_WARPS * 32) NAME(                                        \
        O* out, const float* qkv, int row_stride, const e16_t* pool, const int* tables,                     \
        const int* table_start, const int* positions, const int* lo_pos, const int* token_list, int nq,      \
        int nkv, int group, int block_size, int layer, int num_layers, float scale, float* part_acc,         \
        float* part_ml, unsigned int* counters, long long lo_off) { GRID_DEPENDENCY_SYNC();                                          \
        attention_decode_impl<O, HD>(out, qkv, row_stride, pool, tables, table_start, positions, lo_pos,     \
                                     token_list, nq, nkv, group, block_size, layer, num_layers, scale,       \
                                     part_acc, part_ml, counters, lo_off);                                   \
    }

ATTENTION_DECODE(attention_decode_f32_hd64, float, 64)
ATTENTION_DECODE(attention_decode_bf16_hd64, e16_t, 64)
ATTENTION_DECODE(attention_decode_f32_hd128, float, 128)
ATTENTION_DECODE(attention_decode_bf16_hd128, e16_t, 128)
