//! The dense Llama-like decoder forward pass over a paged KV cache, for every
//! [`Family`](crate::model::config::Family): embedding, per layer RMSNorm → fused q/k/v
//! projection (+ bias: Qwen2, `attention_bias`) → per-head q_norm/k_norm (Qwen3) → RoPE (plain
//! or llama3-scaled) → grouped-query attention over the cached prefix and the new tokens (within
//! the sliding window: Mistral) → o_proj (+ bias) → residual → RMSNorm → SwiGLU MLP → residual,
//! then the final norm and the (optionally tied) lm_head. Matches Hugging Face's
//! `Qwen3ForCausalLM`, `Qwen2ForCausalLM`, `LlamaForCausalLM` and `MistralForCausalLM`.

use rayon::prelude::*;

use crate::backend::cpu_ops::{
    dot, matmul_t, rms_norm_rows, rms_norm_rows_inplace, rope_apply, silu_mul, Matrix,
};
use crate::backend::{LogitsMode, SeqInput, StepOutput};
use crate::error::EngineError;
use crate::kv::layout::KvPart;
use crate::model::config::ModelConfig;
use crate::model::weights::Weights;

/// One decoder layer's weights in the `[out, in]` layout of the checkpoint (matrices f32 or
/// bf16 as stored, norms and biases f32). q/k/v and gate/up are concatenated along `out` so
/// that each is one GEMM.
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    /// `[q_heads*head_dim + 2*kv_heads*head_dim, hidden]`: rows of q, then k, then v.
    pub qkv: Matrix,
    /// q, k and v biases concatenated like `qkv`'s rows, when the family has them.
    pub qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of q and k (Qwen3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub o_proj: Matrix,
    pub o_bias: Option<Vec<f32>>,
    pub post_norm: Vec<f32>,
    /// `[2*intermediate, hidden]`: rows of gate, then up.
    pub gate_up: Matrix,
    pub down: Matrix,
}

/// All weights of a decoder model.
pub struct DecoderWeights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Matrix>,
}

impl DecoderWeights {
    /// Loads from a mapped checkpoint, with Hugging Face tensor names.
    pub fn load(cfg: &ModelConfig, weights: &Weights) -> Result<Self, EngineError> {
        Self::from_source(cfg, |name, shape| weights.tensor_matrix(name, shape))
    }

