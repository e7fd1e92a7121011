//! The CPU engine against transformers on the tiny random model of each family beside Qwen3
//! (`tiny::FAMILY_MODELS`): Qwen2 (q/k/v biases), Llama 3 (`rope_scaling` of type llama3),
//! Mistral (a sliding window of 8) and a Llama with `attention_bias` (q/k/v and o_proj biases,
//! plain RoPE, tied lm_head). Goldens from `scripts/goldens/make_family_goldens.py`
//! (transformers in f32, eager attention): full logit rows at every 3rd position and the last,
//! the argmax at every position, 16 free-running greedy tokens, and the RoPE inv_freq.
//!
//! Tolerances as for Qwen3 (`tiny_goldens.rs`, `shape_goldens.rs`): max|Δlogit| / std ≤ 1e-4
//! per row, argmax and greedy tokens identical. Each family's test also checks that what the
//! family adds matters: switching it off moves the logits far outside the tolerance.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
use tandem_engine::kv::layout::KvDtype;
use tandem_engine::model::tp::Shard;
use tandem_engine::model::weights::file_sha256;
use tandem_engine::model::{DecoderWeights, Family, LoadOptions, LoadedModel, ModelConfig};
use tandem_engine::tiny::{ensure_named_model, LLAMA_BIAS};

const TOL: f32 = 1e-4;
const BLOCK: usize = 16;

#[derive(Deserialize)]
struct Goldens {
    families: Vec<FamilyGoldens>,
}

