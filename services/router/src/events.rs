//! The direct event plane: the router subscribes to each worker's KV event stream over gRPC,
//! starting from a full dump, and heals gaps with a replay (or a new dump when the worker's
//! buffer no longer holds the missing events).

use std::sync::Arc;
use std::time::Duration;

use tandem_kv_router::{ApplyOutcome, KvRouter, RouterEvent};
use tandem_protocol::worker::{DumpKvBlocksRequest, SubscribeKvEventsRequest};
use tokio_stream::StreamExt;

use crate::models::{Client, Registry};

async fn take_dump(router: &KvRouter, worker_id: u64, client: &mut Client) -> anyhow::Result<u64> {
    let reply = client
        .dump_kv_blocks(DumpKvBlocksRequest {})
        .await?
        .into_inner();
    let dump = crate::wire::kv_dump(reply);
    router.apply_dump(worker_id, &dump);
    metrics::counter!("tandem_router_kv_dumps_total").increment(1);
    Ok(dump.last_event_id)
}

/// Why one subscription ended.
enum End {
    /// The stream broke: resubscribe from this id.
    ResumeFrom(u64),
    /// Events `expected..received` never arrived: replay them.
    Gap { expected: u64, received: u64 },
    /// The worker no longer has the events: take a dump.
    NeedDump,
}

/// Fetches the missing events `expected..received` from the worker's buffer and applies them
/// as a replay (the index then drains what it buffered meanwhile). `false` means a dump is
/// needed instead.
async fn replay(
    router: &KvRouter,
    worker_id: u64,
    client: &mut Client,
    expected: u64,
    received: u64,
) -> bool {
    let Ok(stream) = client
        .subscribe_kv_events(SubscribeKvEventsRequest {
            from_event_id: Some(expected),
        })
        .await
    else {
        return false;
    };
    let mut stream = stream.into_inner();
    let mut events = Vec::new();
    while let Some(Ok(msg)) = stream.next().await {
        let Ok(event) = crate::wire::kv_event(msg) else {
            return false;
        };
        if event.event_id >= received {
            break;
        }
        let done = event.event_id + 1 >= received;
        events.push(event);
        if done {
            break;
        }
    }
    match router.apply_replay(worker_id, events) {
        Ok(outcome) => outcome.gap.is_none(),
        Err(e) => {
            tracing::warn!(worker_id, "KV replay rejected: {e}");
            false
        }
    }
}

async fn follow(router: &KvRouter, worker_id: u64, client: &mut Client, from: u64) -> End {
    let stream = client
        .subscribe_kv_events(SubscribeKvEventsRequest {
            from_event_id: Some(from),
        })
        .await;
    let mut stream = match stream {
        Ok(s) => s.into_inner(),
        Err(s) if s.code() == tonic::Code::FailedPrecondition => return End::NeedDump,
        Err(_) => return End::ResumeFrom(from),
    };
    let mut next = from;
    while let Some(item) = stream.next().await {
        let msg = match item {
            Ok(m) => m,
            Err(s) if s.code() == tonic::Code::FailedPrecondition => return End::NeedDump,
            Err(_) => return End::ResumeFrom(next),
        };
        let event = match crate::wire::kv_event(msg) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(
                    worker_id,
                    "malformed KV event from worker: {e}; taking a dump"
                );
                return End::NeedDump;
            }
        };
        let id = event.event_id;
        match router.apply_event(RouterEvent::new(worker_id, event)) {
            Ok(ApplyOutcome::Gap(gap)) => {
                tracing::info!(
                    worker_id,
                    expected = gap.expected,
                    received = gap.received,
                    "KV event gap; replaying"
                );
                metrics::counter!("tandem_router_kv_event_gaps_total").increment(1);
                return End::Gap {
                    expected: gap.expected,
                    received: gap.received,
                };
            }
            Ok(ApplyOutcome::DumpRequired { .. }) => return End::NeedDump,
            Ok(_) => {}
            Err(e) => tracing::warn!(worker_id, "KV event not fully indexed: {e}"),
        }
        next = next.max(id + 1);
    }
    End::ResumeFrom(next)
}

/// Keeps the router's index in step with one worker until it leaves discovery.
pub fn spawn_follower(
    router: Arc<KvRouter>,
    registry: Arc<Registry>,
    worker_id: u64,
    mut client: Client,
) {
    tokio::spawn(async move {
        let mut need_dump = true;
        let mut from = 1;
        let mut backoff = Duration::from_millis(50);
        while registry.contains(worker_id) {
            if need_dump {
                match take_dump(&router, worker_id, &mut client).await {
                    Ok(last) => {
                        from = last + 1;
                        need_dump = false;
                        backoff = Duration::from_millis(50);
                    }
                    Err(e) => {
                        tracing::debug!(worker_id, "KV dump failed: {e}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                        continue;
                    }
                }
            }
            match follow(&router, worker_id, &mut client, from).await {
                End::NeedDump => need_dump = true,
                End::Gap { expected, received } => {
                    if replay(&router, worker_id, &mut client, expected, received).await {
                        from = router
                            .with_indexer(|ix| ix.last_event_id(worker_id))
                            .unwrap_or(0)
                            + 1;
                    } else {
                        need_dump = true;
                    }
                }
                End::ResumeFrom(id) => {
                    // A broken stream: back off before reconnecting so a dead worker costs
                    // nothing until discovery drops it.
                    if id == from {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    from = id;
                }
            }
        }
    });
}
