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
use crate::model::tp::{RankCtx, Shard};
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
    /// A LLaVA checkpoint's language model is found under its prefix (the Hub's
    /// `language_model.model.*` / `language_model.lm_head.*`, or transformers ≥ 4.52's
    /// `model.language_model.*` / `lm_head.*`).
    pub fn load(cfg: &ModelConfig, weights: &Weights) -> Result<Self, EngineError> {
        let rename = |name: &str| -> String {
            if cfg.vision.is_none() {
                return name.to_owned();
            }
            if weights.contains("language_model.model.embed_tokens.weight") {
                return format!("language_model.{name}");
            }
            match name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => name.to_owned(),
            }
        };
        Self::from_source(cfg, |name, shape| {
            weights.tensor_matrix(&rename(name), shape)
        })
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

/// The sizes one step works with, from the model config and the rank's shard (heads, KV
/// heads and intermediate features are this rank's part; hidden is whole).
struct Dims {
    hidden: usize,
    head_dim: usize,
    q_heads: usize,
    /// Query heads per KV head.
    group: usize,
    /// Width of the q part of a qkv row (`q_heads * head_dim`).
    q_width: usize,
    /// Width of the k part, and of the v part, of a qkv row (`kv_heads * head_dim`).
    kv_width: usize,
    intermediate: usize,
    eps: f32,
    block_size: usize,
}

impl Dims {
    fn new(cfg: &ModelConfig, block_size: usize, shard: Shard) -> Self {
        let head_dim = cfg.head_dim;
        let q_heads = shard.part(cfg.num_attention_heads).len();
        Self {
            hidden: cfg.hidden_size,
            head_dim,
            q_heads,
            group: cfg.group_size(),
            q_width: q_heads * head_dim,
            kv_width: shard.part(cfg.num_key_value_heads).len() * head_dim,
            intermediate: shard.part(cfg.intermediate_size).len(),
            eps: cfg.rms_norm_eps,
            block_size,
        }
    }

    /// Width of a fused qkv row.
    fn qkv_width(&self) -> usize {
        self.q_width + 2 * self.kv_width
    }
}

/// The attention's position encoding and reach, from the model config.
struct AttnParams {
    inv_freq: Vec<f64>,
    /// Positions a token sees, its own included (`usize::MAX`: all).
    window: usize,
    /// `1 / sqrt(head_dim)`.
    scale: f32,
}

/// The step's activations, `t` rows each, reused by every layer.
struct Activations {
    /// The residual stream.
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

impl Activations {
    fn new(d: &Dims, x: Vec<f32>, t: usize) -> Self {
        Self {
            x,
            normed: vec![0.0f32; t * d.hidden],
            qkv: vec![0.0f32; t * d.qkv_width()],
            attn: vec![0.0f32; t * d.q_width],
            proj: vec![0.0f32; t * d.hidden],
            gate_up: vec![0.0f32; t * 2 * d.intermediate],
            act: vec![0.0f32; t * d.intermediate],
        }
    }
}

/// One step's batch: its sequences and their tokens flattened, in order.
struct Batch<'b, 'a> {
    seqs: &'b [SeqInput<'a>],
    tokens: Vec<TokenRef>,
}

impl Batch<'_, '_> {
    /// The pool block and slot of position `pos` of the batch's sequence `seq`.
    fn slot(&self, d: &Dims, seq: usize, pos: usize) -> (usize, usize) {
        let table = self.seqs[seq].block_table;
        (table[pos / d.block_size] as usize, pos % d.block_size)
    }
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
    forward_rank(cfg, w, store, block_size, batch, RankCtx::WHOLE)
}

/// [`forward`] on one tensor-parallel rank: `w` is the rank's shard ([`Shard::weights`]),
/// `store` holds its KV heads, and the ranks of the step run this together, joined by
/// `rank`'s collective (see [`crate::model::tp`]). Every rank returns the full logits.
pub fn forward_rank(
    cfg: &ModelConfig,
    w: &DecoderWeights,
    store: &mut impl KvStore,
    block_size: usize,
    batch: &[SeqInput<'_>],
    rank: RankCtx<'_>,
) -> Result<StepOutput, EngineError> {
    let d = Dims::new(cfg, block_size, rank.shard);
    let ap = AttnParams {
        inv_freq: cfg.rope_inv_freq(),
        window: cfg.sliding_window.unwrap_or(usize::MAX),
        scale: 1.0 / (d.head_dim as f32).sqrt(),
    };
    let batch = Batch {
        seqs: batch,
        tokens: flatten_tokens(batch),
    };
    let x = embed(cfg, w, batch.seqs, batch.tokens.len(), rank)?;
    let mut a = Activations::new(&d, x, batch.tokens.len());
    for (l, lw) in w.layers.iter().enumerate() {
        attention_block(&d, &ap, (l, lw), store, &batch, &mut a, rank)?;
        mlp_block(&d, lw, &mut a, rank)?;
    }
    logits(cfg, w, batch.seqs, &a.x, rank)
}

/// Every token of the batch with its sequence and position, in batch order.
fn flatten_tokens(batch: &[SeqInput<'_>]) -> Vec<TokenRef> {
    batch
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            (0..seq.tokens.len()).map(move |i| TokenRef {
                seq: s,
                pos: seq.start_pos + i,
            })
        })
        .collect()
}

