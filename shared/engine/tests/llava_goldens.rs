//! The tiny random LLaVA (`tandem model tiny-vl`) against transformers on CPU in f32
//! (goldens made by `scripts/goldens/llava.py` on the GPU machine, committed in
//! `shared/tiny-model/goldens/llava/` with the weights' hash):
//! - preprocessing (`tandem-media`) of the goldens' images gives transformers' pixel values
//!   (PNG exactly to one uint8 step; JPEG within the decoders' 4 steps);
//! - the vision tower's selected hidden states and the projected image features are within
//!   1e-4 of their std;
//! - the logits of the image prompts' last positions are within 1e-4 of the row's std, every
//!   position's argmax agrees (except where the reference's top-2 margin is tiny), and the
//!   engine's greedy tokens are transformers' `generate` tokens.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::backend::{Backend, LogitsMode, SeqInput};
use tandem_engine::engine::{Engine, EngineConfig, Request};
use tandem_engine::kv::layout::KvDtype;
use tandem_engine::model::weights::file_sha256;
use tandem_engine::model::{LoadOptions, LoadedModel};
use tandem_engine::request::{MediaEmbedding, MediaSpan};
use tandem_engine::sampler::SamplingParams;

const TOL: f32 = 1e-4;

#[derive(Deserialize)]
struct Manifest {
    weights_sha256: String,
    image_token_index: u32,
    images: Vec<ImageFile>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct ImageFile {
    file: String,
}

#[derive(Deserialize)]
struct Tensor {
    file: String,
    shape: Vec<usize>,
}

#[derive(Deserialize)]
struct Case {
    case: String,
    input_ids: Vec<u32>,
    pixel_values: Tensor,
    vision_hidden: Tensor,
    image_features: Tensor,
    logits_last: Tensor,
    logits_last_positions: Vec<usize>,
    argmax: Vec<u32>,
    top2_margin: Vec<f32>,
    greedy_tokens: Vec<u32>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn goldens_dir() -> PathBuf {
    root().join("shared/tiny-model/goldens/llava")
}

fn manifest() -> Manifest {
    let text = std::fs::read_to_string(goldens_dir().join("manifest.json")).expect("manifest");
    serde_json::from_str(&text).expect("parse manifest.json")
}

fn read_f32(t: &Tensor) -> Vec<f32> {
    let bytes = std::fs::read(goldens_dir().join(&t.file)).expect("golden tensor");
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(v.len(), t.shape.iter().product::<usize>(), "{}", t.file);
    v
}

fn std_of(v: &[f32]) -> f32 {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt() as f32
}

/// The largest |ours - theirs| as a fraction of theirs' std.
fn max_rel(what: &str, ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    let s = std_of(theirs);
    let worst = ours
        .iter()
        .zip(theirs)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs() / s));
    assert!(worst <= TOL, "{what}: max |Δ| / std = {worst}");
    worst
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

fn model(m: &Manifest) -> LoadedModel {
    let dir = tandem_engine::tiny::ensure_tiny_vl_model().expect("build the tiny LLaVA model");
    let sha = file_sha256(&dir.join("model.safetensors")).expect("hash weights");
    assert_eq!(
        sha, m.weights_sha256,
        "the tiny LLaVA's weights differ from those the goldens were made from: rerun \
         scripts/goldens/llava.py on the GPU machine and commit its output"
    );
    LoadedModel::load(&dir, &LoadOptions::default()).expect("load the tiny LLaVA model")
}

/// The images of each case, as `scripts/goldens/llava.py` assigns them.
fn case_images(case: &str) -> &'static [usize] {
    match case {
        "one_image" => &[0],
        "two_images" => &[0, 1],
        _ => &[2],
    }
}

#[test]
fn preprocessing_matches_transformers_pixel_values() {
    let m = manifest();
    let dir = tandem_engine::tiny::ensure_tiny_vl_model().expect("tiny LLaVA");
    let json = std::fs::read_to_string(dir.join("preprocessor_config.json")).unwrap();
    let processor = tandem_media::ClipImageProcessor::from_json(&json).unwrap();
    let policy = tandem_media::MediaPolicy::default();
    let min_std = 0.261_302_6_f32;
    for case in &m.cases {
        let theirs = read_f32(&case.pixel_values);
        let mut ours = Vec::new();
        let mut jpeg = false;
        for &i in case_images(&case.case) {
            let file = &m.images[i].file;
            jpeg |= file.ends_with(".jpg");
            let bytes = std::fs::read(root().join("scripts/goldens/llava_images").join(file))
                .expect("golden image");
            let img = tandem_media::decode_image(&bytes, &policy).unwrap();
            ours.extend(processor.preprocess(&img).unwrap().data);
        }
        // One uint8 step after normalisation for PNG. JPEG decoders differ (zune-jpeg against
        // libjpeg-turbo's IDCT and upsampling): up to 7 steps on this checkerboard's edges.
        let steps = if jpeg { 7.0 } else { 1.0 };
        let tol = steps / 255.0 / min_std + 1e-5;
        let worst = ours
            .iter()
            .zip(&theirs)
            .fold(0.0f32, |w, (a, b)| w.max((a - b).abs()));
        assert!(worst <= tol, "{}: max |Δ| {worst} > {tol}", case.case);
    }
}

#[test]
fn vision_tower_and_projector_match_transformers() {
    let m = manifest();
    let model = model(&m);
    let vision = model.vision.as_ref().expect("the model has a vision tower");
    assert_eq!(vision.config.image_token_index, m.image_token_index);
    for case in &m.cases {
        let pixels = read_f32(&case.pixel_values);
        let hidden = vision.vision_features(&pixels).unwrap();
        let h = max_rel(&case.case, &hidden, &read_f32(&case.vision_hidden));
        let features = vision.encode(&pixels).unwrap();
        let f = max_rel(&case.case, &features, &read_f32(&case.image_features));
        eprintln!(
            "{}: vision hidden Δ/std {h:.2e}, features Δ/std {f:.2e}",
            case.case
        );
    }
}

