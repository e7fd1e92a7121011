//! The KV transfer region a decode worker's lease points a prefill worker at.

use tandem_kv_transfer::{Backend, MemoryKind, PeerAddress, RegionSecret, RemoteRegion};
use tandem_protocol::worker as pb;
use tandem_protocol::WireError;

use super::{EngineIntoWire, EngineTryFromWire};

impl EngineIntoWire for RemoteRegion {
    type Wire = pb::RemoteRegion;
    fn into_wire(self) -> pb::RemoteRegion {
        let backend = match self.backend {
            Backend::Ucx => pb::KvTransferBackend::Ucx,
            Backend::Tcp => pb::KvTransferBackend::Tcp,
        };
        let (memory_kind, cuda_device) = match self.memory {
            MemoryKind::Host => (pb::MemoryKind::Host, 0),
            MemoryKind::Cuda { device } => (pb::MemoryKind::Cuda, device),
        };
        pb::RemoteRegion {
            backend: backend.into(),
            peer: self.peer.0,
            region_id: self.region_id,
            base: self.base,
            len: self.len,
            rkey: self.rkey,
            memory_kind: memory_kind.into(),
            cuda_device,
            check: self.check,
            secret: self.secret.as_bytes().to_vec(),
        }
    }
}

fn backend(value: i32) -> Result<Backend, WireError> {
    match pb::KvTransferBackend::try_from(value) {
        Ok(pb::KvTransferBackend::Ucx) => Ok(Backend::Ucx),
        Ok(pb::KvTransferBackend::Tcp) => Ok(Backend::Tcp),
        Ok(pb::KvTransferBackend::Unspecified) | Err(_) => {
            Err(WireError::invalid_enum("backend", value))
        }
    }
}

fn memory(value: i32, cuda_device: u32) -> Result<MemoryKind, WireError> {
    match pb::MemoryKind::try_from(value) {
        Ok(pb::MemoryKind::Host) => Ok(MemoryKind::Host),
        Ok(pb::MemoryKind::Cuda) => Ok(MemoryKind::Cuda {
            device: cuda_device,
        }),
        Ok(pb::MemoryKind::Unspecified) | Err(_) => {
            Err(WireError::invalid_enum("memory_kind", value))
        }
    }
}

impl EngineTryFromWire<pb::RemoteRegion> for RemoteRegion {
    fn try_from_wire(r: pb::RemoteRegion) -> Result<Self, WireError> {
        Ok(RemoteRegion {
            backend: backend(r.backend)?,
            peer: PeerAddress(r.peer),
            region_id: r.region_id,
            base: r.base,
            len: r.len,
            rkey: r.rkey,
            secret: RegionSecret::from_bytes(r.secret),
            memory: memory(r.memory_kind, r.cuda_device)?,
            check: r.check,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(backend: Backend, memory: MemoryKind) -> RemoteRegion {
        RemoteRegion {
            backend,
            peer: PeerAddress(vec![0, 1, 2, 255]),
            region_id: 7,
            base: 0x7f00_0000_1000,
            len: 1 << 30,
            rkey: vec![9, 8, 7],
            secret: RegionSecret::from_bytes((0..32).collect()),
            memory,
            check: 0xdead_beef,
        }
    }

    #[test]
    fn regions_round_trip() {
        for r in [
            region(Backend::Ucx, MemoryKind::Host),
            region(Backend::Tcp, MemoryKind::Host),
            region(Backend::Ucx, MemoryKind::Cuda { device: 3 }),
        ] {
            assert_eq!(RemoteRegion::try_from_wire(r.clone().into_wire()), Ok(r));
        }
    }

    #[test]
    fn unknown_or_unspecified_enums_are_refused() {
        let good = region(Backend::Tcp, MemoryKind::Host).into_wire();
        let bad_backend = pb::RemoteRegion {
            backend: 42,
            ..good.clone()
        };
        assert_eq!(
            RemoteRegion::try_from_wire(bad_backend),
            Err(WireError::invalid_enum("backend", 42))
        );
        let unspecified_memory = pb::RemoteRegion {
            memory_kind: 0,
            ..good
        };
        assert_eq!(
            RemoteRegion::try_from_wire(unspecified_memory),
            Err(WireError::invalid_enum("memory_kind", 0))
        );
    }
}
