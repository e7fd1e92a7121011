//! What to send: synthetic ISL/OSL, shared-prefix groups, multi-turn sessions, or a Mooncake
//! trace. Everything is drawn from a seeded generator, so a workload is reproducible.

use std::path::Path;

use serde::Deserialize;

use crate::rng::Rng;

/// One request to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
}

/// Requests sent one after another (a multi-turn session), or a single request. `at` is the
/// trace's arrival time in seconds, when the workload has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub at: Option<f64>,
    pub turns: Vec<Spec>,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("bad length distribution `{0}`: use N, uniform:LO:HI or normal:MEAN:STD")]
    Dist(String),
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("trace {path} line {line}: {msg}")]
    Trace {
        path: String,
        line: usize,
        msg: String,
    },
    #[error("{0}")]
    Invalid(String),
}

/// A token-length distribution: `N`, `uniform:LO:HI`, `normal:MEAN:STD` (clamped to ≥ 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LenDist {
    Const(usize),
    Uniform(usize, usize),
    Normal(f64, f64),
}

impl std::str::FromStr for LenDist {
    type Err = WorkloadError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || WorkloadError::Dist(s.to_string());
        let parts: Vec<&str> = s.split(':').collect();
        let d = match parts.as_slice() {
            [n] => LenDist::Const(n.parse().map_err(|_| bad())?),
            ["uniform", lo, hi] => {
                let (lo, hi) = (
                    lo.parse().map_err(|_| bad())?,
                    hi.parse().map_err(|_| bad())?,
                );
                if lo > hi {
                    return Err(bad());
                }
                LenDist::Uniform(lo, hi)
            }
            ["normal", m, sd] => {
                let (m, sd): (f64, f64) = (
                    m.parse().map_err(|_| bad())?,
                    sd.parse().map_err(|_| bad())?,
                );
                if !(m.is_finite() && sd.is_finite() && sd >= 0.0) {
                    return Err(bad());
                }
                LenDist::Normal(m, sd)
            }
            _ => return Err(bad()),
        };
        if d == LenDist::Const(0) {
            return Err(bad());
        }
        Ok(d)
    }
}

impl LenDist {
    pub fn draw(&self, rng: &mut Rng) -> usize {
        match *self {
            LenDist::Const(n) => n,
            LenDist::Uniform(lo, hi) => rng.range(lo as u64, hi as u64).max(1) as usize,
            LenDist::Normal(m, sd) => (m + sd * rng.normal()).round().max(1.0) as usize,
        }
    }
}

/// Token ids are drawn from `[lo, hi)`: avoid special tokens at the top of real vocabularies.
#[derive(Clone, Copy, Debug)]
pub struct Vocab {
    pub lo: u32,
    pub hi: u32,
}

impl Vocab {
    pub fn tokens(&self, rng: &mut Rng, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| rng.range(self.lo as u64, self.hi.saturating_sub(1) as u64) as u32)
            .collect()
    }
}

/// Independent prompts of `isl` tokens asking for `osl` tokens.
pub fn synthetic(n: usize, isl: LenDist, osl: LenDist, v: Vocab, rng: &mut Rng) -> Vec<Job> {
    (0..n)
        .map(|_| {
            let len = isl.draw(rng);
            let prompt = v.tokens(rng, len);
            Job {
                at: None,
                turns: vec![Spec {
                    prompt,
                    max_tokens: osl.draw(rng),
                }],
            }
        })
        .collect()
}

/// `groups` fixed prefixes of `prefix_len` tokens; each prompt is one group's prefix (group
/// drawn uniformly) followed by a unique suffix. With `prefix_ratio` r, the suffix length is
/// `prefix_len * (1 - r) / r`, so prefix / ISL = r.
pub fn shared_prefix(
    n: usize,
    groups: usize,
    prefix_len: usize,
    prefix_ratio: f64,
    osl: LenDist,
    v: Vocab,
    rng: &mut Rng,
) -> Result<Vec<Job>, WorkloadError> {
    if groups == 0 || !(prefix_ratio > 0.0 && prefix_ratio <= 1.0) {
        return Err(WorkloadError::Invalid(
            "--groups must be > 0 and --prefix-ratio in (0, 1]".into(),
        ));
    }
    let prefixes: Vec<Vec<u32>> = (0..groups).map(|_| v.tokens(rng, prefix_len)).collect();
    let suffix_len = (prefix_len as f64 * (1.0 - prefix_ratio) / prefix_ratio).round() as usize;
    Ok((0..n)
        .map(|_| {
            let g = rng.range(0, groups as u64 - 1) as usize;
            let mut prompt = prefixes[g].clone();
            prompt.extend(v.tokens(rng, suffix_len.max(1)));
            Job {
                at: None,
                turns: vec![Spec {
                    prompt,
                    max_tokens: osl.draw(rng),
                }],
            }
        })
        .collect())
}

/// Sessions of `turns` requests; turn k's prompt is turn k-1's prompt, then `osl` tokens that
/// stand for the assistant's reply, then a new user message of `isl` tokens. The
/// conversation grows and each turn shares the previous one's prompt as a prefix.
pub fn multi_turn(
    sessions: usize,
    turns: usize,
    isl: LenDist,
    osl: LenDist,
    v: Vocab,
    rng: &mut Rng,
) -> Vec<Job> {
    (0..sessions)
        .map(|_| {
            let mut history: Vec<u32> = Vec::new();
            let mut specs = Vec::with_capacity(turns);
            for _ in 0..turns.max(1) {
                let len = isl.draw(rng);
                history.extend(v.tokens(rng, len));
                let max_tokens = osl.draw(rng);
                specs.push(Spec {
                    prompt: history.clone(),
                    max_tokens,
                });
                history.extend(v.tokens(rng, max_tokens));
            }
            Job {
                at: None,
                turns: specs,
            }
        })
        .collect()
}