/// The case's image spans (runs of the image token) with the golden features as rows.
fn media(case: &Case, image_token: u32, features: &[f32], hidden: usize) -> Vec<MediaEmbedding> {
    let mut spans = Vec::new();
    let ids = &case.input_ids;
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token {
            i += 1;
            continue;
        }
        let start = i;
        while i < ids.len() && ids[i] == image_token {
            i += 1;
        }
        spans.push((start, i - start));
    }
    let mut offset = 0;
    spans
        .into_iter()
        .enumerate()
        .map(|(k, (start, len))| {
            let data = features[offset..offset + len * hidden].to_vec();
            offset += len * hidden;
            MediaEmbedding {
                span: MediaSpan {
                    start,
                    len,
                    // A content hash (FNV-1a over the rows): the prefix cache keys on it, so
                    // two images behind the same text never share KV.
                    hash: data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
                        (h ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3)
                    }) ^ k as u64,
                },
                data: Arc::new(data),
            }
        })
        .collect()
}

#[test]
fn image_prompt_logits_match_transformers() {
    let m = manifest();
    let model = model(&m);
    let vision = model.vision.as_ref().unwrap();
    let hidden = model.config.hidden_size;
    let vocab = model.config.vocab_size;
    for case in &m.cases {
        let features = vision.encode(&read_f32(&case.pixel_values)).unwrap();
        let media = media(case, m.image_token_index, &features, hidden);
        let mut be = CpuBackend::new(&model, KvDtype::F32, 16, 8).unwrap();
        let table: Vec<u32> = (0..8).collect();
        let out = be
            .forward(&[SeqInput {
                tokens: &case.input_ids,
                start_pos: 0,
                block_table: &table,
                logits: LogitsMode::All,
                media: &media,
            }])
            .unwrap();
        let rows = &out.logits[0];
        for (p, (&want, &margin)) in case.argmax.iter().zip(&case.top2_margin).enumerate() {
            if margin > 1e-3 {
                assert_eq!(argmax(&rows[p]), want, "{}: argmax at {p}", case.case);
            }
        }
        let theirs = read_f32(&case.logits_last);
        for (k, &p) in case.logits_last_positions.iter().enumerate() {
            max_rel(
                &format!("{} position {p}", case.case),
                &rows[p],
                &theirs[k * vocab..(k + 1) * vocab],
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_match_transformers_generate() {
    let m = manifest();
    let model = model(&m);
    let vision = model.vision.clone().unwrap();
    let hidden = model.config.hidden_size;
    let be = CpuBackend::new(&model, KvDtype::F32, 4, 256).unwrap();
    let cfg = EngineConfig {
        max_batch_size: 4,
        max_num_tokens: 16,
        max_seq_len: 128,
        num_blocks: 256,
        eos_token_ids: vec![],
        ..EngineConfig::default()
    };
    let h = Engine::start(Box::new(be), None, cfg).unwrap();
    for case in &m.cases {
        let features = vision.encode(&read_f32(&case.pixel_values)).unwrap();
        let req = Request {
            replayed: 0,
            request_id: case.case.clone(),
            prompt: case.input_ids.clone(),
            params: SamplingParams {
                max_tokens: Some(case.greedy_tokens.len()),
                ignore_eos: true,
                ..SamplingParams::greedy()
            },
            cache_salt: None,
            media: media(case, m.image_token_index, &features, hidden),
        };
        let outs: Vec<_> = tokio::time::timeout(
            std::time::Duration::from_secs(120),
            h.submit(req).await.unwrap().collect(),
        )
        .await
        .unwrap();
        let tokens: Vec<u32> = outs.iter().flat_map(|o| o.token_ids.clone()).collect();
        assert_eq!(tokens, case.greedy_tokens, "{}: greedy tokens", case.case);
        let usage = outs.iter().find_map(|o| o.usage).unwrap();
        assert_eq!(
            usage.prompt_tokens,
            case.input_ids.len(),
            "image tokens are counted"
        );
    }
}

/// The tiny LLaVA's tensors re-saved under `rename`d names into a folder of its own.
fn relabelled(name: &str, rename: impl Fn(&str) -> String) -> PathBuf {
    let src = tandem_engine::tiny::ensure_tiny_vl_model().expect("build the tiny LLaVA model");
    let dir = std::env::temp_dir().join(format!("llava-layout-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let renamed: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(n, view)| (rename(&n), view))
        .collect();
    safetensors::serialize_to_file(renamed, None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn towers_of_every_checkpoint_layout_encode_alike() {
    let m = manifest();
    let pixels = read_f32(&m.cases[0].pixel_values);
    let src = tandem_engine::tiny::ensure_tiny_vl_model().unwrap();
    let (hub, _) = tandem_engine::model::load_vision(&src).unwrap();
    let want = hub.encode(&pixels).unwrap();
    // transformers 5 saves the CLIP transformer itself under `vision_tower.`; 4.52–4.57 put
    // every part under `model.`.
    let v5 = relabelled("v5", |n| {
        n.replace("vision_tower.vision_model.", "vision_tower.")
    });
    let v452 = relabelled("v452", |n| match n.strip_prefix("language_model.") {
        Some(rest) => format!("model.language_model.{rest}"),
        None => format!("model.{n}"),
    });
    for dir in [v5, v452] {
        let (tower, _) = tandem_engine::model::load_vision(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert_eq!(tower.encode(&pixels).unwrap(), want, "{}", dir.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
