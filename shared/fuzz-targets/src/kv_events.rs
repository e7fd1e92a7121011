//! KV events as the router decodes them: Dynamo's JSON envelopes from NATS and the typed
//! protobuf events and dumps of the gRPC event plane, applied in sequence to one KV index.
//!
//! Input: records `[kind u8][len u16 LE][payload]`; kind 0 is a NATS message (JSON
//! `{"worker_id", "event"}`), 1 a protobuf `KvEvent` of worker 1, 2 a protobuf `KvDump` of
//! worker 1, 3 a query (`payload` read as little-endian u64 local block hashes).

use prost::Message;
use tandem_kv_protocol::{KvCacheEvent, LocalBlockHash};
use tandem_kv_router::{KvIndexer, RouterEvent};
use tandem_protocol::wire::IntoWire;
use tandem_protocol::worker as pb;
use tandem_runtime::events::EventEnvelope;

/// The gRPC worker's id in the index.
const GRPC_WORKER: u64 = 1;

pub fn kv_events(data: &[u8]) {
    let mut index = KvIndexer::with_max_pending(64);
    let mut rest = data;
    while rest.len() >= 3 {
        let kind = rest[0];
        let len = u16::from_le_bytes([rest[1], rest[2]]) as usize;
        let payload = &rest[3..(3 + len).min(rest.len())];
        rest = &rest[3 + payload.len()..];
        match kind % 4 {
            0 => {
                let Ok(env) = serde_json::from_slice::<EventEnvelope<KvCacheEvent>>(payload) else {
                    continue;
                };
                let json = serde_json::to_vec(&env).expect("an envelope prints");
                let back: EventEnvelope<KvCacheEvent> =
                    serde_json::from_slice(&json).expect("its JSON parses back");
                assert_eq!(back, env);
                let _ = index.apply_event(RouterEvent::new(env.worker_id, env.event));
            }
            1 => {
                let Ok(wire) = pb::KvEvent::decode(payload) else {
                    continue;
                };
                let Ok(event) = tandem_router::wire::kv_event(wire) else {
                    continue;
                };
                let again = tandem_router::wire::kv_event(event.clone().into_wire());
                assert_eq!(again.ok().as_ref(), Some(&event));
                let _ = index.apply_event(RouterEvent::new(GRPC_WORKER, event));
            }
            2 => {
                let Ok(wire) = pb::KvDump::decode(payload) else {
                    continue;
                };
                let dump = tandem_router::wire::kv_dump(wire);
                index.apply_dump(GRPC_WORKER, &dump);
            }
            _ => {
                let locals: Vec<LocalBlockHash> = payload
                    .chunks_exact(8)
                    .map(|c| LocalBlockHash(u64::from_le_bytes(c.try_into().unwrap_or_default())))
                    .collect();
                let _ = index.find_matches(&locals);
            }
        }
    }
    // A worker's state survives a dump and re-ingestion.
    let dump = index.dump(GRPC_WORKER);
    let again = KvIndexer::from_dumps([(GRPC_WORKER, &dump)]).dump(GRPC_WORKER);
    assert_eq!(again.last_event_id, dump.last_event_id);
    assert_eq!(again.blocks.len(), dump.blocks.len());
}