/// A line of a Mooncake trace: arrival in ms, lengths, and one hash id per block of
/// `block_size` prompt tokens (equal ids ⇒ equal blocks ⇒ shared prefix).
#[derive(Debug, Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake JSONL trace. Block `h` is always the same tokens (drawn from a generator
/// seeded by `h` and `seed`), so requests sharing hash ids share prompt prefixes. Timestamps
/// are divided by `speedup`.
pub fn mooncake(
    path: &Path,
    block_size: usize,
    speedup: f64,
    v: Vocab,
    seed: u64,
) -> Result<Vec<Job>, WorkloadError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: p.clone(),
        source,
    })?;
    if block_size == 0 || speedup.is_nan() || speedup <= 0.0 {
        return Err(WorkloadError::Invalid(
            "--trace-block-size and --trace-speedup must be > 0".into(),
        ));
    }
    let mut jobs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let t: TraceLine = serde_json::from_str(line).map_err(|e| WorkloadError::Trace {
            path: p.clone(),
            line: i + 1,
            msg: e.to_string(),
        })?;
        let mut prompt = Vec::with_capacity(t.input_length);
        for h in &t.hash_ids {
            let mut r = Rng::new(seed ^ h.wrapping_mul(tandem_rng::GOLDEN_GAMMA));
            prompt.extend(v.tokens(&mut r, block_size));
        }
        // Past the hashed blocks (or without any), the rest is unique to this request.
        let mut r = Rng::new(seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03) ^ 1);
        if prompt.len() < t.input_length {
            let extra = t.input_length - prompt.len();
            prompt.extend(v.tokens(&mut r, extra));
        }
        prompt.truncate(t.input_length.max(1));
        jobs.push(Job {
            at: Some(t.timestamp / 1000.0 / speedup),
            turns: vec![Spec {
                prompt,
                max_tokens: t.output_length.max(1),
            }],
        });
    }
    jobs.sort_by(|a, b| a.at.unwrap_or(0.0).total_cmp(&b.at.unwrap_or(0.0)));
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: Vocab = Vocab { lo: 10, hi: 1000 };

    #[test]
    fn distributions_parse_and_draw() {
        assert_eq!("128".parse::<LenDist>().unwrap(), LenDist::Const(128));
        assert!("0".parse::<LenDist>().is_err());
        assert!("uniform:5:2".parse::<LenDist>().is_err());
        assert!("gauss:1:2".parse::<LenDist>().is_err());
        let mut r = Rng::new(1);
        let u: LenDist = "uniform:3:5".parse().unwrap();
        assert!((0..100)
            .map(|_| u.draw(&mut r))
            .all(|x| (3..=5).contains(&x)));
    }

    #[test]
    fn shared_prefix_has_the_asked_ratio_and_is_reproducible() {
        let mk = || shared_prefix(20, 2, 300, 0.75, LenDist::Const(4), V, &mut Rng::new(7));
        let jobs = mk().unwrap();
        assert_eq!(jobs, mk().unwrap());
        let p = &jobs[0].turns[0].prompt;
        assert_eq!(p.len(), 400);
        let distinct: std::collections::HashSet<&[u32]> =
            jobs.iter().map(|j| &j.turns[0].prompt[..300]).collect();
        assert_eq!(distinct.len(), 2);
    }

    #[test]
    fn multi_turn_grows_with_prefix() {
        let jobs = multi_turn(
            1,
            3,
            LenDist::Const(5),
            LenDist::Const(2),
            V,
            &mut Rng::new(3),
        );
        let t = &jobs[0].turns;
        assert_eq!(
            t.iter().map(|s| s.prompt.len()).collect::<Vec<_>>(),
            [5, 12, 19]
        );
        assert_eq!(&t[2].prompt[..12], &t[1].prompt[..]);
    }

    #[test]
    fn mooncake_shares_blocks_by_hash_id() {
        let dir = std::env::temp_dir().join(format!("lt-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.jsonl");
        std::fs::write(
            &f,
            "{\"timestamp\": 2000, \"input_length\": 10, \"output_length\": 3, \"hash_ids\": [1, 2, 3]}\n\
             {\"timestamp\": 0, \"input_length\": 7, \"output_length\": 5, \"hash_ids\": [1, 9]}\n",
        )
        .unwrap();
        let jobs = mooncake(&f, 4, 2.0, V, 0).unwrap();
        assert_eq!(jobs[0].at, Some(0.0));
        assert_eq!(jobs[1].at, Some(1.0));
        let (a, b) = (&jobs[1].turns[0].prompt, &jobs[0].turns[0].prompt);
        assert_eq!((a.len(), b.len()), (10, 7));
        assert_eq!(a[..4], b[..4]);
        assert_ne!(a[4..7], b[4..7]);
        std::fs::write(&f, "{\"timestamp\": 1}\n").unwrap();
        assert!(matches!(
            mooncake(&f, 4, 1.0, V, 0),
            Err(WorkloadError::Trace { line: 1, .. })
        ));
        let _ = std::fs::remove_dir_all(dir);
    }
}
