//! API keys on the router's listeners (`--api-key`, `TANDEM_API_KEYS`, `--api-key-file`).
//! Without keys everything is open. With keys, every route but `/health` and `/live` (the
//! probes) needs `Authorization: Bearer KEY` or `x-api-key: KEY`; anything else gets an
//! OpenAI-shaped 401 with `WWW-Authenticate: Bearer`, counted in
//! [`crate::metrics::UNAUTHORIZED`]. The presented key is hashed (SHA-256) and compared with
//! every configured key's digest in constant time, without stopping at a match, so neither the
//! timing nor the length of a key leaks. Keys are never logged.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};

use crate::error::ApiError;
use crate::metrics as m;

/// Routes of the public port open to anyone: the probes.
pub const OPEN_PATHS: &[&str] = &["/health", "/live"];

/// Who made a request: the index of the API key it presented (0 when keys are off). Put in
/// the request's extensions by [`require_key`]; the rate limits are per caller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caller(pub usize);

/// The configured keys, as digests.
#[derive(Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.digests.len())
    }
}

fn digest(key: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

impl ApiKeys {
    pub fn new(keys: &[String]) -> Self {
        ApiKeys {
            digests: keys.iter().map(|k| digest(k.as_bytes())).collect(),
        }
    }

    /// Whether any key is configured (else the listeners are open).
    pub fn enabled(&self) -> bool {
        !self.digests.is_empty()
    }

    pub fn len(&self) -> usize {
        self.digests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// The SHA-256 of `caller`'s key (`None` without keys).
    pub fn digest_of(&self, caller: Caller) -> Option<[u8; 32]> {
        self.digests.get(caller.0).copied()
    }

    /// The caller whose key `presented` is, or `None`. Every key is compared, in constant
    /// time, whatever matches.
    pub fn check(&self, presented: &[u8]) -> Option<Caller> {
        let d = digest(presented);
        let mut found = Choice::from(0);
        let mut index = 0u64;
        for (i, k) in self.digests.iter().enumerate() {
            let eq = k.ct_eq(&d);
            index = u64::conditional_select(&index, &(i as u64), eq);
            found |= eq;
        }
        bool::from(found).then_some(Caller(index as usize))
    }
}

/// The key a request presents: `Authorization: Bearer KEY` (the scheme in any case), else
/// `x-api-key: KEY`.
pub fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let v = v.as_bytes();
        let scheme = b"bearer ";
        if v.len() > scheme.len() && v[..scheme.len()].eq_ignore_ascii_case(scheme) {
            let key = v[scheme.len()..].trim_ascii();
            if !key.is_empty() {
                return Some(key);
            }
        }
    }
    headers
        .get("x-api-key")
        .map(|v| v.as_bytes().trim_ascii())
        .filter(|k| !k.is_empty())
}

/// What a listener's key check needs: the keys and the listener's name (a metric label).
#[derive(Clone, Debug)]
pub struct Guard {
    pub keys: Arc<ApiKeys>,
    /// `public` or `admin`.
    pub listener: &'static str,
    /// Paths served without a key on this listener.
    pub open_paths: &'static [&'static str],
}

/// Middleware: lets a request through with its [`Caller`], or answers 401.
pub async fn require_key(State(guard): State<Guard>, mut req: Request, next: Next) -> Response {
    if !guard.keys.enabled() || guard.open_paths.contains(&req.uri().path()) {
        req.extensions_mut().insert(Caller::default());
        return next.run(req).await;
    }
    let presented = presented_key(req.headers());
    let (reason, message) = match presented.map(|k| guard.keys.check(k)) {
        Some(Some(caller)) => {
            req.extensions_mut().insert(caller);
            return next.run(req).await;
        }
        Some(None) => ("invalid", "Incorrect API key provided."),
        None => (
            "missing",
            "You didn't provide an API key. Send it as `Authorization: Bearer KEY` \
             (or `x-api-key: KEY`).",
        ),
    };
    metrics::counter!(m::UNAUTHORIZED, "listener" => guard.listener, "reason" => reason)
        .increment(1);
    tracing::info!(
        listener = guard.listener,
        path = req.uri().path(),
        reason,
        "request refused: API key {reason}"
    );
    unauthorized(message)
}

/// The 401 answer: OpenAI's body (`code: invalid_api_key`) and `WWW-Authenticate: Bearer`.
pub fn unauthorized(message: &str) -> Response {
    let mut resp = ApiError::unauthorized(message).into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> ApiKeys {
        ApiKeys::new(&["alpha".to_string(), "beta-key".to_string()])
    }

    #[test]
    fn every_key_matches_as_its_own_caller_and_nothing_else_does() {
        let k = keys();
        assert_eq!(k.check(b"alpha"), Some(Caller(0)));
        assert_eq!(k.check(b"beta-key"), Some(Caller(1)));
        for bad in [
            &b""[..],
            b"alph",
            b"alphaa",
            b"ALPHA",
            b"beta-key ",
            b"gamma",
        ] {
            assert_eq!(k.check(bad), None, "{bad:?}");
        }
        assert!(!ApiKeys::new(&[]).enabled());
        assert_eq!(ApiKeys::new(&[]).check(b"alpha"), None);
    }

    #[test]
    fn keys_are_read_from_bearer_or_x_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer  k1 "),
        );
        assert_eq!(presented_key(&h), Some(&b"k1"[..]));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer k2"));
        assert_eq!(presented_key(&h), Some(&b"k2"[..]));
        // Another scheme is not a key; x-api-key is the fallback.
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic a2V5"),
        );
        assert_eq!(presented_key(&h), None);
        h.insert("x-api-key", HeaderValue::from_static("k3"));
        assert_eq!(presented_key(&h), Some(&b"k3"[..]));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert_eq!(presented_key(&h), Some(&b"k3"[..]));
    }

    #[test]
    fn the_401_is_openai_shaped_with_www_authenticate() {
        let resp = unauthorized("Incorrect API key provided.");
        assert_eq!(resp.status().as_u16(), 401);
        assert_eq!(resp.headers()[header::WWW_AUTHENTICATE], "Bearer");
        let body = ApiError::unauthorized("m").body();
        assert_eq!(
            body,
            serde_json::json!({"error": {"message": "m", "type": "invalid_request_error",
                "param": null, "code": "invalid_api_key"}})
        );
    }
}
