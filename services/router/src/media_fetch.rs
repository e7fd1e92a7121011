//! Fetching `http(s)` image URLs: on the async runtime (never blocking it), bounded in time
//! (`--media-fetch-timeout-secs`) and size (`--max-file-size-mb`, counted while streaming),
//! at most [`MAX_REDIRECTS`] redirects, and refused when a host resolves to a loopback,
//! private, link-local or other internal address — also a redirect's, and an IP literal's —
//! unless `--media-allow-internal` (a guard against server-side request forgery).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Redirects followed at most.
pub const MAX_REDIRECTS: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{host} is an internal address ({addr}); http(s) image URLs may only reach public hosts (--media-allow-internal lifts this)")]
    Internal { host: String, addr: IpAddr },
    #[error("the server answered HTTP {0}")]
    Status(u16),
    #[error("the image is larger than the {limit}-byte limit (--max-file-size-mb)")]
    TooLarge { limit: u64 },
    #[error("fetching it took longer than {0:?} (--media-fetch-timeout-secs)")]
    Timeout(Duration),
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooManyRedirects,
    #[error("cannot fetch it: {0}")]
    Transport(String),
}

/// Whether `ip` is not a public unicast address.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                // Shared address space (carrier-grade NAT), 100.64.0.0/10.
                || (a == 100 && (64..128).contains(&b))
                // IETF protocol assignments and benchmarking: 192.0.0.0/24, 198.18.0.0/15.
                || (a == 192 && b == 0 && v4.octets()[2] == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_internal(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                // Unique local fc00::/7, link-local fe80::/10, documentation 2001:db8::/32.
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || (first == 0x2001 && v6.segments()[1] == 0x0db8)
        }
    }
}

/// Resolves host names, refusing any whose addresses include an internal one (every
/// connection, redirects included, resolves through it).
struct GuardedResolver {
    allow_internal: bool,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let allow_internal = self.allow_internal;
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if !allow_internal {
                if let Some(a) = addrs.iter().find(|a| is_internal(a.ip())) {
                    let e = FetchError::Internal { host, addr: a.ip() };
                    return Err(Box::new(e) as Box<dyn std::error::Error + Send + Sync>);
                }
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// An IP-literal host of `url` that is internal (literals bypass the resolver).
fn internal_literal(url: &reqwest::Url) -> Option<FetchError> {
    let host = url.host_str()?;
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let ip: IpAddr = bare.parse().ok()?;
    is_internal(ip).then(|| FetchError::Internal {
        host: ip.to_string(),
        addr: ip,
    })
}

/// The router's fetcher of http(s) image URLs.
pub struct Fetcher {
    client: reqwest::Client,
    allow_internal: bool,
    timeout: Duration,
    max_bytes: u64,
}

impl Fetcher {
    pub fn new(
        allow_internal: bool,
        timeout: Duration,
        max_bytes: u64,
    ) -> Result<Self, FetchError> {
        let redirects = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= MAX_REDIRECTS {
                return attempt.error(FetchError::TooManyRedirects);
            }
            match (allow_internal, internal_literal(attempt.url())) {
                (false, Some(e)) => attempt.error(e),
                _ => attempt.follow(),
            }
        });
        let client = reqwest::Client::builder()
            .dns_resolver(Arc::new(GuardedResolver { allow_internal }))
            .redirect(redirects)
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("tandem-router/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| FetchError::Transport(e.to_string()))?;
        Ok(Fetcher {
            client,
            allow_internal,
            timeout,
            max_bytes,
        })
    }

    /// The body of `url`, at most `max_bytes`.
    pub async fn fetch(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let parsed = reqwest::Url::parse(url).map_err(|e| FetchError::Transport(e.to_string()))?;
        if !self.allow_internal {
            if let Some(e) = internal_literal(&parsed) {
                return Err(e);
            }
        }
        match tokio::time::timeout(self.timeout, self.fetch_unbounded(parsed)).await {
            Ok(r) => r,
            Err(_) => Err(FetchError::Timeout(self.timeout)),
        }
    }

    async fn fetch_unbounded(&self, url: reqwest::Url) -> Result<Vec<u8>, FetchError> {
        let resp = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| self.classify(e))?;
        if !resp.status().is_success() {
            return Err(FetchError::Status(resp.status().as_u16()));
        }
        if resp.content_length().is_some_and(|n| n > self.max_bytes) {
            return Err(FetchError::TooLarge {
                limit: self.max_bytes,
            });
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.classify(e))?;
            if (body.len() + chunk.len()) as u64 > self.max_bytes {
                return Err(FetchError::TooLarge {
                    limit: self.max_bytes,
                });
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// reqwest's error, or ours (the resolver's or the redirect policy's) inside it.
    fn classify(&self, e: reqwest::Error) -> FetchError {
        if e.is_timeout() {
            return FetchError::Timeout(self.timeout);
        }
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(s) = source {
            if let Some(ours) = s.downcast_ref::<FetchError>() {
                return match ours {
                    FetchError::Internal { host, addr } => FetchError::Internal {
                        host: host.clone(),
                        addr: *addr,
                    },
                    FetchError::TooManyRedirects => FetchError::TooManyRedirects,
                    other => FetchError::Transport(other.to_string()),
                };
            }
            source = s.source();
        }
        FetchError::Transport(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_ranges_are_recognised() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "198.18.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip} is internal");
        }
        for ip in [
            "8.8.8.8",
            "1.1.1.1",
            "2606:4700::1111",
            "100.128.0.1",
            "172.32.0.1",
        ] {
            assert!(!is_internal(ip.parse().unwrap()), "{ip} is public");
        }
    }

    #[test]
    fn ip_literals_are_checked_before_any_connection() {
        let u = reqwest::Url::parse("http://127.0.0.1:9/x.png").unwrap();
        assert!(matches!(
            internal_literal(&u),
            Some(FetchError::Internal { .. })
        ));
        let u = reqwest::Url::parse("http://[::1]/x.png").unwrap();
        assert!(internal_literal(&u).is_some());
        let u = reqwest::Url::parse("http://8.8.8.8/x.png").unwrap();
        assert!(internal_literal(&u).is_none());
        let u = reqwest::Url::parse("http://example.com/x.png").unwrap();
        assert!(internal_literal(&u).is_none());
    }
}