    /// Builds the weights from any source of named tensors (`get(name, shape)` returns the
    /// data of that shape); the checkpoint loader and the benchmark's random models use it.
    pub fn from_source(
        cfg: &ModelConfig,
        mut get: impl FnMut(&str, &[usize]) -> Result<Matrix, EngineError>,
    ) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        let hd = cfg.head_dim;
        let qd = cfg.num_attention_heads * hd;
        let kvd = cfg.num_key_value_heads * hd;
        let im = cfg.intermediate_size;
        let embed = get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            tracing::info!("loading layer {}/{}", l + 1, cfg.num_hidden_layers);
            let p = format!("model.layers.{l}.");
            let qkv = Matrix::concat(vec![
                get(&format!("{p}self_attn.q_proj.weight"), &[qd, h])?,
                get(&format!("{p}self_attn.k_proj.weight"), &[kvd, h])?,
                get(&format!("{p}self_attn.v_proj.weight"), &[kvd, h])?,
            ]);
            let qkv_bias = if cfg.qkv_bias {
                let mut b = get(&format!("{p}self_attn.q_proj.bias"), &[qd])?.into_f32();
                b.extend(get(&format!("{p}self_attn.k_proj.bias"), &[kvd])?.into_f32());
                b.extend(get(&format!("{p}self_attn.v_proj.bias"), &[kvd])?.into_f32());
                Some(b)
            } else {
                None
            };
            let mut vector = |name: &str, len: usize, on: bool| -> Result<_, EngineError> {
                Ok(match on {
                    true => Some(get(&format!("{p}{name}"), &[len])?.into_f32()),
                    false => None,
                })
            };
            let q_norm = vector("self_attn.q_norm.weight", hd, cfg.qk_norm)?;
            let k_norm = vector("self_attn.k_norm.weight", hd, cfg.qk_norm)?;
            let o_bias = vector("self_attn.o_proj.bias", h, cfg.o_bias)?;
            let gate_up = Matrix::concat(vec![
                get(&format!("{p}mlp.gate_proj.weight"), &[im, h])?,
                get(&format!("{p}mlp.up_proj.weight"), &[im, h])?,
            ]);
            layers.push(LayerWeights {
                input_norm: get(&format!("{p}input_layernorm.weight"), &[h])?.into_f32(),
                qkv,
                qkv_bias,
                q_norm,
                k_norm,
                o_proj: get(&format!("{p}self_attn.o_proj.weight"), &[h, qd])?,
                o_bias,
                post_norm: get(&format!("{p}post_attention_layernorm.weight"), &[h])?.into_f32(),
                gate_up,
                down: get(&format!("{p}mlp.down_proj.weight"), &[h, im])?,
            });
        }
        let norm = get("model.norm.weight", &[h])?.into_f32();
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(get("lm_head.weight", &[cfg.vocab_size, h])?)
        };
        Ok(DecoderWeights {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The output projection `[vocab, hidden]`.
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Access to the paged KV pool, in the coordinates of [`crate::kv::layout::KvLayout`].
pub trait KvStore: Sync {
    /// Stores one token's K or V (all KV heads, `num_kv_heads * head_dim` values).
    fn write_token(&mut self, layer: usize, block: usize, slot: usize, part: KvPart, data: &[f32]);
    /// One head of one token; may convert into `scratch` (head_dim long) and return it.
    fn read_head<'a>(
        &'a self,
        layer: usize,
        block: usize,
        slot: usize,
        part: KvPart,
        head: usize,
        scratch: &'a mut [f32],
    ) -> &'a [f32];
}

/// Where a flattened token of the step comes from.
#[derive(Clone, Copy)]
struct TokenRef {
    seq: usize,
    pos: usize,
}

/// Runs one step of the model over a batch (inputs validated by the caller: block tables
/// cover every position, block ids are in the pool).
pub fn forward(
    cfg: &ModelConfig,
    w: &DecoderWeights,
    store: &mut impl KvStore,
    block_size: usize,
    batch: &[SeqInput<'_>],
) -> Result<StepOutput, EngineError> {
    let h = cfg.hidden_size;
    let hd = cfg.head_dim;
    let nq = cfg.num_attention_heads;
    let nkv = cfg.num_key_value_heads;
    let group = cfg.group_size();
    let qd = nq * hd;
    let kvd = nkv * hd;
    let qkv_w = qd + 2 * kvd;
    let im = cfg.intermediate_size;
    let eps = cfg.rms_norm_eps;
    let inv_freq = cfg.rope_inv_freq();
    let window = cfg.sliding_window.unwrap_or(usize::MAX);
    let scale = 1.0 / (hd as f32).sqrt();

    let tokens: Vec<TokenRef> = batch
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            (0..seq.tokens.len()).map(move |i| TokenRef {
                seq: s,
                pos: seq.start_pos + i,
            })
        })
        .collect();
    let t = tokens.len();

    // Embedding lookup.
    let mut x = vec![0.0f32; t * h];
    for (row, id) in x
        .chunks_exact_mut(h)
        .zip(batch.iter().flat_map(|s| s.tokens.iter()))
    {
        let id = *id as usize;
        if id >= cfg.vocab_size {
            return Err(EngineError::InvalidInput(format!(
                "token id {id} is outside the vocabulary ({})",
                cfg.vocab_size
            )));
        }
        w.embed.row_into(id, h, row);
    }

    let mut normed = vec![0.0f32; t * h];
    let mut qkv = vec![0.0f32; t * qkv_w];
    let mut attn = vec![0.0f32; t * qd];
    let mut proj = vec![0.0f32; t * h];
    let mut gu = vec![0.0f32; t * 2 * im];
    let mut act = vec![0.0f32; t * im];

    for (l, lw) in w.layers.iter().enumerate() {
        rms_norm_rows(&x, &lw.input_norm, eps, &mut normed);
        matmul_t(&normed, t, h, lw.qkv.as_ref(), qkv_w, &mut qkv);

        // Biases, per-head norms and RoPE on q and k, then store this step's k and v in the
        // pool.
        qkv.par_chunks_exact_mut(qkv_w)
            .zip(tokens.par_iter())
            .for_each(|(row, tr)| {
                if let Some(b) = &lw.qkv_bias {
                    add_in_place(row, b);
                }
                let (q, kv) = row.split_at_mut(qd);
                let k = &mut kv[..kvd];
                for (heads, norm) in [(q, &lw.q_norm), (k, &lw.k_norm)] {
                    for head in heads.chunks_exact_mut(hd) {
                        if let Some(norm) = norm {
                            rms_norm_rows_inplace(head, norm, eps);
                        }
                        rope_apply(head, tr.pos, &inv_freq);
                    }
                }
            });
        for (row, tr) in qkv.chunks_exact(qkv_w).zip(&tokens) {
            let table = batch[tr.seq].block_table;
            let block = table[tr.pos / block_size] as usize;
            let slot = tr.pos % block_size;
            store.write_token(l, block, slot, KvPart::K, &row[qd..qd + kvd]);
            store.write_token(l, block, slot, KvPart::V, &row[qd + kvd..]);
        }

        // Attention: one task per (token, query head); each reads its sequence's cached
        // positions from the pool (the prefix from earlier steps and this step's tokens alike),
        // so chunked prefill and decode take the same path. With a sliding window of w, the
        // token at pos sees pos+1-w..=pos (transformers' `kv_idx > q_idx - w`).
        let store_ref = &*store;
        attn.par_chunks_exact_mut(hd).enumerate().for_each_init(
            || (Vec::new(), vec![0.0f32; hd]),
            |(scores, scratch), (idx, out)| {
                let (ti, head) = (idx / nq, idx % nq);
                let tr = tokens[ti];
                let kvh = head / group;
                let q = &qkv[ti * qkv_w + head * hd..ti * qkv_w + (head + 1) * hd];
                let table = batch[tr.seq].block_table;
                let lo = (tr.pos + 1).saturating_sub(window);
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for p in lo..=tr.pos {
                    let kv = store_ref.read_head(
                        l,
                        table[p / block_size] as usize,
                        p % block_size,
                        KvPart::K,
                        kvh,
                        scratch,
                    );
                    let s = dot(q, kv) * scale;
                    max = max.max(s);
                    scores.push(s);
                }
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                out.fill(0.0);
                for (p, s) in (lo..).zip(scores.iter()) {
                    let v = store_ref.read_head(
                        l,
                        table[p / block_size] as usize,
                        p % block_size,
                        KvPart::V,
                        kvh,
                        scratch,
                    );
                    let a = s / sum;
                    for (o, vv) in out.iter_mut().zip(v) {
                        *o += a * vv;
                    }
                }
            },
        );

        matmul_t(&attn, t, qd, lw.o_proj.as_ref(), h, &mut proj);
        if let Some(b) = &lw.o_bias {
            proj.chunks_exact_mut(h)
                .for_each(|row| add_in_place(row, b));
        }
        add_in_place(&mut x, &proj);

        rms_norm_rows(&x, &lw.post_norm, eps, &mut normed);
        matmul_t(&normed, t, h, lw.gate_up.as_ref(), 2 * im, &mut gu);
        act.par_chunks_exact_mut(im)
            .zip(gu.par_chunks_exact_mut(2 * im))
            .for_each(|(a, row)| {
                let (g, u) = row.split_at_mut(im);
                silu_mul(g, u);
                a.copy_from_slice(g);
            });
        matmul_t(&act, t, im, lw.down.as_ref(), h, &mut proj);
        add_in_place(&mut x, &proj);
    }

    // Logits only for the rows asked for.
    let mut rows = Vec::new();
    let mut counts = Vec::with_capacity(batch.len());
    let mut first = 0;
    for seq in batch {
        let n = seq.tokens.len();
        let picked: Vec<usize> = match seq.logits {
            LogitsMode::None => vec![],
            LogitsMode::Last if n > 0 => vec![first + n - 1],
            LogitsMode::Last => vec![],
            LogitsMode::All => (first..first + n).collect(),
        };
        counts.push(picked.len());
        rows.extend(picked);
        first += n;
    }
    let r = rows.len();
    let mut sel = vec![0.0f32; r * h];
    for (dst, &src) in sel.chunks_exact_mut(h).zip(&rows) {
        rms_norm_rows(&x[src * h..(src + 1) * h], &w.norm, eps, dst);
    }
    let v = cfg.vocab_size;
    let mut logits = vec![0.0f32; r * v];
    matmul_t(&sel, r, h, w.lm_head().as_ref(), v, &mut logits);
    let mut chunks = logits.chunks_exact(v).map(<[f32]>::to_vec);
    let out = counts
        .iter()
        .map(|&c| chunks.by_ref().take(c).collect())
        .collect();
    Ok(StepOutput { logits: out })
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
