//! Encoding speed of a tokenizer folder's `tokenizer.json`: `tokenizers` (`encode_fast`) and
//! Tandem's encoder (its fast path where the vocabulary has one), on the load tester's text
//! prompts (512 words `w<id>`) and on English prose and code; checks both give the same ids.
//!
//! `cargo run --release -p tandem-text --example encode_speed -- DIR [ROUNDS]`

use std::time::Instant;

use tandem_text::tokenizer::Tokenizer;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: encode_speed TOKENIZER_DIR [ROUNDS]")?;
    let rounds: u32 = args.next().map(|r| r.parse()).transpose()?.unwrap_or(300);
    let tok = Tokenizer::load(std::path::Path::new(&dir))?;
    println!("fast path: {}", tok.has_fast_path());
    let mut x: u64 = 12345;
    let words: Vec<String> = (0..512)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            format!("w{}", (x >> 33) % 150000)
        })
        .collect();
    let words = words.join(" ");
    let prose = "The quick brown fox jumps over the lazy dog, while the system prompt explains \
                 the rules.\n\n  Indented   code();  "
        .repeat(40);
    for (name, text) in [
        ("loadtest words", words.as_str()),
        ("prose", prose.as_str()),
    ] {
        let ours = tok.encode(text, false)?;
        let theirs = tok.inner().encode_fast(text, false)?.get_ids().to_vec();
        if ours != theirs {
            return Err(format!("{name}: the encoders disagree").into());
        }
        let time = |f: &dyn Fn()| {
            f();
            let t = Instant::now();
            for _ in 0..rounds {
                f();
            }
            t.elapsed().as_secs_f64() / f64::from(rounds) * 1e6
        };
        let slow = time(&|| {
            std::hint::black_box(tok.inner().encode_fast(text, false).ok());
        });
        let fast = time(&|| {
            std::hint::black_box(tok.encode(text, false).ok());
        });
        println!(
            "{name}: {} tokens; tokenizers {slow:.1} µs, Tandem {fast:.1} µs ({:.1}×)",
            ours.len(),
            slow / fast
        );
    }
    Ok(())
}
