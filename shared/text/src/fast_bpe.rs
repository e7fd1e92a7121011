//! A fast path for encoding text with byte-level BPE tokenizers (GPT-2 / Llama-3 / Qwen2-3
//! style `tokenizer.json`), token for token what the `tokenizers` crate produces.
//!
//! `tokenizers` spends most of a prompt's encoding in allocation (an `Encoding` with
//! per-token strings, offsets and masks) and in its general pipeline; a router tokenizing
//! every prompt pays that per request. This module does the same steps for the one family of
//! configurations it recognises — added tokens split out first (leftmost-longest), the
//! `Split` regex pre-tokenizer (Isolated) followed by `ByteLevel` without its own regex,
//! byte-level BPE merges by rank — over ids only.
//!
//! It takes only what it can prove equal: a `tokenizer.json` outside that family builds no
//! fast path ([`FastBpe::from_json`] says why), and within one, text segments that are not
//! ASCII (where the regex engines' Unicode tables or the normaliser could differ) or hold an
//! over-long pre-token are left to `tokenizers` ([`FastBpe::encode`] returns them as
//! [`Piece::Slow`]). The regex's `\s+(?!\S)` (a lookahead, which the `regex` crate lacks) is
//! matched as `\s+` and given back its last character when more text follows, which is what
//! the lookahead does; tests compare both paths on generated text.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use regex::Regex;
use rustc_hash::FxHashMap;
use serde_json::Value;

/// Why a `tokenizer.json` gets no fast path (it is encoded by `tokenizers` alone).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    #[error("the model is not BPE")]
    NotBpe,
    #[error("BPE option {0} is set")]
    BpeOption(&'static str),
    #[error("the normalizer is not NFC or none")]
    Normalizer,
    #[error("the pre-tokenizer is not a Split regex followed by ByteLevel")]
    PreTokenizer,
    #[error(
        "the split regex does not end in the lookahead this path emulates, or does not compile"
    )]
    Regex,
    #[error("truncation or padding is configured")]
    TruncationOrPadding,
    #[error("an added token has options (lstrip, rstrip, single_word, normalized)")]
    AddedTokenOptions,
    #[error("the vocabulary is not byte-level")]
    NotByteLevel,
    #[error("malformed field {0}")]
    Malformed(&'static str),
}

/// The lookahead alternation the byte-level regexes end with, and what it becomes here.
const LOOKAHEAD_TAIL: &str = r"\s+(?!\S)|\s+";
const PLAIN_TAIL: &str = r"\s+";

/// Pre-tokens longer than this many bytes go to `tokenizers` (whose merge loop is
/// O(n log n); the one here is quadratic, and such words are rare).
const MAX_WORD_BYTES: usize = 64;

/// Merged words kept per thread and tokenizer (their ids), up to this many, then dropped.
const WORD_CACHE_ENTRIES: usize = 1 << 16;

/// A word's bytes → its ids.
type WordCache = FxHashMap<Box<[u8]>, Box<[u32]>>;

/// `(left id, right id)` → `(rank, merged id)`.
type Merges = FxHashMap<(u32, u32), (u32, u32)>;

/// Tokenizers a thread keeps word caches for at once.
const WORD_CACHE_TOKENIZERS: usize = 8;

/// Identifies a [`FastBpe`] in the per-thread word caches.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Per tokenizer, the ids of words merged before on this thread: words repeat, and
    /// their merges are most of the encoding's cost. Per thread, so no lock is shared.
    static WORDS: RefCell<FxHashMap<u64, WordCache>> =
        RefCell::new(FxHashMap::default());
}

/// How one part of a text is encoded.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// Ids encoded here.
    Ids(Vec<u32>),
    /// A segment of the input (byte range) to encode with `tokenizers`.
    Slow(Range<usize>),
}

/// Byte-level BPE encoding for a recognised `tokenizer.json`.
pub struct FastBpe {
    /// Key of this tokenizer's per-thread word caches.
    id: u64,
    split: Regex,
    added: Option<AhoCorasick>,
    added_ids: Vec<u32>,
    /// Id of each single byte's token.
    byte_ids: [u32; 256],
    merges: Merges,
    /// Whole words that are in the vocabulary skip the merges (`ignore_merges`).
    ignore_merges: Option<FxHashMap<Vec<u8>, u32>>,
    /// With `add_special_tokens`, the post-processor adds tokens: not handled here.
    post_adds: bool,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe")
            .field("merges", &self.merges.len())
            .field("added", &self.added_ids.len())
            .finish_non_exhaustive()
    }
}

