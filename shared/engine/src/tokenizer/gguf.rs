//! A `tokenizer.json` (the `tokenizers` crate's format) and a `tokenizer_config.json` (chat
//! template, bos/eos tokens) built from a GGUF file's `tokenizer.*` metadata, so that a GGUF
//! model is tokenized like its Hugging Face original and the files can be served to routers.
//!
//! Supported: `tokenizer.ggml.model = gpt2` (byte-level BPE: vocab, merges, token types,
//! the pre-tokenizer named by `tokenizer.ggml.pre`) and `llama` (SentencePiece BPE: pieces
//! with scores and byte fallback, converted as transformers' `LlamaConverter` does — merges
//! generated from the scores, `▁` for spaces, a dummy prefix when `add_space_prefix`).

use serde_json::{json, Value as Json};

use crate::error::EngineError;
use crate::model::gguf::file::{GgufFile, Value};

/// The files derived from a GGUF's metadata, as bytes (written out as they are; the
/// tokenizer hash is taken over these bytes).
pub struct GgufTokenizerFiles {
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config_json: Vec<u8>,
    pub generation_config_json: Vec<u8>,
}

/// The split regexes of Llama 3's and Qwen2's tokenizer.json (before a regex-free ByteLevel).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(regex: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

/// The pre-tokenizer of a llama.cpp pre-tokenizer name (`tokenizer.ggml.pre`), as Hugging
/// Face's tokenizer.json of those models has it.
fn pre_tokenizer(pre: &str) -> Json {
    match pre {
        // llama.cpp: "\p{N}" then GPT-2's regex: single digits, then byte-level.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]})
        }
        "llama3" | "llama-bpe" | "llama-v3" | "dbrx" | "smaug-bpe" | "falcon3" | "pixtral" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]})
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" => {
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]})
        }
        "default" | "gpt2" | "gpt-2" | "" => byte_level(true),
        other => {
            tracing::warn!(
                pre = other,
                "GGUF pre-tokenizer {other:?} is not known here; using GPT-2's"
            );
            byte_level(true)
        }
    }
}

fn get<'a>(f: &'a GgufFile, key: &str) -> Result<&'a Value, EngineError> {
    f.get(key).ok_or_else(|| EngineError::BadFile {
        path: f.path.clone(),
        message: format!("metadata {key} is missing"),
    })
}

fn strings(f: &GgufFile, key: &str) -> Result<Vec<String>, EngineError> {
    let bad = || EngineError::BadFile {
        path: f.path.clone(),
        message: format!("metadata {key} is not an array of strings"),
    };
    get(f, key)?
        .as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|v| v.as_str().map(String::from).ok_or_else(bad))
        .collect()
}

fn id(f: &GgufFile, key: &str) -> Option<u32> {
    f.get(key).and_then(Value::as_u64).map(|v| v as u32)
}

/// Builds the tokenizer files of a GGUF file.
pub fn tokenizer_files(f: &GgufFile) -> Result<GgufTokenizerFiles, EngineError> {
    let model = tokenizer_model(f)?;
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let types: Vec<u64> = f
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
        .unwrap_or_default();
    let (vocab, added) = vocab_and_added_tokens(&tokens, &types);
    let add_bos = f
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(model == "llama");
    let post = post_processor(f, &tokens, add_bos);
    let parts = if model == "gpt2" {
        bpe_parts(f, vocab)?
    } else {
        spm_parts(f, &tokens, &types, vocab)?
    };
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": parts.normalizer,
        "pre_tokenizer": parts.pre_tokenizer,
        "post_processor": post,
        "decoder": parts.decoder,
        "model": parts.model,
    });
    Ok(GgufTokenizerFiles {
        // Compact: the vocab and merges are large.
        tokenizer_json: serde_json::to_vec(&tok).unwrap_or_default(),
        tokenizer_config_json: pretty(&tokenizer_config(f, &tokens, add_bos)),
        generation_config_json: pretty(&generation_config(f)),
    })
}

/// `tokenizer.ggml.model`, when it is one this converter implements.
fn tokenizer_model(f: &GgufFile) -> Result<&str, EngineError> {
    let model = get(f, "tokenizer.ggml.model")?.as_str().unwrap_or_default();
    if model != "gpt2" && model != "llama" {
        return Err(EngineError::Tokenizer(format!(
            "{}: tokenizer.ggml.model {model:?} is not implemented (\"gpt2\", byte-level BPE, \
             and \"llama\", SentencePiece, are)",
            f.path.display()
        )));
    }
    Ok(model)
}

/// The vocabulary (piece → id, first id wins) and the added tokens (control and user-defined
/// pieces).
fn vocab_and_added_tokens(
    tokens: &[String],
    types: &[u64],
) -> (serde_json::Map<String, Json>, Vec<Json>) {
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(json!(i));
        // Token types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
        let ty = types.get(i).copied().unwrap_or(1);
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == 3,
            }));
        }
    }
    (vocab, added)
}

/// The piece of the token id stored under `key`.
fn token_piece(f: &GgufFile, tokens: &[String], key: &str) -> Option<String> {
    id(f, key).and_then(|i| tokens.get(i as usize).cloned())
}

/// The post-processor adding BOS in front of every sequence, when the file asks for it.
fn post_processor(f: &GgufFile, tokens: &[String], add_bos: bool) -> Json {
    match (
        token_piece(f, tokens, "tokenizer.ggml.bos_token_id"),
        add_bos,
    ) {
        (Some(b), true) => {
            let bid = id(f, "tokenizer.ggml.bos_token_id");
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b.clone(): {"id": b, "ids": [bid], "tokens": [b]}}})
        }
        _ => Json::Null,
    }
}

