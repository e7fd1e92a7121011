//! What one client may ask of the router: rates (token buckets over requests and tokens per
//! second, `--rate-limit-*`) and the size of a request's parts. Without API keys the buckets
//! are global; with keys (`--api-key`) each key has its own ([`CallerLimits`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_config::AdmissionConfig;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::metrics as m;

/// Most `messages` in a chat request.
pub const MAX_MESSAGES: usize = 4096;
/// Most `tools` in a chat request.
pub const MAX_TOOLS: usize = 256;
/// Most prompts in a batched completion request.
pub const MAX_BATCH_PROMPTS: usize = 64;
/// Bodies above this many bytes are tokenized one at a time (see `handlers`), so a few huge
/// prompts cannot take every tokenizer thread from small ones.
pub const LARGE_PROMPT_BYTES: usize = 256 * 1024;

/// A token bucket: `rate` per second, holding at most `capacity` (one second's worth, at
/// least one).
#[derive(Debug)]
struct Bucket {
    rate: f64,
    capacity: f64,
    level: f64,
    updated: Instant,
}

impl Bucket {
    fn new(rate: f64) -> Self {
        let capacity = rate.max(1.0);
        Bucket {
            rate,
            capacity,
            level: capacity,
            updated: Instant::now(),
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + dt * self.rate).min(self.capacity);
        self.updated = now;
    }

    /// How long until the level reaches `want`.
    fn wait_for(&self, want: f64) -> Duration {
        Duration::from_secs_f64(((want - self.level) / self.rate).max(0.0))
    }
}

/// The router's rate limits; either may be off.
#[derive(Debug, Default)]
pub struct RateLimits {
    requests: Option<Mutex<Bucket>>,
    tokens: Option<Mutex<Bucket>>,
}

fn lock(b: &Mutex<Bucket>) -> std::sync::MutexGuard<'_, Bucket> {
    b.lock().unwrap_or_else(|e| e.into_inner())
}

fn retry_secs(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}

impl RateLimits {
    pub fn new(cfg: &AdmissionConfig) -> Self {
        let bucket = |rate: f64| (rate > 0.0).then(|| Mutex::new(Bucket::new(rate)));
        RateLimits {
            requests: bucket(cfg.rate_limit_requests_per_sec),
            tokens: bucket(cfg.rate_limit_tokens_per_sec),
        }
    }

    /// Takes one request and `prompt_tokens` from the buckets, or refuses with 429 and when
    /// to retry. A request is admitted while the token bucket is not in debt, so a prompt
    /// larger than a second's worth still gets in (and the debt holds the next ones back).
    pub fn admit(&self, prompt_tokens: usize) -> Result<(), ApiError> {
        let now = Instant::now();
        let mut requests = self.requests.as_ref().map(lock);
        let mut tokens = self.tokens.as_ref().map(lock);
        if let Some(r) = requests.as_deref_mut() {
            r.refill(now);
            if r.level < 1.0 {
                return Err(refused("requests", r.rate, r.wait_for(1.0)));
            }
        }
        if let Some(t) = tokens.as_deref_mut() {
            t.refill(now);
            if t.level < 0.0 {
                return Err(refused("tokens", t.rate, t.wait_for(0.0)));
            }
            t.level -= prompt_tokens as f64;
        }
        if let Some(r) = requests.as_deref_mut() {
            r.level -= 1.0;
        }
        Ok(())
    }

    /// Charges output tokens as they stream.
    pub fn charge_tokens(&self, n: usize) {
        if let Some(t) = &self.tokens {
            let mut t = lock(t);
            t.refill(Instant::now());
            t.level -= n as f64;
        }
    }
}

/// The buckets of every caller: one set per API key, or one shared set without keys.
#[derive(Debug)]
pub struct CallerLimits {
    sets: Vec<Arc<RateLimits>>,
    /// The shared set (the first), for a caller the table does not know.
    first: Arc<RateLimits>,
}

