//! Who a request belongs to, as far as shared state goes: its rate limits and the salt of its
//! KV block hashes.
//!
//! With `--cache-salt-per-api-key`, each API key is a tenant whose requests are hashed under a
//! salt derived from the key, so no two tenants ever share a cached block: neither a
//! prefix-cache hit, nor `cached_tokens` in the usage, nor the router's choice of worker tells
//! one tenant anything about another's prompts. A request may also name its own salt (vLLM's
//! `cache_salt`), which is mixed in under its key's: requests share blocks only when both the
//! tenant and the salt are the same. The salt reaches the workers in the request
//! (`GenerateRequest.cache_salt`), which hash and announce the request's blocks under it; the
//! router matches the same salted hashes against its index.

use std::sync::Arc;

use ring::digest::{Context, SHA256};
use tandem_kv_router::protocols::CacheSalt;

use crate::error::ApiError;
use crate::limits::RateLimits;

/// Longest `cache_salt` a request may send, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// The caller's share of the router: its rate limits, and its API key's digest when each key
/// has a cache of its own.
#[derive(Clone, Debug)]
pub struct Tenant {
    pub limits: Arc<RateLimits>,
    /// SHA-256 of the caller's API key, with `--cache-salt-per-api-key`.
    pub key_digest: Option<[u8; 32]>,
}

impl Tenant {
    /// The salt of a request of this tenant that sent `request_salt` (its `cache_salt`), or
    /// `None` when its blocks are shared with every unsalted request. An empty or oversized
    /// `cache_salt` is refused.
    pub fn cache_salt(&self, request_salt: Option<&str>) -> Result<Option<CacheSalt>, ApiError> {
        if let Some(s) = request_salt {
            if s.is_empty() || s.len() > MAX_CACHE_SALT_BYTES {
                return Err(ApiError::bad_request(
                    format!(
                        "`cache_salt` must be a non-empty string of at most \
                         {MAX_CACHE_SALT_BYTES} bytes"
                    ),
                    Some("cache_salt"),
                ));
            }
        }
        Ok(derive(self.key_digest.as_ref(), request_salt))
    }
}

/// The salt of a key (by digest) and a request salt: the first eight bytes of a SHA-256 over
/// both, each tagged as present or absent so that no pair can stand for another.
fn derive(key_digest: Option<&[u8; 32]>, request_salt: Option<&str>) -> Option<CacheSalt> {
    if key_digest.is_none() && request_salt.is_none() {
        return None;
    }
    let mut h = Context::new(&SHA256);
    h.update(b"tandem kv cache salt v1\0");
    match key_digest {
        Some(d) => {
            h.update(&[1]);
            h.update(d);
        }
        None => h.update(&[0]),
    }
    if let Some(s) = request_salt {
        h.update(&[1]);
        h.update(s.as_bytes());
    }
    let d = h.finish();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d.as_ref()[..8]);
    Some(CacheSalt(u64::from_le_bytes(first)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(key: Option<u8>) -> Tenant {
        Tenant {
            limits: Arc::new(RateLimits::default()),
            key_digest: key.map(|k| [k; 32]),
        }
    }

    #[test]
    fn salts_separate_keys_and_request_salts_and_nothing_salts_nothing() {
        let salt = |key, s: Option<&str>| tenant(key).cache_salt(s).unwrap();
        assert_eq!(salt(None, None), None);
        let all = [
            salt(Some(1), None),
            salt(Some(2), None),
            salt(None, Some("a")),
            salt(None, Some("b")),
            salt(Some(1), Some("a")),
            salt(Some(2), Some("a")),
        ];
        for (i, a) in all.iter().enumerate() {
            assert!(a.is_some());
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // The same tenant and salt give the same value on every router replica.
        assert_eq!(salt(Some(1), Some("a")), all[4]);
    }

    #[test]
    fn an_empty_or_huge_request_salt_is_refused_by_name() {
        for bad in [String::new(), "x".repeat(MAX_CACHE_SALT_BYTES + 1)] {
            let e = tenant(None).cache_salt(Some(&bad)).unwrap_err();
            assert_eq!(e.status.as_u16(), 400);
            assert!(e.message.contains("cache_salt"), "{}", e.message);
        }
        let longest = "x".repeat(MAX_CACHE_SALT_BYTES);
        assert!(tenant(None).cache_salt(Some(&longest)).is_ok());
    }
}
