//! Stop strings, matched on the detokenized text across token boundaries.
//!
//! Text is fed in as it is decoded. Text that could still turn out to be the start of a stop
//! string is held back, so a stop string is never emitted, not even in part; on a match, the
//! text before the match is released and the sequence stops. When the sequence ends for another
//! reason, [`StopMatcher::flush`] releases the held-back text.

use serde::{Deserialize, Serialize};

/// What ended a choice early: the end-of-sequence token, a stop token id, or a stop string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos(u32),
    TokenId(u32),
    String(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Decoded text not yet released (a possible partial stop-string match).
    pending: String,
}

/// What feeding one chunk of text gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopFeed {
    /// Text safe to emit now.
    pub emit: String,
    /// The stop string that matched, if any; the sequence must stop.
    pub matched: Option<String>,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// A matcher in the state another one exported ([`Self::stops`], [`Self::pending`]).
    pub fn resume(stops: Vec<String>, pending: String) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending,
        }
    }

    /// The stop strings matched (the request's, without empty ones).
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// Text currently held back.
    pub fn pending(&self) -> &str {
        &self.pending
    }

    pub fn feed(&mut self, text: &str) -> StopFeed {
        if self.stops.is_empty() {
            return StopFeed {
                emit: text.to_owned(),
                matched: None,
            };
        }
        self.pending.push_str(text);
        // Earliest match wins; on equal start, the longer stop string.
        let mut best: Option<(usize, &String)> = None;
        for s in &self.stops {
            if let Some(pos) = self.pending.find(s.as_str()) {
                let better = match best {
                    None => true,
                    Some((bp, bs)) => pos < bp || (pos == bp && s.len() > bs.len()),
                };
                if better {
                    best = Some((pos, s));
                }
            }
        }
        if let Some((pos, s)) = best {
            let matched = s.clone();
            let emit = self.pending[..pos].to_owned();
            self.pending.clear();
            return StopFeed {
                emit,
                matched: Some(matched),
            };
        }
        let hold = self.held_suffix_len();
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        StopFeed {
            emit,
            matched: None,
        }
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_suffix_len(&self) -> usize {
        let p = self.pending.as_str();
        let mut best = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(p.len());
            for k in (best + 1..=max).rev() {
                let start = p.len() - k;
                if p.is_char_boundary(start) && s.is_char_boundary(k) && p[start..] == s[..k] {
                    best = k;
                    break;
                }
            }
        }
        best
    }

    /// Emits `text` (after anything held back) without looking for stop strings: used while
    /// fewer than `min_tokens` tokens were generated.
    pub fn pass(&mut self, text: &str) -> StopFeed {
        let mut emit = std::mem::take(&mut self.pending);
        emit.push_str(text);
        StopFeed {
            emit,
            matched: None,
        }
    }

    /// Releases held-back text when the sequence ends without a stop-string match.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for c in chunks {
            let f = m.feed(c);
            out.push_str(&f.emit);
            if f.matched.is_some() {
                return (out, f.matched);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn matches_across_token_boundaries() {
        let (out, m) = run(&["STOP"], &["hello S", "T", "OP world"]);
        assert_eq!(out, "hello ");
        assert_eq!(m.as_deref(), Some("STOP"));
    }

    #[test]
    fn partial_match_is_held_back_then_released() {
        let stops = vec!["</end>".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.feed("a </e").emit, "a ");
        assert_eq!(m.pending(), "</e");
        // Not a stop after all: released.
        assert_eq!(m.feed("x").emit, "</ex");
        assert_eq!(m.feed("</").emit, "");
        assert_eq!(m.flush(), "</");
    }

    #[test]
    fn stop_inside_one_chunk_and_earliest_wins() {
        assert_eq!(
            run(&["b", "a"], &["xxab"]),
            ("xx".to_string(), Some("a".to_string()))
        );
        assert_eq!(
            run(&["ab", "abc"], &["zabcd"]),
            ("z".to_string(), Some("abc".to_string()))
        );
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let (out, m) = run(&["é!"], &["café", "!"]);
        assert_eq!(out, "caf");
        assert!(m.is_some());
        let (out, m) = run(&["éx"], &["caé", "é"]);
        assert_eq!(out, "caéé");
        assert!(m.is_none());
    }

    #[test]
    fn pass_skips_matching_and_releases_pending() {
        let stops = vec!["ab".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.feed("xa").emit, "x");
        assert_eq!(m.pass("b").emit, "ab");
        assert_eq!(m.pending(), "");
        assert_eq!(m.feed("ab").matched.as_deref(), Some("ab"));
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), None));
    }
}
