//! The CPU engine against Hugging Face transformers on the built-in tiny model.
//!
//! Goldens come from `scripts/goldens/make_goldens.py` (transformers, f32, eager attention).
//! Storing full logit rows (151,936 f32) for every position would take hundreds of MB, so the
//! goldens keep full rows only for a few positions and, for every position, the argmax, the
//! std and max|logit| of the row and its top-20 ids and values. The check per position is
//! therefore: argmax identical; |Δ| / std ≤ 1e-4 on the top-20 values, on max|logit| and on the
//! std itself; and on the positions with full rows, max |Δlogit| / std ≤ 1e-4 over the whole
//! row. Free-running greedy tokens (32) must be identical.

use std::path::{Path, PathBuf};

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
    text: String,
    ids: Vec<u32>,
    positions: Vec<Position>,
    full_rows: Vec<FullRow>,
    greedy: Vec<u32>,
}

#[derive(Deserialize)]
struct Position {
    argmax: u32,
    std: f32,
    max_abs: f32,
    top_ids: Vec<u32>,
    top_values: Vec<f32>,
}

#[derive(Deserialize)]
struct FullRow {
    position: usize,
    row_index: usize,
}

fn goldens_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens")
}

fn goldens() -> Goldens {
    let text = std::fs::read_to_string(goldens_dir().join("tiny_logits.json"))
        .expect("read tests/goldens/tiny_logits.json");
    serde_json::from_str(&text).expect("parse tiny_logits.json")
}