impl FastBpe {
    /// The fast path for a parsed `tokenizer.json`, or why it has none. `added_id` gives the
    /// id `tokenizers` encodes an added token's content as (it may renumber them).
    pub fn from_json(
        json: &Value,
        added_id: impl Fn(&str) -> Option<u32>,
    ) -> Result<Self, Unsupported> {
        check_no_truncation_or_padding(json)?;
        check_normalizer(&json["normalizer"])?;
        let split = split_regex(&json["pre_tokenizer"])?;
        let post_adds = !matches!(
            json["post_processor"].get("type").and_then(Value::as_str),
            None | Some("ByteLevel")
        );
        let model = &json["model"];
        if model.get("type").and_then(Value::as_str) != Some("BPE") {
            return Err(Unsupported::NotBpe);
        }
        check_bpe_options(model)?;
        let vocab = byte_vocab(model)?;
        let byte_ids = byte_ids(&vocab)?;
        let merges = merges(model, &vocab)?;
        let ignore_merges = model
            .get("ignore_merges")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            .then_some(vocab);
        let (added, added_ids) = added_tokens(&json["added_tokens"], added_id)?;
        Ok(FastBpe {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            split,
            added,
            added_ids,
            byte_ids,
            merges,
            ignore_merges,
            post_adds,
        })
    }

    /// `text` as pieces in order: ids where this path is exact, segments for `tokenizers`
    /// elsewhere. `None` when the whole text must go to `tokenizers` (`add_special_tokens`
    /// with a post-processor that adds tokens).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Option<Vec<Piece>> {
        if add_special_tokens && self.post_adds {
            return None;
        }
        let mut pieces = Vec::new();
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        let mut at = 0;
        if let Some(ac) = &self.added {
            for m in ac.find_iter(text) {
                self.segment(text, at..m.start(), &mut ids, &mut pieces);
                ids.push(self.added_ids[m.pattern().as_usize()]);
                at = m.end();
            }
        }
        self.segment(text, at..text.len(), &mut ids, &mut pieces);
        if !ids.is_empty() {
            pieces.push(Piece::Ids(ids));
        }
        Some(pieces)
    }

    /// Encodes `text[range]` (no added tokens in it) onto `ids`, or hands it to `tokenizers`
    /// as a [`Piece::Slow`] (after flushing `ids` into `pieces`, keeping the order).
    fn segment(
        &self,
        text: &str,
        range: Range<usize>,
        ids: &mut Vec<u32>,
        pieces: &mut Vec<Piece>,
    ) {
        if range.is_empty() {
            return;
        }
        let seg = &text[range.clone()];
        let mark = ids.len();
        if seg.is_ascii() && self.pre_tokenize(seg, ids).is_some() {
            return;
        }
        ids.truncate(mark);
        if !ids.is_empty() {
            pieces.push(Piece::Ids(std::mem::take(ids)));
        }
        pieces.push(Piece::Slow(range));
    }

    /// Splits ASCII `seg` by the regex and encodes each word; `None` on an over-long word.
    fn pre_tokenize(&self, seg: &str, ids: &mut Vec<u32>) -> Option<()> {
        let bytes = seg.as_bytes();
        let mut at = 0;
        while at < seg.len() {
            let m = self.split.find_at(seg, at)?;
            // Isolated split: text between matches is a word too (the byte-level regexes
            // match every character, so this does not happen with them).
            if m.start() > at {
                self.word(&bytes[at..m.start()], ids)?;
            }
            let mut end = m.end();
            if gives_back_last_space(&bytes[m.start()..end], end < seg.len()) {
                end -= 1;
            }
            self.word(&bytes[m.start()..end], ids)?;
            at = end;
        }
        Some(())
    }

    /// One pre-token's ids: its bytes merged by rank, lowest first, leftmost on ties
    /// (`tokenizers`' order).
    fn word(&self, word: &[u8], ids: &mut Vec<u32>) -> Option<()> {
        if word.len() > MAX_WORD_BYTES {
            return None;
        }
        if let [b] = word {
            ids.push(self.byte_ids[*b as usize]);
            return Some(());
        }
        if let Some(&id) = self.ignore_merges.as_ref().and_then(|v| v.get(word)) {
            ids.push(id);
            return Some(());
        }
        WORDS.with_borrow_mut(|caches| {
            // Caches of tokenizers dropped since (or many in turn) do not pile up.
            if caches.len() >= WORD_CACHE_TOKENIZERS && !caches.contains_key(&self.id) {
                caches.clear();
            }
            let cache = caches.entry(self.id).or_default();
            if let Some(hit) = cache.get(word) {
                ids.extend_from_slice(hit);
                return;
            }
            let merged = self.merge(word);
            ids.extend_from_slice(&merged);
            if cache.len() >= WORD_CACHE_ENTRIES {
                cache.clear();
            }
            cache.insert(word.into(), merged.into_boxed_slice());
        });
        Some(())
    }

    /// `word`'s bytes merged by rank.
    fn merge(&self, word: &[u8]) -> Vec<u32> {
        let mut syms: Vec<u32> = word.iter().map(|&b| self.byte_ids[b as usize]).collect();
        loop {
            let best = syms
                .windows(2)
                .enumerate()
                .filter_map(|(i, p)| self.merges.get(&(p[0], p[1])).map(|&(r, id)| (r, i, id)))
                .min_by_key(|&(r, i, _)| (r, i));
            let Some((_, i, id)) = best else { break };
            syms[i] = id;
            syms.remove(i + 1);
        }
        syms
    }
}

