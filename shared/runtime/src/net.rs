//! Bind versus advertised addresses.
//!
//! A listener binds one address and tells peers (through discovery) another: behind NAT, in a
//! pod, or when bound to the wildcard, the bound address is not what others should dial.
//! The rule for the advertised `host:port`:
//!
//! 1. An explicit advertise value (a flag, or an env var such as [`TCP_RPC_HOST_ENV`], read by
//!    the caller with [`advertise_from_env`]) wins. A bare host gets the bound port; a value
//!    with a port (`host:port`, `[v6]:port`) is used as is (port forwarding).
//! 2. Otherwise, bound to a specific IP: that IP and the bound port.
//! 3. Otherwise, bound to the wildcard (`0.0.0.0` / `::`): loopback (`127.0.0.1` / `::1`) and
//!    the bound port. That is right for the one-machine default; on several machines set the
//!    advertise host, since guessing "the" external interface is wrong too often.
//!
//! Port 0 binds an ephemeral port; the advertised port is always the real one.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use tokio::net::TcpListener;

/// Dynamo's env var for the host a worker's request-plane server advertises.
pub const TCP_RPC_HOST_ENV: &str = "DYN_TCP_RPC_HOST";
/// Dynamo's env var for the request-plane port (0 = ephemeral).
pub const TCP_RPC_PORT_ENV: &str = "DYN_TCP_RPC_PORT";
/// Dynamo's env var for the status server (`/metrics`, `/health`) port.
pub const SYSTEM_PORT_ENV: &str = "DYN_SYSTEM_PORT";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid advertise address {value:?}: {reason}")]
    InvalidAdvertise { value: String, reason: &'static str },
}

/// `host:port`, with brackets around IPv6 literals.
pub fn join_host_port(host: &str, port: u16) -> String {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<Ipv6Addr>().is_ok() {
        format!("[{bare}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A non-empty value of env var `var`.
pub fn advertise_from_env(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.trim().is_empty())
}

/// The advertised `host:port` for a listener bound at `bound` (see the module rule).
pub fn advertised_addr(bound: SocketAddr, advertise: Option<&str>) -> Result<String, NetError> {
    let Some(value) = advertise.map(str::trim).filter(|v| !v.is_empty()) else {
        let ip = match bound.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        return Ok(SocketAddr::new(ip, bound.port()).to_string());
    };
    let invalid = |reason| NetError::InvalidAdvertise {
        value: value.to_string(),
        reason,
    };
    if value.contains(char::is_whitespace) || value.contains('/') {
        return Err(invalid("expected a host or host:port, not a URL"));
    }
    if value.parse::<SocketAddr>().is_ok() {
        return Ok(value.to_string());
    }
    if value.parse::<IpAddr>().is_ok() {
        return Ok(join_host_port(value, bound.port()));
    }
    if value.starts_with('[') {
        return Err(invalid("bracketed IPv6 address needs a port"));
    }
    match value.rsplit_once(':') {
        None => Ok(join_host_port(value, bound.port())),
        Some((host, port)) if !host.is_empty() && !host.contains(':') => {
            port.parse::<u16>().map_err(|_| invalid("bad port"))?;
            Ok(value.to_string())
        }
        Some(_) => Err(invalid("unbracketed IPv6 address with a port")),
    }
}

/// A bound TCP listener and the address to publish for it.
#[derive(Debug)]
pub struct BoundListener {
    listener: TcpListener,
    local_addr: SocketAddr,
    advertised: String,
}

impl BoundListener {
    /// Binds `bind` (`host:port`; port 0 = ephemeral) and works out the advertised address.
    pub async fn bind(bind: &str, advertise: Option<&str>) -> Result<Self, NetError> {
        let bind_err = |source| NetError::Bind {
            addr: bind.to_string(),
            source,
        };
        let listener = TcpListener::bind(bind).await.map_err(bind_err)?;
        let local_addr = listener.local_addr().map_err(bind_err)?;
        let advertised = advertised_addr(local_addr, advertise)?;
        Ok(Self {
            listener,
            local_addr,
            advertised,
        })
    }

    /// [`BoundListener::bind`] from a separate host and port.
    pub async fn bind_host_port(
        host: &str,
        port: u16,
        advertise: Option<&str>,
    ) -> Result<Self, NetError> {
        Self::bind(&join_host_port(host, port), advertise).await
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What goes into discovery: `host:port` peers should dial.
    pub fn advertised(&self) -> &str {
        &self.advertised
    }

    pub fn into_listener(self) -> TcpListener {
        self.listener
    }

    /// Listener, bound address, advertised address.
    pub fn into_parts(self) -> (TcpListener, SocketAddr, String) {
        (self.listener, self.local_addr, self.advertised)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn advertise_rule() {
        assert_eq!(
            advertised_addr(sa("0.0.0.0:9000"), None).unwrap(),
            "127.0.0.1:9000"
        );
        assert_eq!(
            advertised_addr(sa("[::]:9000"), None).unwrap(),
            "[::1]:9000"
        );
        assert_eq!(
            advertised_addr(sa("10.1.2.3:9000"), Some("")).unwrap(),
            "10.1.2.3:9000"
        );
        assert_eq!(
            advertised_addr(sa("0.0.0.0:9000"), Some("node7")).unwrap(),
            "node7:9000"
        );
        assert_eq!(
            advertised_addr(sa("0.0.0.0:9000"), Some("node7:443")).unwrap(),
            "node7:443"
        );
        assert_eq!(
            advertised_addr(sa("0.0.0.0:9000"), Some("10.0.0.5")).unwrap(),
            "10.0.0.5:9000"
        );
        assert_eq!(
            advertised_addr(sa("0.0.0.0:9000"), Some("fd00::5")).unwrap(),
            "[fd00::5]:9000"
        );
        assert_eq!(
            advertised_addr(sa("0.0.0.0:9000"), Some("[fd00::5]:1")).unwrap(),
            "[fd00::5]:1"
        );
        for bad in ["http://x", "a b", "x:notaport", "[fd00::5]", "fd00::5::1:x"] {
            assert!(
                advertised_addr(sa("0.0.0.0:1"), Some(bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn ephemeral_port_is_advertised() {
        let l = BoundListener::bind("127.0.0.1:0", None).await.unwrap();
        assert_ne!(l.local_addr().port(), 0);
        assert_eq!(l.advertised(), l.local_addr().to_string());
        let l = BoundListener::bind_host_port("0.0.0.0", 0, Some("worker-0"))
            .await
            .unwrap();
        assert_eq!(
            l.advertised(),
            format!("worker-0:{}", l.local_addr().port())
        );
    }
}
