//! KV transfer: the TCP receiver's frames, and the region descriptors a decode worker sends a
//! prefill worker (protobuf `RemoteRegion`, and the JSON of the serde type).

use prost::Message;
use tandem_kv_transfer::tcp::replay_frames;
use tandem_kv_transfer::{Event, RemoteRegion, EVENT_QUEUE, MAX_NOTIFICATION_BYTES};
use tandem_protocol::worker as pb;
use tandem_worker::wire::{EngineIntoWire, EngineTryFromWire};

/// Size of the one region (id 1) the frames may write to.
const REGION: usize = 4096;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread tokio runtime");
    }
    RT.with(|rt| rt.block_on(f))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// A reference reading of the wire format (tcp.rs): the region's content after the frames,
/// the number of flushes answered and the notifications, up to the first malformed or refused
/// frame (the receiver closes the connection on a put that does not fit region 1, the only
/// region the replayed connection presented the secret of; on any hello, whose secret the
/// input cannot know; and on a notification past the event queue's bound).
fn reference(input: &[u8]) -> (Vec<u8>, usize, Vec<Vec<u8>>) {
    let mut region = vec![0u8; REGION];
    let (mut flushes, mut notes, mut at) = (0, Vec::new(), 0);
    while let Some(&kind) = input.get(at) {
        match kind {
            1 => {
                let (Some(id), Some(off), Some(len)) = (
                    u64_at(input, at + 1),
                    u64_at(input, at + 9),
                    u64_at(input, at + 17),
                ) else {
                    break;
                };
                if id != 1 || off.checked_add(len).is_none_or(|e| e > REGION as u64) {
                    break;
                }
                let start = at + 25;
                let Some(data) = usize::try_from(len)
                    .ok()
                    .and_then(|l| input.get(start..start.checked_add(l)?))
                else {
                    break;
                };
                region[off as usize..off as usize + data.len()].copy_from_slice(data);
                at = start + data.len();
            }
            2 => {
                if u64_at(input, at + 1).is_none() {
                    break;
                }
                flushes += 1;
                at += 9;
            }
            3 => {
                let Some(len) = input.get(at + 1..at + 5) else {
                    break;
                };
                let len = u32::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
                if len > MAX_NOTIFICATION_BYTES {
                    break;
                }
                let Some(p) = input.get(at + 5..at + 5 + len) else {
                    break;
                };
                if notes.len() == EVENT_QUEUE {
                    break;
                }
                notes.push(p.to_vec());
                at += 5 + len;
            }
            _ => break,
        }
    }
    (region, flushes, notes)
}

/// The TCP receiver's frame loop over one sender's bytes, checked against [`reference`]:
/// the same bytes land in the region (nothing outside a registered region is written, and
/// every put that fits is), one ack per flush, the same notifications in order.
pub fn kv_transfer_frames(data: &[u8]) {
    let mut region = vec![0u8; REGION];
    let replay = block_on(replay_frames(data, &mut region));
    let (expected, flushes, notes) = reference(data);
    assert!(
        region == expected,
        "region content differs from the reference"
    );
    let mut acks = &replay.acks[..];
    let mut n = 0;
    while !acks.is_empty() {
        assert!(acks.len() >= 13, "truncated ack");
        let len = u32::from_le_bytes(acks[9..13].try_into().unwrap_or_default()) as usize;
        assert!(acks.len() >= 13 + len, "truncated ack message");
        acks = &acks[13 + len..];
        n += 1;
    }
    assert_eq!(n, flushes, "flush acks");
    let got: Vec<Vec<u8>> = replay
        .events
        .into_iter()
        .map(|e| match e {
            Event::Notification(p) => p,
            other => panic!("unexpected event {other:?}"),
        })
        .collect();
    assert_eq!(got, notes, "notifications");
}

/// A region descriptor from a peer: as protobuf through the worker's conversion, and as the
/// serde type's JSON. A descriptor that validates round-trips and answers bounds checks.
pub fn kv_transfer_descriptor(data: &[u8]) {
    if let Ok(wire) = pb::RemoteRegion::decode(data) {
        if let Ok(region) = RemoteRegion::try_from_wire(wire) {
            check_region(&region);
            let back = RemoteRegion::try_from_wire(region.clone().into_wire());
            assert_eq!(back.ok().as_ref(), Some(&region));
        }
    }
    if let Ok(region) = serde_json::from_slice::<RemoteRegion>(data) {
        check_region(&region);
        let json = serde_json::to_vec(&region).expect("a region prints as JSON");
        let back: RemoteRegion = serde_json::from_slice(&json).expect("its JSON parses back");
        assert_eq!(back, region);
    }
}

fn check_region(region: &RemoteRegion) {
    let mut sealed = region.clone();
    sealed.seal();
    if region.validate().is_ok() {
        assert_eq!(&sealed, region, "a valid descriptor is sealed");
        assert!(region.len > 0 && region.base.checked_add(region.len).is_some());
        assert!(region.check_bounds(0, region.len).is_ok());
        assert!(region.check_bounds(region.len, 1).is_err());
        assert!(region.check_bounds(u64::MAX, 2).is_err());
    } else if sealed.validate().is_ok() {
        assert_ne!(&sealed, region, "only the checksum was wrong");
    }
}