impl CallerLimits {
    /// Buckets for `keys` API keys (0: one shared set).
    pub fn new(cfg: &AdmissionConfig, keys: usize) -> Self {
        let sets: Vec<Arc<RateLimits>> = (0..keys.max(1))
            .map(|_| Arc::new(RateLimits::new(cfg)))
            .collect();
        let first = sets[0].clone();
        CallerLimits { sets, first }
    }

    /// The buckets of `caller` (see `auth::Caller`).
    pub fn of(&self, caller: Caller) -> &Arc<RateLimits> {
        self.sets.get(caller.0).unwrap_or(&self.first)
    }
}

fn refused(limit: &'static str, rate: f64, wait: Duration) -> ApiError {
    metrics::counter!(m::RATE_LIMITED, "limit" => limit).increment(1);
    ApiError::rate_limited(
        format!(
            "rate limit exceeded: at most {rate} {limit} per second (--rate-limit-{limit}-per-sec)"
        ),
        retry_secs(wait),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rps: f64, tps: f64) -> RateLimits {
        RateLimits::new(&AdmissionConfig {
            queue_threshold: None,
            queue_shortest_first: false,
            queue_max_requests: 1,
            rate_limit_requests_per_sec: rps,
            rate_limit_tokens_per_sec: tps,
        })
    }

    #[test]
    fn off_admits_everything() {
        let l = limits(0.0, 0.0);
        for _ in 0..10_000 {
            l.admit(1_000_000).unwrap();
        }
    }

    #[test]
    fn a_second_of_requests_then_429_with_retry_after() {
        let l = limits(5.0, 0.0);
        for _ in 0..5 {
            l.admit(1).unwrap();
        }
        let e = l.admit(1).expect_err("over the rate");
        assert_eq!(e.status.as_u16(), 429);
        assert_eq!(e.retry_after_secs, Some(1));
    }

    #[test]
    fn token_debt_holds_back_the_next_request() {
        let l = limits(0.0, 100.0);
        // One prompt over the bucket gets in, and leaves the bucket in debt.
        l.admit(500).unwrap();
        let e = l.admit(1).expect_err("in debt");
        assert_eq!(e.status.as_u16(), 429);
        // 400 tokens of debt at 100/s: about four seconds.
        assert!((4..=5).contains(&e.retry_after_secs.unwrap()), "{e:?}");
        // Output tokens count too.
        let l = limits(0.0, 100.0);
        l.charge_tokens(250);
        assert!(l.admit(1).is_err());
    }

    #[test]
    fn each_api_key_has_its_own_buckets() {
        let cfg = AdmissionConfig {
            queue_threshold: None,
            queue_shortest_first: false,
            queue_max_requests: 1,
            rate_limit_requests_per_sec: 2.0,
            rate_limit_tokens_per_sec: 0.0,
        };
        let l = CallerLimits::new(&cfg, 2);
        for _ in 0..2 {
            l.of(Caller(0)).admit(1).unwrap();
        }
        assert!(l.of(Caller(0)).admit(1).is_err(), "key 0 is over its rate");
        // Key 1 is not held back by key 0.
        l.of(Caller(1)).admit(1).unwrap();
        // Without keys, every request shares one set.
        let shared = CallerLimits::new(&cfg, 0);
        shared.of(Caller(0)).admit(1).unwrap();
        shared.of(Caller(0)).admit(1).unwrap();
        assert!(shared.of(Caller(0)).admit(1).is_err());
    }

    #[test]
    fn buckets_refill_with_time() {
        let mut b = Bucket::new(10.0);
        b.level = 0.0;
        let later = b.updated + Duration::from_millis(500);
        b.refill(later);
        assert!((b.level - 5.0).abs() < 1e-9);
        b.refill(later + Duration::from_secs(60));
        assert_eq!(b.level, b.capacity);
    }
}
