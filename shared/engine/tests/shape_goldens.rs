//! The CPU engine against transformers on the shape-check model: Qwen3-0.6B's layer shapes
//! (hidden 1024, 16/8 heads of 128, intermediate 3072), one layer, an untied lm_head, bf16
//! weights, vocab 4,096 (`tiny::SHAPE_CHECK`). Goldens from
//! `scripts/goldens/make_shape_goldens.py`: full logit rows at every 4th position and the last,
//! the argmax at every position, 16 greedy tokens.

use std::path::Path;

use serde::Deserialize;
use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
use tandem_engine::kv::layout::KvDtype;
use tandem_engine::model::weights::file_sha256;
use tandem_engine::model::{LoadOptions, LoadedModel};

const TOL: f32 = 1e-4;

#[derive(Deserialize)]
struct Goldens {
    weights_sha256: String,
    vocab_size: usize,
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

#[test]
fn qwen3_0_6b_layer_shapes_match_transformers() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens");
    let g: Goldens = serde_json::from_str(
        &std::fs::read_to_string(dir.join("shape_logits.json")).expect("read goldens"),
    )
    .expect("parse goldens");
    let rows: Vec<f32> = std::fs::read(dir.join("shape_logits_rows.bin"))
        .expect("read rows")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let model_dir = tandem_engine::tiny::ensure_shape_check_model().expect("build the model");
    let sha = file_sha256(&model_dir.join("model.safetensors")).expect("hash");
    assert_eq!(
        sha, g.weights_sha256,
        "the shape-check model's weights differ from those the goldens were made from: rerun \
         scripts/goldens/make_shape_goldens.py and commit its output"
    );
    let m = LoadedModel::load(&model_dir, &LoadOptions::default()).expect("load");
    assert_eq!(m.config.vocab_size, g.vocab_size);
    assert!(
        m.weights.lm_head.is_some(),
        "the shape-check model has an untied lm_head"
    );
    // Whole, and split over 2 and 8 tensor-parallel ranks (8 KV heads: one per rank).
    for tp in [1, 2, 8] {
        let mut be = CpuBackend::new(&m, KvDtype::F32, 16, 32)
            .and_then(|be| be.with_tensor_parallel(tp))
            .expect("backend");
        let worst = check_goldens(&mut be, &g, &rows);
        eprintln!(
            "tensor parallel {tp}: largest |Δlogit| / std against transformers: {worst:.2e} \
             (tolerance {TOL:.0e}); greedy tokens identical"
        );
    }
}

/// Every prompt's logits (in chunks of 10, then whole) and free-running greedy tokens against
/// the goldens; returns the largest |Δ| / std.
fn check_goldens(be: &mut CpuBackend, g: &Goldens, rows: &[f32]) -> f32 {
    let v = g.vocab_size;
    let block = 16;
    let mut worst = 0.0f32;
    for p in &g.prompts {
        let total = p.ids.len() + p.greedy.len();
        let table: Vec<u32> = (0..total.div_ceil(block) as u32).rev().collect();
        // Chunks of 10 (not block aligned; ≤ 16 rows take the GEMV kernels), then the whole
        // prompt at once (the GEMM kernels); all logits.
        let mut ours = Vec::new();
        for chunk_len in [10, p.ids.len()] {
            ours.clear();
            for (c, chunk) in p.ids.chunks(chunk_len).enumerate() {
                let out = be
                    .forward(&[SeqInput {
                        tokens: chunk,
                        start_pos: c * chunk_len,
                        block_table: &table,
                        logits: LogitsMode::All,
                        media: Default::default(),
                    }])
                    .expect("prefill");
                ours.extend(out.logits.into_iter().next().expect("one sequence"));
            }
            for (pos, row) in ours.iter().enumerate() {
                assert_eq!(argmax(row), p.argmax[pos], "{} pos {pos}: argmax", p.name);
            }
            for (k, &pos) in p.row_positions.iter().enumerate() {
                let at = (p.first_row + k) * v;
                let gold = &rows[at..at + v];
                let s = std_of(gold);
                let max = ours[pos]
                    .iter()
                    .zip(gold)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    max / s <= TOL,
                    "{} chunk {chunk_len} pos {pos}: max|Δ|/std {}",
                    p.name,
                    max / s
                );
                worst = worst.max(max / s);
            }
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
        assert_eq!(got, p.greedy, "{}: greedy tokens", p.name);
    }
    worst
}