fn full_row(index: usize, vocab: usize) -> Vec<f32> {
    let bytes = std::fs::read(goldens_dir().join("tiny_logits_rows.bin")).expect("rows.bin");
    bytes[index * vocab * 4..(index + 1) * vocab * 4]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The tiny model from the cache, after checking it is the one the goldens were made from.
fn model(g: &Goldens) -> LoadedModel {
    let dir = tandem_engine::tiny::ensure_tiny_model().expect("build the tiny model");
    let sha = file_sha256(&dir.join("model.safetensors")).expect("hash weights");
    assert_eq!(
        sha, g.weights_sha256,
        "the tiny model's weights differ from those the goldens were made from: the generator \
         changed; rerun scripts/goldens/make_goldens.py (see its docs) and commit the output"
    );
    LoadedModel::load(&dir, &LoadOptions::default()).expect("load the tiny model")
}

fn std_of(row: &[f32]) -> f32 {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
    (row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt() as f32
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

/// Checks one position; returns the largest |Δ| / std seen (for the report line).
fn check_position(what: &str, ours: &[f32], g: &Position) -> f32 {
    let s = g.std;
    let mut worst = 0.0f32;
    assert_eq!(argmax(ours), g.argmax, "{what}: argmax");
    let ds = (std_of(ours) - s).abs() / s;
    assert!(ds <= TOL, "{what}: std differs by {ds} of std");
    let ma = ours.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(
        (ma - g.max_abs).abs() / s <= TOL,
        "{what}: max|logit| {ma} vs {}",
        g.max_abs
    );
    for (id, v) in g.top_ids.iter().zip(&g.top_values) {
        let d = (ours[*id as usize] - v).abs() / s;
        assert!(
            d <= TOL,
            "{what}: logit of {id}: {} vs {v} (Δ/std {d})",
            ours[*id as usize]
        );
        worst = worst.max(d);
    }
    worst.max(ds)
}

/// Teacher-forced logits of every prompt position, the prompt run in chunks of `chunk`
/// tokens over a block table of scattered block ids.
fn teacher_forced(be: &mut CpuBackend, ids: &[u32], chunk: usize, table: &[u32]) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    let mut start = 0;
    while start < ids.len() {
        let end = (start + chunk).min(ids.len());
        let out = be
            .forward(&[SeqInput {
                tokens: &ids[start..end],
                start_pos: start,
                block_table: table,
                logits: LogitsMode::All,
                media: Default::default(),
            }])
            .expect("forward");
        rows.extend(out.logits.into_iter().next().expect("one sequence"));
        start = end;
    }
    rows
}

fn scattered_table(n: usize, offset: u32) -> Vec<u32> {
    // Reverse, offset order: block ids need not be contiguous or increasing.
    (0..n as u32).rev().map(|b| b * 2 + offset).collect()
}

#[test]
fn teacher_forced_logits_match_transformers() {
    let g = goldens();
    let m = model(&g);
    assert_eq!(m.config.vocab_size, g.vocab_size);
    let block = 16;
    // Whole, and split over two tensor-parallel ranks (threads joined by an all-reduce).
    for tp in [1, 2] {
        let mut be = CpuBackend::new(&m, KvDtype::F32, block, 64)
            .and_then(|be| be.with_tensor_parallel(tp))
            .expect("backend");
        let worst = teacher_forced_against_goldens(&g, &m, &mut be, block);
        eprintln!(
            "tensor parallel {tp}: largest |Δlogit| / std against transformers: {worst:.2e} \
             (tolerance {TOL:.0e})"
        );
    }
}

/// Checks every prompt's teacher-forced logits (one chunk, then chunks of 7) against the
/// goldens; returns the largest |Δ| / std seen.
fn teacher_forced_against_goldens(
    g: &Goldens,
    m: &LoadedModel,
    be: &mut CpuBackend,
    block: usize,
) -> f32 {
    let mut worst = 0.0f32;
    for p in &g.prompts {
        assert_eq!(
            m.tokenizer.encode(&p.text, false).expect("encode"),
            p.ids,
            "{}: our tokenizer disagrees with transformers' ids",
            p.name
        );
        let table = scattered_table(p.ids.len().div_ceil(block), 1);
        // One chunk, then chunks that do not align with blocks (chunked prefill).
        for chunk in [p.ids.len(), 7] {
            let rows = teacher_forced(be, &p.ids, chunk, &table);
            assert_eq!(rows.len(), p.ids.len());
            for (i, (ours, gp)) in rows.iter().zip(&p.positions).enumerate() {
                let w = check_position(&format!("{} chunk {chunk} pos {i}", p.name), ours, gp);
                worst = worst.max(w);
            }
            for fr in &p.full_rows {
                let gold = full_row(fr.row_index, g.vocab_size);
                let ours = &rows[fr.position];
                let s = std_of(&gold);
                let max = ours
                    .iter()
                    .zip(&gold)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    max / s <= TOL,
                    "{} pos {}: max|Δlogit|/std = {}",
                    p.name,
                    fr.position,
                    max / s
                );
                worst = worst.max(max / s);
            }
        }
    }
    worst
}

#[test]
fn batched_prefill_matches_transformers() {
    let g = goldens();
    let m = model(&g);
    let block = 32;
    let mut be = CpuBackend::new(&m, KvDtype::F32, block, 32).expect("backend");
    let tables: Vec<Vec<u32>> = g
        .prompts
        .iter()
        .enumerate()
        .map(|(i, p)| scattered_table(p.ids.len().div_ceil(block), i as u32 * 8))
        .collect();
    let batch: Vec<SeqInput<'_>> = g
        .prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqInput {
            tokens: &p.ids,
            start_pos: 0,
            block_table: t,
            logits: LogitsMode::All,
            media: Default::default(),
        })
        .collect();
    let out = be.forward(&batch).expect("forward");
    for (p, rows) in g.prompts.iter().zip(&out.logits) {
        for (i, (ours, gp)) in rows.iter().zip(&p.positions).enumerate() {
            check_position(&format!("batched {} pos {i}", p.name), ours, gp);
        }
    }
}

#[test]
fn greedy_decoding_matches_transformers() {
    let g = goldens();
    let m = model(&g);
    let block = 16;
    for tp in [1, 2] {
        let mut be = CpuBackend::new(&m, KvDtype::F32, block, 64)
            .and_then(|be| be.with_tensor_parallel(tp))
            .expect("backend");
        greedy_against_goldens(&g, &mut be, block, tp);
    }
}

