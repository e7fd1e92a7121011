//! The Qwen3 tokenizer and chat template against transformers' goldens
//! (`scripts/goldens/make_chat_goldens.py`), and incremental detokenization.

use std::path::Path;

use serde::Deserialize;
use tandem_engine::tokenizer::chat::ChatRequest;
use tandem_engine::tokenizer::{tokenizer_hash, ChatTemplate, IncrementalDecoder, Tokenizer};

#[derive(Deserialize)]
struct Goldens {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: serde_json::Value,
    tools: Option<serde_json::Value>,
    add_generation_prompt: bool,
    extra: serde_json::Value,
    rendered: String,
    ids: Vec<u32>,
}

fn tokenizer_dir() -> std::path::PathBuf {
    tandem_engine::tiny::ensure_tokenizer_files().expect("fetch the Qwen3 tokenizer files")
}

#[test]
fn qwen3_chat_template_renders_like_transformers() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/chat_templates.json");
    let g: Goldens = serde_json::from_str(&std::fs::read_to_string(path).expect("read goldens"))
        .expect("parse goldens");
    let dir = tokenizer_dir();
    let template = ChatTemplate::load(&dir)
        .expect("load template")
        .expect("Qwen3 has a template");
    let tok = Tokenizer::load(&dir).expect("load tokenizer");
    assert!(g.cases.len() >= 8);
    for case in &g.cases {
        let req = ChatRequest {
            messages: &case.messages,
            tools: case.tools.as_ref(),
            add_generation_prompt: case.add_generation_prompt,
            extra: Some(&case.extra),
        };
        let ours = template
            .render(&req)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(ours, case.rendered, "{}: rendering differs", case.name);
        assert_eq!(
            tok.encode(&ours, false).expect("encode"),
            case.ids,
            "{}: token ids differ",
            case.name
        );
    }
}

#[test]
fn incremental_decoding_yields_valid_utf8_deltas_that_add_up() {
    let tok = Tokenizer::load(&tokenizer_dir()).expect("load tokenizer");
    let text = "Hi 🚀 naïve 服务器 — done. <|im_end|>";
    let ids = tok.encode(text, false).expect("encode");
    // The emoji and CJK characters span several byte-level tokens: some pushes must hold
    // back, none may emit a replacement character.
    let mut dec = IncrementalDecoder::new(false);
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let delta = dec.push(&tok, id).expect("push");
        assert!(!delta.contains('\u{FFFD}'), "delta {delta:?}");
        held += usize::from(delta.is_empty());
        out.push_str(&delta);
    }
    out.push_str(&dec.flush(&tok).expect("flush"));
    assert_eq!(out, tok.decode(&ids, false).expect("decode"));
    assert_eq!(out, text);
    assert!(held > 0, "expected some tokens to be held back");

    // Skipping special tokens drops <|im_end|>.
    let mut dec = IncrementalDecoder::new(true);
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&dec.push(&tok, id).expect("push"));
    }
    assert_eq!(out, "Hi 🚀 naïve 服务器 — done. ");
}

#[test]
fn tokenizer_basics_and_hash() {
    let dir = tokenizer_dir();
    let tok = Tokenizer::load(&dir).expect("load tokenizer");
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(151645));
    assert_eq!(tok.token_to_id("<think>"), Some(151667));
    assert_eq!(tok.vocab_size(), 151669);
    assert_eq!(tok.file_sha256(), tandem_engine::tiny::TOKENIZER_SHA256);
    let t = ChatTemplate::load(&dir).expect("load").expect("template");
    let h1 = tokenizer_hash(&tok, Some(&t));
    let other = ChatTemplate::new("{{ 1 }}".into(), None, None).expect("compile");
    assert_ne!(h1, tokenizer_hash(&tok, Some(&other)));
    assert_eq!(h1.len(), 64);
    let e = Tokenizer::load(Path::new("/nonexistent"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}