/// The embedding rows of the batch's `t` tokens (the residual stream's start). A rank holds
/// the rows of its vocabulary slice; the others' tokens are zeros there until the all-reduce.
fn embed(
    cfg: &ModelConfig,
    w: &DecoderWeights,
    batch: &[SeqInput<'_>],
    t: usize,
    rank: RankCtx<'_>,
) -> Result<Vec<f32>, EngineError> {
    let h = cfg.hidden_size;
    let held = rank.shard.vocab(cfg.vocab_size);
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
        if held.contains(&id) {
            w.embed.row_into(id - held.start, h, row);
        }
    }
    rank.all_reduce_sum(&mut x)?;
    splice_media(h, batch, &mut x);
    Ok(x)
}

/// Replaces the embedding rows of tokens that a sequence's media spans cover with the
/// spans' rows (image features at the image tokens' positions).
fn splice_media(h: usize, batch: &[SeqInput<'_>], x: &mut [f32]) {
    let mut rows = x.chunks_exact_mut(h);
    for seq in batch {
        for (i, row) in (&mut rows).take(seq.tokens.len()).enumerate() {
            let pos = seq.start_pos + i;
            if let Some(src) = seq.media.iter().find_map(|m| m.row(pos, h)) {
                row.copy_from_slice(src);
            }
        }
    }
}

/// Layer `l`'s attention half: RMSNorm, the qkv projection with its biases, norms and RoPE,
/// this step's k and v into the pool, attention, o_proj (summed over the ranks), and the
/// residual add.
fn attention_block(
    d: &Dims,
    ap: &AttnParams,
    (l, lw): (usize, &LayerWeights),
    store: &mut impl KvStore,
    batch: &Batch<'_, '_>,
    a: &mut Activations,
    rank: RankCtx<'_>,
) -> Result<(), EngineError> {
    let t = batch.tokens.len();
    let qkv_w = d.qkv_width();
    rms_norm_rows(&a.x, &lw.input_norm, d.eps, &mut a.normed);
    matmul_t(&a.normed, t, d.hidden, lw.qkv.as_ref(), qkv_w, &mut a.qkv);
    position_qk(d, ap, lw, &batch.tokens, &mut a.qkv);
    write_kv(d, l, store, batch, &a.qkv);
    attend(d, ap, l, &*store, batch, &a.qkv, &mut a.attn);
    matmul_t(
        &a.attn,
        t,
        d.q_width,
        lw.o_proj.as_ref(),
        d.hidden,
        &mut a.proj,
    );
    rank.all_reduce_sum(&mut a.proj)?;
    if let Some(b) = &lw.o_bias {
        a.proj
            .chunks_exact_mut(d.hidden)
            .for_each(|row| add_in_place(row, b));
    }
    add_in_place(&mut a.x, &a.proj);
    Ok(())
}

/// Biases, per-head norms and RoPE on each token's q and k.
fn position_qk(d: &Dims, ap: &AttnParams, lw: &LayerWeights, tokens: &[TokenRef], qkv: &mut [f32]) {
    qkv.par_chunks_exact_mut(d.qkv_width())
        .zip(tokens.par_iter())
        .for_each(|(row, tr)| {
            if let Some(b) = &lw.qkv_bias {
                add_in_place(row, b);
            }
            let (q, kv) = row.split_at_mut(d.q_width);
            let k = &mut kv[..d.kv_width];
            for (heads, norm) in [(q, &lw.q_norm), (k, &lw.k_norm)] {
                for head in heads.chunks_exact_mut(d.head_dim) {
                    if let Some(norm) = norm {
                        rms_norm_rows_inplace(head, norm, d.eps);
                    }
                    rope_apply(head, tr.pos, &ap.inv_freq);
                }
            }
        });
}

/// Stores this step's k and v of layer `l` in the pool.
fn write_kv(d: &Dims, l: usize, store: &mut impl KvStore, batch: &Batch<'_, '_>, qkv: &[f32]) {
    let (qd, kvd) = (d.q_width, d.kv_width);
    for (row, tr) in qkv.chunks_exact(d.qkv_width()).zip(&batch.tokens) {
        let (block, slot) = batch.slot(d, tr.seq, tr.pos);
        store.write_token(l, block, slot, KvPart::K, &row[qd..qd + kvd]);
        store.write_token(l, block, slot, KvPart::V, &row[qd + kvd..]);
    }
}

/// Attention: one task per (token, query head); each reads its sequence's cached positions
/// from the pool (the prefix from earlier steps and this step's tokens alike), so chunked
/// prefill and decode take the same path. With a sliding window of w, the token at pos sees
/// pos+1-w..=pos (transformers' `kv_idx > q_idx - w`).
fn attend(
    d: &Dims,
    ap: &AttnParams,
    l: usize,
    store: &impl KvStore,
    batch: &Batch<'_, '_>,
    qkv: &[f32],
    attn: &mut [f32],
) {
    let (hd, nq, qkv_w) = (d.head_dim, d.q_heads, d.qkv_width());
    attn.par_chunks_exact_mut(hd).enumerate().for_each_init(
        || (Vec::new(), vec![0.0f32; hd]),
        |(scores, scratch), (idx, out)| {
            let (ti, head) = (idx / nq, idx % nq);
            let tr = batch.tokens[ti];
            let kvh = head / d.group;
            let q = &qkv[ti * qkv_w + head * hd..ti * qkv_w + (head + 1) * hd];
            let lo = (tr.pos + 1).saturating_sub(ap.window);
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in lo..=tr.pos {
                let (block, slot) = batch.slot(d, tr.seq, p);
                let kv = store.read_head(l, block, slot, KvPart::K, kvh, scratch);
                let s = dot(q, kv) * ap.scale;
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
                let (block, slot) = batch.slot(d, tr.seq, p);
                let v = store.read_head(l, block, slot, KvPart::V, kvh, scratch);
                let a = s / sum;
                for (o, vv) in out.iter_mut().zip(v) {
                    *o += a * vv;
                }
            }
        },
    );
}

/// A layer's MLP half: RMSNorm, the SwiGLU MLP (down summed over the ranks), and the
/// residual add.
fn mlp_block(
    d: &Dims,
    lw: &LayerWeights,
    a: &mut Activations,
    rank: RankCtx<'_>,
) -> Result<(), EngineError> {
    let (h, im) = (d.hidden, d.intermediate);
    let t = a.x.len() / h;
    rms_norm_rows(&a.x, &lw.post_norm, d.eps, &mut a.normed);
    matmul_t(&a.normed, t, h, lw.gate_up.as_ref(), 2 * im, &mut a.gate_up);
    a.act
        .par_chunks_exact_mut(im)
        .zip(a.gate_up.par_chunks_exact_mut(2 * im))
        .for_each(|(act, row)| {
            let (g, u) = row.split_at_mut(im);
            silu_mul(g, u);
            act.copy_from_slice(g);
        });
    matmul_t(&a.act, t, im, lw.down.as_ref(), h, &mut a.proj);
    rank.all_reduce_sum(&mut a.proj)?;
    add_in_place(&mut a.x, &a.proj);
    Ok(())
}

/// The final norm and the lm_head over the rows each sequence asks logits for.
fn logits(
    cfg: &ModelConfig,
    w: &DecoderWeights,
    batch: &[SeqInput<'_>],
    x: &[f32],
    rank: RankCtx<'_>,
) -> Result<StepOutput, EngineError> {
    let h = cfg.hidden_size;
    let (rows, counts) = logits_rows(batch);
    let r = rows.len();
    let mut sel = vec![0.0f32; r * h];
    for (dst, &src) in sel.chunks_exact_mut(h).zip(&rows) {
        rms_norm_rows(&x[src * h..(src + 1) * h], &w.norm, cfg.rms_norm_eps, dst);
    }
    let v = cfg.vocab_size;
    let logits = vocab_parallel_logits(&sel, r, h, w.lm_head(), v, rank)?;
    let mut chunks = logits.chunks_exact(v).map(<[f32]>::to_vec);
    let out = counts
        .iter()
        .map(|&c| chunks.by_ref().take(c).collect())
        .collect();
    Ok(StepOutput { logits: out })
}

/// `r` rows of logits over the whole vocabulary `v`: each rank multiplies by its lm_head
/// rows into a slice padded to [`Shard::vocab_per_rank`], the slices are gathered, and each
/// row is put together from the ranks' slices.
fn vocab_parallel_logits(
    sel: &[f32],
    r: usize,
    h: usize,
    lm_head: &Matrix,
    v: usize,
    rank: RankCtx<'_>,
) -> Result<Vec<f32>, EngineError> {
    let shard = rank.shard;
    if shard.world == 1 {
        let mut logits = vec![0.0f32; r * v];
        matmul_t(sel, r, h, lm_head.as_ref(), v, &mut logits);
        return Ok(logits);
    }
    let (held, per) = (shard.vocab(v).len(), shard.vocab_per_rank(v));
    let mut mine = vec![0.0f32; r * held];
    matmul_t(sel, r, h, lm_head.as_ref(), held, &mut mine);
    let mut padded = vec![0.0f32; r * per];
    if held > 0 {
        for (dst, src) in padded.chunks_exact_mut(per).zip(mine.chunks_exact(held)) {
            dst[..held].copy_from_slice(src);
        }
    }
    let all = rank.all_gather(padded)?;
    let mut logits = Vec::with_capacity(r * v);
    for row in 0..r {
        for k in 0..shard.world {
            let n = Shard { rank: k, ..shard }.vocab(v).len();
            let at = k * r * per + row * per;
            logits.extend_from_slice(&all[at..at + n]);
        }
    }
    Ok(logits)
}

/// The flattened token rows that get logits, and how many of them each sequence has.
fn logits_rows(batch: &[SeqInput<'_>]) -> (Vec<usize>, Vec<usize>) {
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
    (rows, counts)
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