/// Free-running greedy tokens of every prompt, which must equal transformers'.
fn greedy_against_goldens(g: &Goldens, be: &mut CpuBackend, block: usize, tp: usize) {
    for p in &g.prompts {
        let total = p.ids.len() + p.greedy.len();
        let table = scattered_table(total.div_ceil(block), 0);
        let mut out = be
            .forward(&[SeqInput {
                tokens: &p.ids,
                start_pos: 0,
                block_table: &table,
                logits: LogitsMode::Last,
                media: Default::default(),
            }])
            .expect("prefill");
        let mut got = Vec::new();
        for step in 0..p.greedy.len() {
            let next = argmax(&out.logits[0][0]);
            got.push(next);
            if step + 1 == p.greedy.len() {
                break;
            }
            out = be
                .forward(&[SeqInput {
                    tokens: &[next],
                    start_pos: p.ids.len() + step,
                    block_table: &table,
                    logits: LogitsMode::Last,
                    media: Default::default(),
                }])
                .expect("decode");
        }
        assert_eq!(
            got, p.greedy,
            "{} (tensor parallel {tp}): greedy tokens",
            p.name
        );
    }
}

#[test]
fn bf16_kv_cache_stays_close() {
    // bf16 keys and values round at ~3 significant digits, so only closeness is checked.
    let g = goldens();
    let m = model(&g);
    let block = 16;
    let mut be = CpuBackend::new(&m, KvDtype::Bf16, block, 64).expect("backend");
    let mut same = 0;
    let mut total = 0;
    for p in &g.prompts {
        let table = scattered_table(p.ids.len().div_ceil(block), 0);
        let rows = teacher_forced(&mut be, &p.ids, 5, &table);
        for (ours, gp) in rows.iter().zip(&p.positions) {
            total += 1;
            same += usize::from(argmax(ours) == gp.argmax);
            let d = (ours[gp.top_ids[0] as usize] - gp.top_values[0]).abs() / gp.std;
            assert!(
                d < 0.05,
                "{}: bf16 KV moved the top logit by {d} std",
                p.name
            );
        }
    }
    assert!(same * 10 >= total * 9, "argmax agreed on {same}/{total}");
}

#[test]
fn exported_blocks_continue_in_another_backend() {
    let g = goldens();
    let m = model(&g);
    let p = &g.prompts[2];
    let block = 16;
    let mut a = CpuBackend::new(&m, KvDtype::F32, block, 16).expect("backend a");
    let mut b = CpuBackend::new(&m, KvDtype::F32, block, 16).expect("backend b");
    let n = p.ids.len();
    let blocks = (n + 1).div_ceil(block);
    let ta: Vec<u32> = (0..blocks as u32).collect();
    let tb: Vec<u32> = (0..blocks as u32).map(|i| 15 - i).collect();
    a.forward(&[SeqInput {
        tokens: &p.ids,
        start_pos: 0,
        block_table: &ta,
        logits: LogitsMode::None,
        media: Default::default(),
    }])
    .expect("prefill a");
    let data = a.export_blocks(&ta).expect("export");
    assert_eq!(data.len(), blocks * a.layout().block_bytes());
    assert!(b.layout().check_compatible(a.layout()).is_ok());
    b.import_blocks(&tb, &data).expect("import");
    let step = |be: &mut CpuBackend, t: &[u32]| {
        be.forward(&[SeqInput {
            tokens: &p.greedy[..1],
            start_pos: n,
            block_table: t,
            logits: LogitsMode::Last,
            media: Default::default(),
        }])
        .expect("decode")
        .logits
    };
    assert_eq!(step(&mut a, &ta), step(&mut b, &tb));
    assert!(b.import_blocks(&tb, &data[1..]).is_err());
    assert!(a.export_blocks(&[99]).is_err());
}
