//! KV block events and the dump of every stored block.

use crate::wire::required;
use crate::worker as pb;
use crate::WireError;
use tandem_kv_protocol::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, KvStoredDump, LocalBlockHash, StoredBlock,
};

use super::{FromWire, IntoWire, TryFromWire};

impl IntoWire for KvCacheEvent {
    type Wire = pb::KvEvent;
    fn into_wire(self) -> pb::KvEvent {
        use pb::kv_event::Data;
        let data = match self.data {
            KvCacheEventData::Stored(stored) => Data::Stored(pb::KvBlocksStored {
                parent_hash: stored.parent_hash.map(|h| h.0),
                start_position: stored.start_position,
                blocks: stored
                    .blocks
                    .into_iter()
                    .map(|b| pb::KvStoredBlock {
                        block_hash: b.block_hash.0,
                        tokens_hash: b.tokens_hash.0,
                    })
                    .collect(),
            }),
            KvCacheEventData::Removed(removed) => Data::Removed(pb::KvBlocksRemoved {
                block_hashes: removed.block_hashes.into_iter().map(|h| h.0).collect(),
            }),
            KvCacheEventData::Cleared => Data::Cleared(pb::KvCacheCleared {}),
        };
        pb::KvEvent {
            event_id: self.event_id,
            dp_rank: self.dp_rank,
            data: Some(data),
        }
    }
}

impl TryFromWire<pb::KvEvent> for KvCacheEvent {
    fn try_from_wire(e: pb::KvEvent) -> Result<Self, WireError> {
        use pb::kv_event::Data;
        let data = match required(e.data, "data")? {
            Data::Stored(stored) => KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: stored.parent_hash.map(ExternalSequenceBlockHash),
                start_position: stored.start_position,
                blocks: stored
                    .blocks
                    .into_iter()
                    .map(|b| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(b.block_hash),
                        tokens_hash: LocalBlockHash(b.tokens_hash),
                    })
                    .collect(),
            }),
            Data::Removed(removed) => KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: removed
                    .block_hashes
                    .into_iter()
                    .map(ExternalSequenceBlockHash)
                    .collect(),
            }),
            Data::Cleared(pb::KvCacheCleared {}) => KvCacheEventData::Cleared,
        };
        Ok(KvCacheEvent {
            event_id: e.event_id,
            data,
            dp_rank: e.dp_rank,
        })
    }
}

impl IntoWire for KvStoredDump {
    type Wire = pb::KvDump;
    fn into_wire(self) -> pb::KvDump {
        pb::KvDump {
            last_event_id: self.last_event_id,
            blocks: self
                .blocks
                .into_iter()
                .map(|b| pb::KvDumpBlock {
                    parent_hash: b.parent_hash.map(|h| h.0),
                    block_hash: b.block_hash.0,
                    tokens_hash: b.tokens_hash.0,
                })
                .collect(),
        }
    }
}

impl FromWire<pb::KvDump> for KvStoredDump {
    fn from_wire(d: pb::KvDump) -> Self {
        KvStoredDump {
            last_event_id: d.last_event_id,
            blocks: d
                .blocks
                .into_iter()
                .map(|b| StoredBlock {
                    parent_hash: b.parent_hash.map(ExternalSequenceBlockHash),
                    block_hash: ExternalSequenceBlockHash(b.block_hash),
                    tokens_hash: LocalBlockHash(b.tokens_hash),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(event_id: u64, data: KvCacheEventData) -> KvCacheEvent {
        KvCacheEvent {
            event_id,
            data,
            dp_rank: 3,
        }
    }

    #[test]
    fn every_kind_of_event_round_trips() {
        let stored = |parent_hash, start_position| {
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash,
                start_position,
                blocks: vec![
                    KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(u64::MAX),
                        tokens_hash: LocalBlockHash(11),
                    },
                    KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(0),
                        tokens_hash: LocalBlockHash(12),
                    },
                ],
            })
        };
        for e in [
            event(1, stored(None, None)),
            event(2, stored(Some(ExternalSequenceBlockHash(5)), Some(64))),
            event(
                3,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: vec![
                        ExternalSequenceBlockHash(1),
                        ExternalSequenceBlockHash(2),
                        ExternalSequenceBlockHash(u64::MAX),
                    ],
                }),
            ),
            event(4, KvCacheEventData::Cleared),
        ] {
            assert_eq!(KvCacheEvent::try_from_wire(e.clone().into_wire()), Ok(e));
        }
    }

    #[test]
    fn an_event_without_data_is_refused() {
        let wire = pb::KvEvent {
            event_id: 9,
            dp_rank: 0,
            data: None,
        };
        assert_eq!(
            KvCacheEvent::try_from_wire(wire),
            Err(WireError::missing("data"))
        );
    }

    #[test]
    fn dumps_round_trip() {
        let dump = KvStoredDump {
            last_event_id: 17,
            blocks: vec![
                StoredBlock {
                    parent_hash: None,
                    block_hash: ExternalSequenceBlockHash(1),
                    tokens_hash: LocalBlockHash(101),
                },
                StoredBlock {
                    parent_hash: Some(ExternalSequenceBlockHash(1)),
                    block_hash: ExternalSequenceBlockHash(2),
                    tokens_hash: LocalBlockHash(102),
                },
            ],
        };
        assert_eq!(KvStoredDump::from_wire(dump.clone().into_wire()), dump);
    }
}
