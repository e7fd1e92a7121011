//! Run-time selection of the transport from `cache_transceiver_config.backend`.

use crate::tcp::{TcpConnection, TcpRegistration};
use crate::ucx::{UcxConnection, UcxRegistration};
use crate::{
    Backend, Bytes, DeviceBatch, KvConnection, KvTransport, LocalMemory, Notifications,
    PeerAddress, Put, Registration, RemoteRegion, Result, TcpTransport, TransportConfig,
    UcxTransport,
};

/// Opens the transport `config.backend` names. UCX that cannot be initialised is an error
/// ([`crate::TransferError::UcxUnavailable`], which suggests `TCP`), never a silent fallback.
pub async fn open(config: TransportConfig) -> Result<AnyTransport> {
    Ok(match config.backend {
        Backend::Ucx => AnyTransport::Ucx(UcxTransport::new(config)?),
        Backend::Tcp => AnyTransport::Tcp(TcpTransport::bind(config).await?),
    })
}

pub enum AnyTransport {
    Ucx(UcxTransport),
    Tcp(TcpTransport),
}

pub enum AnyRegistration {
    Ucx(UcxRegistration),
    Tcp(TcpRegistration),
}

pub enum AnyConnection {
    Ucx(UcxConnection),
    Tcp(TcpConnection),
}

impl Registration for AnyRegistration {
    fn descriptor(&self) -> &RemoteRegion {
        match self {
            AnyRegistration::Ucx(r) => r.descriptor(),
            AnyRegistration::Tcp(r) => r.descriptor(),
        }
    }
}

impl KvConnection for AnyConnection {
    async fn write(&self, remote: &RemoteRegion, puts: Vec<Put>) -> Result<()> {
        match self {
            AnyConnection::Ucx(c) => c.write(remote, puts).await,
            AnyConnection::Tcp(c) => c.write(remote, puts).await,
        }
    }

    async fn write_device(&self, remote: &RemoteRegion, batch: DeviceBatch) -> Result<()> {
        match self {
            AnyConnection::Ucx(c) => c.write_device(remote, batch).await,
            AnyConnection::Tcp(c) => c.write_device(remote, batch).await,
        }
    }

    async fn notify(&self, payload: Bytes) -> Result<()> {
        match self {
            AnyConnection::Ucx(c) => c.notify(payload).await,
            AnyConnection::Tcp(c) => c.notify(payload).await,
        }
    }
}

impl KvTransport for AnyTransport {
    type Registration = AnyRegistration;
    type Connection = AnyConnection;

    fn backend(&self) -> Backend {
        match self {
            AnyTransport::Ucx(t) => t.backend(),
            AnyTransport::Tcp(t) => t.backend(),
        }
    }

    fn address(&self) -> PeerAddress {
        match self {
            AnyTransport::Ucx(t) => t.address(),
            AnyTransport::Tcp(t) => t.address(),
        }
    }

    async fn register(&self, mem: LocalMemory) -> Result<AnyRegistration> {
        Ok(match self {
            AnyTransport::Ucx(t) => AnyRegistration::Ucx(t.register(mem).await?),
            AnyTransport::Tcp(t) => AnyRegistration::Tcp(t.register(mem).await?),
        })
    }

    async fn allocate(&self, len: usize) -> Result<(AnyRegistration, *mut u8)> {
        Ok(match self {
            AnyTransport::Ucx(t) => {
                let (r, p) = t.allocate(len).await?;
                (AnyRegistration::Ucx(r), p)
            }
            AnyTransport::Tcp(t) => {
                let (r, p) = t.allocate(len).await?;
                (AnyRegistration::Tcp(r), p)
            }
        })
    }

    async fn connect(&self, peer: &PeerAddress) -> Result<AnyConnection> {
        Ok(match self {
            AnyTransport::Ucx(t) => AnyConnection::Ucx(t.connect(peer).await?),
            AnyTransport::Tcp(t) => AnyConnection::Tcp(t.connect(peer).await?),
        })
    }

    fn take_notifications(&self) -> Option<Notifications> {
        match self {
            AnyTransport::Ucx(t) => t.take_notifications(),
            AnyTransport::Tcp(t) => t.take_notifications(),
        }
    }
}