/// Whether a match of the trailing `\s+` is one the original `\s+(?!\S)` would have ended a
/// character earlier: a run of at least two spaces (no line break: runs with one match
/// `\s*[\r\n]+` first) that more text follows. A one-character run followed by text is
/// matched by the final `\s+` in both patterns.
fn gives_back_last_space(m: &[u8], followed: bool) -> bool {
    followed
        && m.len() >= 2
        && m.iter().all(|b| b.is_ascii_whitespace() || *b == 0x0b)
        && !m.iter().any(|b| matches!(b, b'\r' | b'\n'))
}

fn check_no_truncation_or_padding(json: &Value) -> Result<(), Unsupported> {
    if json.get("truncation").is_some_and(|v| !v.is_null())
        || json.get("padding").is_some_and(|v| !v.is_null())
    {
        return Err(Unsupported::TruncationOrPadding);
    }
    Ok(())
}

/// ASCII text is unchanged by NFC, so NFC or no normalizer both leave it as it is.
fn check_normalizer(n: &Value) -> Result<(), Unsupported> {
    match n.get("type").and_then(Value::as_str) {
        None if n.is_null() => Ok(()),
        Some("NFC") => Ok(()),
        _ => Err(Unsupported::Normalizer),
    }
}

/// The `Split` regex of a `Sequence[Split(Regex, Isolated), ByteLevel(use_regex false, no
/// prefix space)]` pre-tokenizer, its lookahead tail made plain.
fn split_regex(pre: &Value) -> Result<Regex, Unsupported> {
    let seq = (pre.get("type").and_then(Value::as_str) == Some("Sequence"))
        .then(|| pre.get("pretokenizers").and_then(Value::as_array))
        .flatten()
        .ok_or(Unsupported::PreTokenizer)?;
    let [split, byte_level] = seq.as_slice() else {
        return Err(Unsupported::PreTokenizer);
    };
    let is = |v: &Value, k: &str, want: Value| v.get(k) == Some(&want);
    if !(is(split, "type", "Split".into())
        && is(split, "behavior", "Isolated".into())
        && is(split, "invert", false.into())
        && is(byte_level, "type", "ByteLevel".into())
        && is(byte_level, "add_prefix_space", false.into())
        && is(byte_level, "use_regex", false.into()))
    {
        return Err(Unsupported::PreTokenizer);
    }
    let pattern = split["pattern"]
        .get("Regex")
        .and_then(Value::as_str)
        .ok_or(Unsupported::PreTokenizer)?;
    let head = pattern
        .strip_suffix(LOOKAHEAD_TAIL)
        .ok_or(Unsupported::Regex)?;
    Regex::new(&format!("{head}{PLAIN_TAIL}")).map_err(|_| Unsupported::Regex)
}

fn check_bpe_options(model: &Value) -> Result<(), Unsupported> {
    let set = |k: &str| {
        model
            .get(k)
            .is_some_and(|v| !v.is_null() && v != "" && v != false)
    };
    for k in [
        "dropout",
        "unk_token",
        "continuing_subword_prefix",
        "end_of_word_suffix",
        "byte_fallback",
    ] {
        if set(k) {
            return Err(Unsupported::BpeOption(k));
        }
    }
    Ok(())
}

/// GPT-2's byte ↔ character map: printable bytes stand for themselves, the rest for
/// U+0100 onwards in byte order.
pub(crate) fn byte_of_char() -> FxHashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    let mut map = FxHashMap::default();
    let mut next = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(0xff + next).unwrap_or('\0')
        };
        map.insert(c, b);
    }
    map
}

