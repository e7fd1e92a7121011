//! The tokenizer's fast path (`tandem_text::fast_bpe`) against the `tokenizers` crate on the
//! real Qwen3 vocabulary: the same ids for generated text that mixes what the pre-tokenizer
//! regex treats differently — letters of both cases, digits, punctuation, contractions, runs of
//! every ASCII space character, line breaks, added tokens, non-ASCII text (left to
//! `tokenizers`) and words too long for the fast path. And the decoding fast path
//! (`tandem_text::fast_decode`) against `tokenizers` on ids of every kind.

use tandem_rng::SplitMix64;
use tandem_text::tokenizer::Tokenizer;

const PARTS: &[&str] = &[
    "a",
    "b",
    "Z",
    "Hello",
    "world",
    "THE",
    "tokenizer",
    "x",
    "q",
    "0",
    "7",
    "42",
    "2026",
    "3.14",
    " ",
    " ",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    "\x0b",
    "\x0c",
    " \n ",
    "  \t ",
    "'s",
    "'S",
    "'ll",
    "'LL",
    "'re",
    "'ve",
    "'m",
    "'d",
    "'t",
    "'",
    "''",
    "\"",
    ",",
    ".",
    "!?",
    "...",
    "-",
    "_",
    "(",
    ")",
    "{",
    "}",
    "<",
    ">",
    "/",
    "\\",
    "#",
    "@",
    "$",
    "%",
    "^",
    "&",
    "*",
    "=",
    "+",
    "~",
    "`",
    "|",
    ";",
    ":",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "é",
    "中文",
    "Ünïcödé",
    "\u{a0}",
    "\u{3000}",
    "🙂",
    "\u{2003}",
    "naïve",
    "fn main() {",
    "    return x;",
    "<|fim_prefix|>",
];

fn text(rng: &mut SplitMix64, max_parts: u64) -> String {
    let n = rng.next_u64() % max_parts;
    let mut s = String::new();
    for _ in 0..n {
        let r = rng.next_u64();
        match r % 50 {
            // Runs long enough to leave the fast path (more than 64 bytes in one pre-token).
            0 => s.push_str(&" ".repeat(60 + (r >> 8) as usize % 20)),
            1 => s.push_str(&"z".repeat(60 + (r >> 8) as usize % 20)),
            _ => s.push_str(PARTS[(r >> 8) as usize % PARTS.len()]),
        }
    }
    s
}

#[test]
fn fast_encoding_equals_tokenizers_on_generated_text() {
    let dir = tandem_tiny_model::ensure_tokenizer_files().expect("the Qwen3 tokenizer files");
    let tok = Tokenizer::load(&dir).expect("load the tokenizer");
    assert!(
        tok.has_fast_path(),
        "Qwen3's tokenizer.json must take the fast path"
    );
    let mut rng = SplitMix64::new(0x5eed);
    let mut tokens = 0;
    for case in 0..20_000 {
        let t = text(&mut rng, if case % 10 == 0 { 200 } else { 24 });
        for special in [false, true] {
            let want = tok
                .inner()
                .encode_fast(t.as_str(), special)
                .expect("tokenizers encodes")
                .get_ids()
                .to_vec();
            let got = tok.encode(&t, special).expect("encodes");
            assert_eq!(
                got, want,
                "case {case}, add_special_tokens {special}: {t:?}"
            );
            tokens += got.len();
        }
    }
    assert!(tokens > 100_000, "{tokens} tokens compared");
}

#[test]
fn fast_encoding_equals_tokenizers_on_prose_and_code() {
    let dir = tandem_tiny_model::ensure_tokenizer_files().expect("the Qwen3 tokenizer files");
    let tok = Tokenizer::load(&dir).expect("load the tokenizer");
    let texts = [
        String::new(),
        " ".into(),
        "   ".into(),
        "\n".into(),
        "word".into(),
        " leading space and trailing   ".into(),
        "It's what they'LL say: \"I'd've done it\" — or won't.".into(),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n".into(),
        "def f(x):\n    if x > 10:\n        return x * 2\n\treturn None  \n\n\n".into(),
        "Numbers 1234567890 and 3.14159, 1e-9, 0xFF, 1,000,000.".into(),
        std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap_or_default(),
    ];
    for t in &texts {
        let want = tok
            .inner()
            .encode_fast(t.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(tok.encode(t, false).unwrap(), want, "{t:?}");
    }
}

#[test]
fn fast_decoding_equals_tokenizers_on_every_kind_of_id() {
    let dir = tandem_tiny_model::ensure_tokenizer_files().expect("the Qwen3 tokenizer files");
    let tok = Tokenizer::load(&dir).expect("load the tokenizer");
    assert!(
        tok.has_fast_decode(),
        "Qwen3's tokenizer.json must take the decoding fast path"
    );
    let vocab = tok.vocab_size() as u64;
    let mut rng = SplitMix64::new(0xdec0de);
    let mut ids_compared = 0;
    for case in 0..20_000 {
        // Windows as the incremental decoder sends them (1-8 ids), and longer runs; ids
        // anywhere in the vocabulary, the added tokens at its end (special or not), ids
        // past it, and the ids of generated text (whole and split characters).
        let len = if case % 10 == 0 {
            64
        } else {
            1 + rng.next_u64() % 8
        };
        let mut ids: Vec<u32> = Vec::new();
        while (ids.len() as u64) < len {
            let r = rng.next_u64();
            match r % 8 {
                0 => ids.push((vocab - 1 - (r >> 8) % 40) as u32),
                1 => ids.push((vocab + (r >> 8) % 1000) as u32),
                2 | 3 => ids.extend(tok.encode(&text(&mut rng, 6), false).expect("encodes")),
                _ => ids.push(((r >> 8) % vocab) as u32),
            }
        }
        for skip in [false, true] {
            assert_eq!(
                tok.decode(&ids, skip).expect("decodes"),
                tok.decode_slow(&ids, skip).expect("tokenizers decodes"),
                "case {case}, skip_special_tokens {skip}: {ids:?}"
            );
        }
        ids_compared += ids.len();
    }
    assert!(ids_compared > 100_000, "{ids_compared} ids compared");
}
