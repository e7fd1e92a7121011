// Per-head RMSNorm (Qwen3's q_norm / k_norm, optional) then RoPE, in place on the q and k
// heads of each fused qkv row: a row holds nq q heads, then nkv k heads (then v, untouched),
// each head_dim long, rows `row_stride` apart. RoPE is Hugging Face's rotate_half convention:
// pairs (j, j + head_dim/2), angle = inv_freq[j] * pos computed in f32 (cpu_ops::rope_apply).
// Grid (tokens, nq + nkv); blockDim.x = head_dim/2 rounded up to a multiple of 32.
extern "C" __global__ void qk_norm_rope_f32(float* qkv, int row_stride, int nq, int head_dim,
                                            const int* positions, const float* inv_freq,
                                            const float* q_norm, const float* k_norm, float eps) {
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int half = head_dim / 2;
    float* v = qkv + (long long)t * row_stride + (long long)h * head_dim;
    const int j = threadIdx.x;
    const bool active = j < half;
    float a = active ? v[j] : 0.0f;
    float b = active ? v[j + half] : 0.0f;
    const float* nw = h < nq ? q_norm : k_norm;
    if (nw != nullptr) {  // uniform over the block
        const float ss = block_sum(a * a + b * b);
        const float r = 1.0f / sqrtf(ss / (float)head_dim + eps);
        if (active) {
            a = nw[j] * (a * r);
            b = nw[j + half] * (b * r);
        }
    }
    if (active) {
        const float angle = inv_freq[j] * (float)positions[t];
        float s, c;
        sincosf(angle, &s, &c);
        v[j] = a * c - b * s;
        v[j + half] = b * c + a * s;
    }
}