/// The vocabulary with each token's byte-level string decoded to its bytes.
fn byte_vocab(model: &Value) -> Result<FxHashMap<Vec<u8>, u32>, Unsupported> {
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or(Unsupported::Malformed("model.vocab"))?;
    let map = byte_of_char();
    let mut out = FxHashMap::default();
    out.reserve(vocab.len());
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or(Unsupported::Malformed("model.vocab id"))?;
        let bytes = token
            .chars()
            .map(|c| map.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
            .ok_or(Unsupported::NotByteLevel)?;
        out.insert(bytes, id);
    }
    Ok(out)
}

fn byte_ids(vocab: &FxHashMap<Vec<u8>, u32>) -> Result<[u32; 256], Unsupported> {
    let mut ids = [0u32; 256];
    for (b, id) in ids.iter_mut().enumerate() {
        *id = *vocab.get(&vec![b as u8]).ok_or(Unsupported::NotByteLevel)?;
    }
    Ok(ids)
}

/// Merges in either spelling (`["a", "b"]` or `"a b"`), as ids, ranked by position. A merge
/// whose parts or result are missing from the vocabulary is refused (as `tokenizers` does).
fn merges(model: &Value, vocab: &FxHashMap<Vec<u8>, u32>) -> Result<Merges, Unsupported> {
    let list = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or(Unsupported::Malformed("model.merges"))?;
    let map = byte_of_char();
    let bytes = |s: &str| -> Option<Vec<u8>> { s.chars().map(|c| map.get(&c).copied()).collect() };
    let mut out = FxHashMap::default();
    out.reserve(list.len());
    for (rank, m) in list.iter().enumerate() {
        let (a, b) = match m {
            Value::Array(p) => match p.as_slice() {
                [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                _ => return Err(Unsupported::Malformed("model.merges")),
            },
            Value::String(s) => s
                .split_once(' ')
                .ok_or(Unsupported::Malformed("model.merges"))?,
            _ => return Err(Unsupported::Malformed("model.merges")),
        };
        let (a, b) = (
            bytes(a).ok_or(Unsupported::NotByteLevel)?,
            bytes(b).ok_or(Unsupported::NotByteLevel)?,
        );
        let joined = [a.as_slice(), b.as_slice()].concat();
        let ids = (vocab.get(&a), vocab.get(&b), vocab.get(&joined));
        let (Some(&ia), Some(&ib), Some(&ij)) = ids else {
            return Err(Unsupported::Malformed(
                "model.merges (a token outside the vocabulary)",
            ));
        };
        // The first (lowest-ranked) spelling of a pair wins, as in `tokenizers`' map.
        out.entry((ia, ib)).or_insert((rank as u32, ij));
    }
    Ok(out)
}

/// The added tokens as one leftmost-longest matcher, with their ids; tokens with options
/// are refused.
fn added_tokens(
    list: &Value,
    added_id: impl Fn(&str) -> Option<u32>,
) -> Result<(Option<AhoCorasick>, Vec<u32>), Unsupported> {
    let Some(list) = list.as_array() else {
        return Ok((None, Vec::new()));
    };
    let mut contents = Vec::new();
    let mut ids = Vec::new();
    for t in list {
        let flag = |k: &str| t.get(k).and_then(Value::as_bool).unwrap_or(false);
        if flag("lstrip") || flag("rstrip") || flag("single_word") || flag("normalized") {
            return Err(Unsupported::AddedTokenOptions);
        }
        let content = t
            .get("content")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .ok_or(Unsupported::Malformed("added_tokens.content"))?;
        let id = added_id(content).ok_or(Unsupported::Malformed("added_tokens (no id)"))?;
        contents.push(content.to_owned());
        ids.push(id);
    }
    if contents.is_empty() {
        return Ok((None, ids));
    }
    let ac = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(&contents)
        .map_err(|_| Unsupported::Malformed("added_tokens"))?;
    Ok((Some(ac), ids))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A byte-level BPE `tokenizer.json` over a small vocabulary: every byte, plus "ab",
    /// "abc" and " a" from three merges, and one added token.
    pub(crate) fn tiny_json() -> Value {
        let map = byte_of_char();
        let mut chars: Vec<(u8, char)> = map.iter().map(|(&c, &b)| (b, c)).collect();
        chars.sort();
        let mut vocab = serde_json::Map::new();
        for (b, c) in &chars {
            vocab.insert(c.to_string(), json!(*b as u32));
        }
        let space = chars[b' ' as usize].1;
        vocab.insert("ab".into(), json!(256));
        vocab.insert("abc".into(), json!(257));
        vocab.insert(format!("{space}a"), json!(258));
        json!({
            "truncation": null,
            "padding": null,
            "added_tokens": [{"id": 300, "content": "<|x|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex":
                    "(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
                 "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
                "merges": [["a", "b"], ["ab", "c"], [space.to_string(), "a"]]}
        })
    }

    /// The tiny tokenizer's added token, as the JSON numbers it.
    fn added(content: &str) -> Option<u32> {
        (content == "<|x|>").then_some(300)
    }

    fn ids(f: &FastBpe, text: &str) -> Vec<u32> {
        let pieces = f.encode(text, false).expect("fast path");
        pieces
            .into_iter()
            .flat_map(|p| match p {
                Piece::Ids(ids) => ids,
                Piece::Slow(r) => panic!("slow piece {r:?} of {text:?}"),
            })
            .collect()
    }

    #[test]
    fn merges_by_rank_and_splits_added_tokens() {
        let f = FastBpe::from_json(&tiny_json(), added).unwrap();
        assert_eq!(ids(&f, "abc"), vec![257]);
        assert_eq!(ids(&f, "abab"), vec![256, 256]);
        assert_eq!(ids(&f, "x<|x|>abc"), vec![b'x' as u32, 300, 257]);
        // " a" is one pre-token (a space before letters) and one merge.
        assert_eq!(ids(&f, "b a"), vec![b'b' as u32, 258]);
        // Three spaces before a word: two stand alone, the third leads the word.
        assert_eq!(ids(&f, "b   a"), vec![b'b' as u32, 32, 32, 258]);
        // At the end of the text the run stays whole.
        assert_eq!(ids(&f, "b   "), vec![b'b' as u32, 32, 32, 32]);
    }

    #[test]
    fn non_ascii_and_long_words_are_left_to_tokenizers() {
        let f = FastBpe::from_json(&tiny_json(), added).unwrap();
        let text = "ab<|x|>é<|x|>ab";
        let pieces = f.encode(text, false).unwrap();
        assert_eq!(
            pieces,
            vec![
                Piece::Ids(vec![256, 300]),
                Piece::Slow(7..9),
                Piece::Ids(vec![300, 256])
            ]
        );
        let long = "a".repeat(MAX_WORD_BYTES + 1);
        assert_eq!(
            f.encode(&long, false).unwrap(),
            vec![Piece::Slow(0..long.len())]
        );
    }

    #[test]
    fn equals_tokenizers_on_the_same_json() {
        let json = tiny_json();
        let hf = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        // tokenizers numbers the added token after the vocabulary, whatever its "id" says.
        assert_eq!(hf.token_to_id("<|x|>"), Some(259));
        let f = FastBpe::from_json(&json, |t| hf.token_to_id(t)).unwrap();
        for text in [
            "abc ab  a",
            "'s'T  \n\n a<|x|> ",
            "a\tb \x0b c\r\n  ",
            "12 ab, c!!\n",
        ] {
            let want = hf.encode_fast(text, false).unwrap().get_ids().to_vec();
            assert_eq!(ids(&f, text), want, "{text:?}");
        }
    }

    #[test]
    fn configurations_outside_the_family_are_refused_with_a_reason() {
        let cases: [(&str, Value, Unsupported); 5] = [
            ("/model/type", json!("WordPiece"), Unsupported::NotBpe),
            (
                "/model/byte_fallback",
                json!(true),
                Unsupported::BpeOption("byte_fallback"),
            ),
            (
                "/normalizer",
                json!({"type": "NFKC"}),
                Unsupported::Normalizer,
            ),
            (
                "/truncation",
                json!({"max_length": 8}),
                Unsupported::TruncationOrPadding,
            ),
            (
                "/added_tokens/0/lstrip",
                json!(true),
                Unsupported::AddedTokenOptions,
            ),
        ];
        for (path, value, want) in cases {
            let mut json = tiny_json();
            *json.pointer_mut(path).unwrap() = value;
            assert_eq!(
                FastBpe::from_json(&json, added).unwrap_err(),
                want,
                "{path}"
            );
        }
        // A post-processor that adds tokens: built, but never for add_special_tokens.
        let mut json = tiny_json();
        json["post_processor"] = json!({"type": "TemplateProcessing"});
        let f = FastBpe::from_json(&json, added).unwrap();
        assert!(f.encode("ab", true).is_none());
        assert!(f.encode("ab", false).is_some());
        let mut json = tiny_json();
        *json
            .pointer_mut("/pre_tokenizer/pretokenizers/0/pattern/Regex")
            .unwrap() = json!("\\p{L}+|\\s+");
        assert_eq!(
            FastBpe::from_json(&json, added).unwrap_err(),
            Unsupported::Regex
        );
    }
}
