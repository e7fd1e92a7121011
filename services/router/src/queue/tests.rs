use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AdmissionQueue, Attempt, Ticket};

fn ticket(priority: i32, prompt_tokens: usize) -> Ticket {
    Ticket {
        model: "m".into(),
        priority,
        prompt_tokens,
        deadline: Instant::now() + Duration::from_secs(30),
    }
}

/// Free slots of a pretend worker: an attempt takes one, or finds none (saturated).
fn take(slots: &AtomicUsize) -> Attempt<()> {
    let got = slots
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| s.checked_sub(1))
        .is_ok();
    if got {
        Attempt::Admitted(())
    } else {
        Attempt::Saturated
    }
}

/// Waits (bounded) until `n` requests are queued.
async fn until_waiting(q: &AdmissionQueue, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while q.len() != n {
        assert!(Instant::now() < deadline, "{} waiting, wanted {n}", q.len());
        tokio::task::yield_now().await;
    }
}

/// Spawns a request that records its admission order in `order` under `tag`.
fn spawn_request(
    q: &Arc<AdmissionQueue>,
    slots: &Arc<AtomicUsize>,
    order: &Arc<std::sync::Mutex<Vec<u32>>>,
    t: Ticket,
    tag: u32,
) -> tokio::task::JoinHandle<()> {
    let (q, slots, order) = (q.clone(), slots.clone(), order.clone());
    tokio::spawn(async move {
        q.admit(&t, || Ok(take(&slots))).await.expect("admitted");
        order.lock().unwrap().push(tag);
    })
}

#[tokio::test]
async fn saturated_requests_wait_and_enter_by_priority_then_arrival() {
    let q = Arc::new(AdmissionQueue::new(true, false, 16));
    let slots = Arc::new(AtomicUsize::new(0));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, priority) in [0, 0, -1, 0].into_iter().enumerate() {
        tasks.push(spawn_request(
            &q,
            &slots,
            &order,
            ticket(priority, 10),
            i as u32,
        ));
        until_waiting(&q, i + 1).await;
    }
    for admitted in 1..=4 {
        slots.fetch_add(1, Ordering::SeqCst);
        q.wake();
        let deadline = Instant::now() + Duration::from_secs(10);
        while order.lock().unwrap().len() != admitted {
            assert!(Instant::now() < deadline, "no admission after a slot freed");
            tokio::task::yield_now().await;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![2, 0, 1, 3]);
    assert!(q.is_empty());
}

#[tokio::test]
async fn shortest_prompt_first_under_wspt() {
    let q = Arc::new(AdmissionQueue::new(true, true, 16));
    let slots = Arc::new(AtomicUsize::new(0));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, len) in [300, 100, 200].into_iter().enumerate() {
        tasks.push(spawn_request(&q, &slots, &order, ticket(0, len), i as u32));
        until_waiting(&q, i + 1).await;
    }
    slots.fetch_add(3, Ordering::SeqCst);
    q.wake();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![1, 2, 0]);
}

#[tokio::test]
async fn a_full_queue_answers_503_with_retry_after() {
    let q = Arc::new(AdmissionQueue::new(true, false, 2));
    let slots = Arc::new(AtomicUsize::new(0));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = spawn_request(&q, &slots, &order, ticket(0, 1), 0);
    let b = spawn_request(&q, &slots, &order, ticket(0, 1), 1);
    until_waiting(&q, 2).await;
    let err = q
        .admit(&ticket(0, 1), || Ok(take(&slots)))
        .await
        .expect_err("the queue is full");
    assert_eq!(err.status.as_u16(), 503);
    assert!(err.retry_after_secs.is_some_and(|s| s >= 1));
    slots.fetch_add(2, Ordering::SeqCst);
    q.wake();
    a.await.unwrap();
    b.await.unwrap();
}

#[tokio::test]
async fn a_request_that_stops_waiting_leaves_and_the_next_goes_in() {
    let q = Arc::new(AdmissionQueue::new(true, false, 8));
    let slots = Arc::new(AtomicUsize::new(0));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let first = spawn_request(&q, &slots, &order, ticket(0, 1), 0);
    until_waiting(&q, 1).await;
    let second = spawn_request(&q, &slots, &order, ticket(0, 1), 1);
    until_waiting(&q, 2).await;
    // The head's client goes away: its place is freed and the next one heads the queue.
    first.abort();
    until_waiting(&q, 1).await;
    slots.fetch_add(1, Ordering::SeqCst);
    q.wake();
    second.await.unwrap();
    assert_eq!(*order.lock().unwrap(), vec![1]);
}

#[tokio::test]
async fn waiting_past_the_deadline_is_a_timeout_and_off_means_503() {
    let q = AdmissionQueue::new(true, false, 8);
    let mut t = ticket(0, 1);
    t.deadline = Instant::now() + Duration::from_millis(50);
    let err = q
        .admit(&t, || Ok(Attempt::<()>::Saturated))
        .await
        .expect_err("deadline");
    assert_eq!(err.status.as_u16(), 504, "{}", err.message);
    assert!(q.is_empty());

    let off = AdmissionQueue::new(false, false, 8);
    let err = off
        .admit(&ticket(0, 1), || Ok(Attempt::<()>::Saturated))
        .await
        .expect_err("no queue");
    assert_eq!(err.status.as_u16(), 503);
    assert!(off.is_empty());
}

#[tokio::test]
async fn a_free_worker_admits_at_once_and_errors_pass_through() {
    let q = AdmissionQueue::new(true, false, 8);
    let (_, waited) = q
        .admit(&ticket(0, 1), || Ok(Attempt::Admitted(())))
        .await
        .unwrap();
    assert_eq!(waited, Duration::ZERO);
    let err = q
        .admit(&ticket(0, 1), || {
            Err::<Attempt<()>, _>(crate::error::ApiError::internal("boom"))
        })
        .await
        .expect_err("error");
    assert_eq!(err.status.as_u16(), 500);
    assert!(q.is_empty());
}