#[derive(Deserialize)]
struct FamilyGoldens {
    family: String,
    weights_sha256: String,
    vocab_size: usize,
    inv_freq: Option<Vec<f32>>,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    ids: Vec<u32>,
    first_row: usize,
    row_positions: Vec<usize>,
    argmax: Vec<u32>,
    greedy: Vec<u32>,
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn std_of(row: &[f32]) -> f32 {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
    (row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt() as f32
}

fn load_goldens(name: &str) -> (FamilyGoldens, Vec<f32>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens");
    let g: Goldens = serde_json::from_str(
        &std::fs::read_to_string(dir.join("family_logits.json")).expect("read goldens"),
    )
    .expect("parse goldens");
    let rows: Vec<f32> = std::fs::read(dir.join("family_logits_rows.bin"))
        .expect("read rows")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let fg = g
        .families
        .into_iter()
        .find(|f| f.family == name)
        .unwrap_or_else(|| panic!("no goldens for {name}"));
    (fg, rows)
}

/// Loads the named model, checking that its weights are those the goldens were made from.
fn load_model(family: Family, g: &FamilyGoldens) -> LoadedModel {
    let dir = ensure_named_model(&g.family).expect("build the model");
    let sha = file_sha256(&dir.join("model.safetensors")).expect("hash");
    assert_eq!(
        sha, g.weights_sha256,
        "the {} model's weights differ from those the goldens were made from: rerun \
         scripts/goldens/make_family_goldens.py and commit its output (and bump \
         FAMILY_MODEL_VERSION)",
        g.family
    );
    let m = LoadedModel::load(&dir, &LoadOptions::default()).expect("load");
    assert_eq!(m.config.family, family);
    assert_eq!(m.config.vocab_size, g.vocab_size);
    m
}

/// The largest max|Δ|/std over the stored rows, prefilling in chunks of `chunk_len`, and the
/// logits of every position.
fn prefill_rows(
    be: &mut CpuBackend,
    p: &Prompt,
    rows: &[f32],
    v: usize,
    chunk_len: usize,
    table: &[u32],
) -> (f32, Vec<Vec<f32>>) {
    let mut ours = Vec::new();
    for (c, chunk) in p.ids.chunks(chunk_len).enumerate() {
        let out = be
            .forward(&[SeqInput {
                tokens: chunk,
                start_pos: c * chunk_len,
                block_table: table,
                logits: LogitsMode::All,
                media: Default::default(),
            }])
            .expect("prefill");
        ours.extend(out.logits.into_iter().next().expect("one sequence"));
    }
    let mut worst = 0.0f32;
    for (k, &pos) in p.row_positions.iter().enumerate() {
        let at = (p.first_row + k) * v;
        let gold = &rows[at..at + v];
        let max = ours[pos]
            .iter()
            .zip(gold)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(max / std_of(gold));
    }
    (worst, ours)
}

fn backend(cfg: ModelConfig, w: Arc<DecoderWeights>) -> CpuBackend {
    CpuBackend::from_parts(cfg, w, "family".into(), KvDtype::F32, BLOCK, 16).expect("backend")
}

/// Checks the named model of `family` against its goldens, whole and, where its heads
/// split in two, over two tensor-parallel ranks; returns the worst max|Δ|/std.
fn check_model(name: &str, family: Family) -> f32 {
    let (g, _) = load_goldens(name);
    let cfg = load_model(family, &g).config;
    let two = Shard::check(&cfg, 2).is_ok();
    let sizes: &[usize] = if two { &[1, 2] } else { &[1] };
    sizes
        .iter()
        .map(|&tp| check_model_on(name, family, tp))
        .fold(0.0, f32::max)
}

/// [`check_model`] with the model split over `tp` ranks.
fn check_model_on(name: &str, family: Family, tp: usize) -> f32 {
    let (g, rows) = load_goldens(name);
    let m = load_model(family, &g);
    if let Some(gold) = &g.inv_freq {
        let ours = m.config.rope_inv_freq();
        assert_eq!(ours.len(), gold.len(), "inv_freq length");
        for (j, (a, b)) in ours.iter().zip(gold).enumerate() {
            let rel = ((*a as f32 - b) / b).abs();
            assert!(rel <= 1e-6, "{}: inv_freq[{j}] {a} vs {b}", g.family);
        }
    }
    let v = g.vocab_size;
    let mut be = backend(m.config.clone(), m.weights.clone())
        .with_tensor_parallel(tp)
        .expect("tensor parallel");
    let mut worst = 0.0f32;
    for p in &g.prompts {
        let total = p.ids.len() + p.greedy.len();
        // Blocks in reverse order, so that block ids and positions differ.
        let table: Vec<u32> = (0..total.div_ceil(BLOCK) as u32).rev().collect();
        // Chunks of 10 (not block aligned), then the whole prompt at once.
        let mut ours = Vec::new();
        for chunk_len in [10, p.ids.len()] {
            let (w, o) = prefill_rows(&mut be, p, &rows, v, chunk_len, &table);
            assert!(
                w <= TOL,
                "{} {} chunk {chunk_len}: max|Δ|/std {w:.2e} > {TOL:.0e}",
                g.family,
                p.name
            );
            worst = worst.max(w);
            for (pos, row) in o.iter().enumerate() {
                assert_eq!(
                    argmax(row),
                    p.argmax[pos],
                    "{} {} pos {pos}",
                    g.family,
                    p.name
                );
            }
            ours = o;
        }
        // Free-running greedy decode from the cached prompt.
        let mut next = argmax(&ours[p.ids.len() - 1]);
        let mut got = vec![next];
        while got.len() < p.greedy.len() {
            let out = be
                .forward(&[SeqInput {
                    tokens: &[next],
                    start_pos: p.ids.len() + got.len() - 1,
                    block_table: &table,
                    logits: LogitsMode::Last,
                    media: Default::default(),
                }])
                .expect("decode");
            next = argmax(&out.logits[0][0]);
            got.push(next);
        }
        assert_eq!(
            got, p.greedy,
            "{} {} (tensor parallel {tp}): greedy tokens",
            g.family, p.name
        );
    }
    eprintln!(
        "{} (tensor parallel {tp}): largest |Δlogit| / std against transformers {worst:.2e} \
         (tolerance {TOL:.0e}); greedy tokens identical",
        g.family
    );
    worst
}

/// With the family's feature switched off (by `alter`), the long prompt's logits must be far
/// from the goldens: the goldens do check the feature.
fn check_feature_matters(
    name: &str,
    family: Family,
    alter: impl FnOnce(&mut ModelConfig, &mut DecoderWeights),
) {
    let (g, rows) = load_goldens(name);
    let m = load_model(family, &g);
    let mut cfg = m.config.clone();
    let mut weights = Arc::try_unwrap(m.weights).unwrap_or_else(|_| panic!("shared weights"));
    alter(&mut cfg, &mut weights);
    let mut be = backend(cfg, Arc::new(weights));
    let p = g
        .prompts
        .iter()
        .find(|p| p.name == "long")
        .expect("long prompt");
    let table: Vec<u32> = (0..p.ids.len().div_ceil(BLOCK) as u32).collect();
    let (w, _) = prefill_rows(&mut be, p, &rows, g.vocab_size, p.ids.len(), &table);
    assert!(
        w > 1e-2,
        "{}: without its feature the logits still match ({w:.2e}): the goldens do not check it",
        g.family
    );
    eprintln!("{} with its feature off: max|Δ|/std {w:.2e}", g.family);
}

#[test]
fn qwen2_matches_transformers() {
    check_model("qwen2", Family::Qwen2);
}

#[test]
fn qwen2_goldens_check_the_qkv_biases() {
    check_feature_matters("qwen2", Family::Qwen2, |cfg, w| {
        assert!(cfg.qkv_bias && !cfg.qk_norm && !cfg.o_bias);
        for l in &mut w.layers {
            l.qkv_bias = None;
        }
    });
}

#[test]
fn llama3_matches_transformers() {
    check_model("llama3", Family::Llama);
}

#[test]
fn llama3_goldens_check_the_rope_scaling() {
    check_feature_matters("llama3", Family::Llama, |cfg, _| {
        assert!(cfg.rope_scaling.is_some());
        cfg.rope_scaling = None;
    });
}

#[test]
fn mistral_matches_transformers() {
    check_model("mistral", Family::Mistral);
}

#[test]
fn mistral_goldens_check_the_sliding_window() {
    check_feature_matters("mistral", Family::Mistral, |cfg, _| {
        assert_eq!(cfg.sliding_window, Some(8));
        cfg.sliding_window = None;
    });
}

#[test]
fn llama_with_attention_bias_matches_transformers() {
    check_model(LLAMA_BIAS, Family::Llama);
}

#[test]
fn llama_bias_goldens_check_the_o_proj_bias() {
    check_feature_matters(LLAMA_BIAS, Family::Llama, |cfg, w| {
        assert!(cfg.qkv_bias && cfg.o_bias && cfg.tie_word_embeddings);
        assert!(cfg.rope_scaling.is_none());
        for l in &mut w.layers {
            l.o_bias = None;
        }
    });
}