/// Normalizer, pre-tokenizer, decoder and model of a tokenizer.json.
struct ModelParts {
    normalizer: Json,
    pre_tokenizer: Json,
    decoder: Json,
    model: Json,
}

/// The parts of a byte-level BPE (`gpt2`) vocabulary.
fn bpe_parts(
    f: &GgufFile,
    vocab: serde_json::Map<String, Json>,
) -> Result<ModelParts, EngineError> {
    let pre = f
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": null,
        "continuing_subword_prefix": null, "end_of_word_suffix": null,
        "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
        "vocab": Json::Object(vocab),
        "merges": strings(f, "tokenizer.ggml.merges")?,
    });
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    Ok(ModelParts {
        normalizer: Json::Null,
        pre_tokenizer: pre_tokenizer(pre),
        decoder,
        model,
    })
}

/// `tokenizer_config.json`: chat template, BOS/EOS/pad pieces, context length.
fn tokenizer_config(f: &GgufFile, tokens: &[String], add_bos: bool) -> Json {
    let mut cfg = serde_json::Map::new();
    if let Some(t) = f.get("tokenizer.chat_template").and_then(Value::as_str) {
        cfg.insert("chat_template".into(), json!(t));
    }
    cfg.insert("add_bos_token".into(), json!(add_bos));
    for (k, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
    ] {
        if let Some(v) = token_piece(f, tokens, key) {
            cfg.insert(k.into(), json!(v));
        }
    }
    if let Some(p) = token_piece(f, tokens, "tokenizer.ggml.padding_token_id") {
        cfg.insert("pad_token".into(), json!(p));
    }
    cfg.insert("model_max_length".into(), json!(context_length(f)));
    Json::Object(cfg)
}

/// `generation_config.json`: EOS ids (EOS and end-of-turn), BOS and pad ids.
fn generation_config(f: &GgufFile) -> Json {
    let mut eos_ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
        .iter()
        .filter_map(|k| id(f, k))
        .collect();
    eos_ids.dedup();
    let mut gen = serde_json::Map::new();
    gen.insert("eos_token_id".into(), json!(eos_ids));
    for (k, key) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(v) = id(f, key) {
            gen.insert(k.into(), json!(v));
        }
    }
    Json::Object(gen)
}

fn pretty(v: &Json) -> Vec<u8> {
    let mut b = serde_json::to_vec_pretty(v).unwrap_or_default();
    b.push(b'\n');
    b
}

fn context_length(f: &GgufFile) -> u64 {
    let arch = f
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("llama");
    f.get(&format!("{arch}.context_length"))
        .and_then(Value::as_u64)
        .unwrap_or(2048)
}

/// A merge generated from a SentencePiece vocabulary: pieces `l` + `r` make piece `piece`.
struct Merge<'a> {
    score: f64,
    len_l: usize,
    len_r: usize,
    piece: usize,
    id_l: usize,
    id_r: usize,
    l: &'a str,
    r: &'a str,
}

/// Normalizer, pre-tokenizer, decoder and model of a SentencePiece (`llama`) vocabulary, as
/// transformers' `LlamaConverter` builds them: BPE over the pieces with byte fallback, merges
/// generated from the piece scores (see [`spm_merges`]).
fn spm_parts(
    f: &GgufFile,
    tokens: &[String],
    types: &[u64],
    vocab: serde_json::Map<String, Json>,
) -> Result<ModelParts, EngineError> {
    let merges = spm_merges(f, tokens, types)?;
    let unk = token_piece(f, tokens, "tokenizer.ggml.unknown_token_id");
    let prefix = f
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if prefix {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"}, replace]})
    } else {
        replace
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": unk,
        "continuing_subword_prefix": null, "end_of_word_suffix": null,
        "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
        "vocab": Json::Object(vocab),
        "merges": merges,
    });
    Ok(ModelParts {
        normalizer,
        pre_tokenizer: Json::Null,
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        model,
    })
}

/// The merges of a SentencePiece vocabulary (transformers' `generate_merges`): every split of
/// a piece into two pieces, ordered by the merged piece's score, then the lengths of the halves.
fn spm_merges(f: &GgufFile, tokens: &[String], types: &[u64]) -> Result<Vec<Json>, EngineError> {
    let scores: Vec<f64> = f
        .get("tokenizer.ggml.scores")
        .and_then(Value::as_array)
        .ok_or_else(|| EngineError::BadFile {
            path: f.path.clone(),
            message: "metadata tokenizer.ggml.scores is missing (a SentencePiece vocab needs it)"
                .into(),
        })?
        .iter()
        .map(|v| v.as_f64().unwrap_or(0.0))
        .collect();
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .rev()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<Merge<'_>> = Vec::new();
    for (pi, piece) in tokens.iter().enumerate() {
        if types.get(pi).copied().unwrap_or(1) == 6 {
            continue; // <0xXX> byte pieces are not merges
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&il), Some(&ir)) = (ids.get(l), ids.get(r)) {
                let score = scores.get(pi).copied().unwrap_or(0.0);
                merges.push(Merge {
                    score,
                    len_l: l.chars().count(),
                    len_r: r.chars().count(),
                    piece: pi,
                    id_l: il,
                    id_r: ir,
                    l,
                    r,
                });
            }
        }
    }
    merges.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.len_l.cmp(&a.len_l))
            .then(b.len_r.cmp(&a.len_r))
            .then(a.piece.cmp(&b.piece))
            .then(a.id_l.cmp(&b.id_l))
            .then(a.id_r.cmp(&b.id_r))
    });
    Ok(merges.iter().map(|m| json!([m.l, m.r])).collect())
}
