//! What the system is doing, read every interval: the router's traffic (request rate, ISL,
//! OSL, TTFT, ITL, KV hit rate from its `dynamo_frontend_*` counters and histograms) and each
//! discovered worker's load report (its `dynamo_component_*` gauges).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tandem_runtime::discovery::Discovery;

use crate::load::{EngineLoad, Role};
use crate::prom::Page;

/// Why a metrics source could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error("reading {url}: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("reading {url}: HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("reading {url}: {source}")]
    Parse {
        url: String,
        #[source]
        source: crate::prom::ParseError,
    },
    #[error("listing workers in discovery: {0}")]
    Discovery(#[from] tandem_runtime::discovery::DiscoveryError),
}

/// Router metric names read (Dynamo's frontend names).
mod names {
    pub use tandem_runtime::metrics::names::frontend::{
        INPUT_SEQUENCE_TOKENS as ISL, INTER_TOKEN_LATENCY_SECONDS as ITL, KV_HIT_RATE as HIT,
        OUTPUT_SEQUENCE_TOKENS as OSL, REQUESTS_TOTAL as REQUESTS,
        ROUTER_QUEUE_PENDING_REQUESTS as QUEUED, TIME_TO_FIRST_TOKEN_SECONDS as TTFT,
    };
}

/// A histogram's cumulative sum and count.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SumCount {
    pub sum: f64,
    pub count: f64,
}

impl SumCount {
    fn read(page: &Page, histogram: &str) -> SumCount {
        SumCount {
            sum: page.sum(&format!("{histogram}_sum")).unwrap_or(0.0),
            count: page.sum(&format!("{histogram}_count")).unwrap_or(0.0),
        }
    }

    /// The mean of the observations between `self` (earlier) and `now`.
    fn mean_since(&self, now: &SumCount) -> Option<f64> {
        let n = now.count - self.count;
        (n > 0.0).then(|| (now.sum - self.sum) / n)
    }
}

/// The router's cumulative traffic counters at one scrape (absent series read as 0: the
/// router registers them with its first request).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RouterTotals {
    pub requests: f64,
    pub isl: SumCount,
    pub osl: SumCount,
    pub ttft: SumCount,
    pub itl: SumCount,
    pub hit: SumCount,
    /// Requests waiting in the router's queue now (a gauge).
    pub queued: f64,
}

impl RouterTotals {
    pub fn from_page(page: &Page) -> RouterTotals {
        RouterTotals {
            requests: page.sum(names::REQUESTS).unwrap_or(0.0),
            queued: page.sum(names::QUEUED).unwrap_or(0.0),
            isl: SumCount::read(page, names::ISL),
            osl: SumCount::read(page, names::OSL),
            ttft: SumCount::read(page, names::TTFT),
            itl: SumCount::read(page, names::ITL),
            hit: SumCount::read(page, names::HIT),
        }
    }
}

/// The traffic of one interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Traffic {
    pub secs: f64,
    pub requests: f64,
    pub rps: f64,
    /// Means over the requests that finished in the interval (`None`: none did).
    pub isl: Option<f64>,
    pub osl: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
    pub kv_hit_rate: Option<f64>,
}

/// The traffic between two scrapes `secs` apart; `None` when a counter went backwards (the
/// router restarted) or no time passed.
pub fn traffic(prev: &RouterTotals, now: &RouterTotals, secs: f64) -> Option<Traffic> {
    let requests = now.requests - prev.requests;
    if secs <= 0.0 || requests < 0.0 || now.isl.count < prev.isl.count {
        return None;
    }
    Some(Traffic {
        secs,
        requests,
        rps: requests / secs,
        isl: prev.isl.mean_since(&now.isl),
        osl: prev.osl.mean_since(&now.osl),
        ttft_ms: prev.ttft.mean_since(&now.ttft).map(|s| s * 1000.0),
        itl_ms: prev.itl.mean_since(&now.itl).map(|s| s * 1000.0),
        kv_hit_rate: prev.hit.mean_since(&now.hit),
    })
}

/// The prompt tokens waiting in the router's queue, estimated from one scrape to the next:
/// the queued requests times the mean ISL of the requests that finished in between (the
/// router's lifetime mean when none did).
#[derive(Debug, Default)]
pub struct Backlog {
    last: Option<RouterTotals>,
}

impl Backlog {
    /// The backlog at the scrape `now`.
    pub fn tokens(&mut self, now: RouterTotals) -> f64 {
        let lifetime = SumCount::default().mean_since(&now.isl);
        let recent = self.last.and_then(|prev| prev.isl.mean_since(&now.isl));
        self.last = Some(now);
        now.queued * recent.or(lifetime).unwrap_or(0.0)
    }
}

/// Worker gauge names (the load report, `tandem-worker`'s stats).
use tandem_runtime::metrics::names::component as gauges;

/// The load report of worker `worker_id` on its status page (a process may serve several
/// simulated workers, told apart by the `worker_id` label); `None` if it has none yet.
pub fn engine_load(page: &Page, worker_id: u64) -> Option<EngineLoad> {
    let id = worker_id.to_string();
    let get = |name| page.sum_where(name, "worker_id", &id);
    Some(EngineLoad {
        queued_prefill_tokens: get(gauges::QUEUED_PREFILL_TOKENS)?,
        context_length: get(gauges::CONTEXT_LENGTH)?,
        kv_tokens: get(gauges::SCHEDULED_KV_TOKENS)? + get(gauges::QUEUED_KV_TOKENS)?,
        kv_capacity: get(gauges::KV_CAPACITY_TOKENS)?,
        sequences: get(gauges::RUNNING_REQUESTS)? + get(gauges::WAITING_REQUESTS)?,
    })
}

/// A scaled worker found in discovery.
#[derive(Clone, Debug, PartialEq)]
pub struct Worker {
    pub instance_id: u64,
    pub role: Role,
    /// Its status server (`/metrics`), when it advertises one.
    pub http_addr: Option<String>,
}

/// What one role looks like this interval.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoleView {
    /// Workers registered in discovery (serving; a draining one has deregistered).
    pub replicas: u32,
    /// Load reports of the workers that answered.
    pub loads: Vec<EngineLoad>,
    /// Registered workers whose load could not be read.
    pub missing: u32,
    /// Prompt tokens waiting in the router's queue for this role's engines to prefill.
    pub backlog_tokens: f64,
}

/// Reads the metrics sources.
pub struct Observer {
    client: reqwest::Client,
    discovery: Arc<dyn Discovery>,
    namespace: String,
    router_metrics_url: String,
}

/// Bound on one scrape.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);

impl Observer {
    pub fn new(
        discovery: Arc<dyn Discovery>,
        namespace: String,
        router_metrics_url: String,
    ) -> Observer {
        let client = reqwest::Client::builder()
            .timeout(SCRAPE_TIMEOUT)
            .build()
            .unwrap_or_default();
        Observer {
            client,
            discovery,
            namespace,
            router_metrics_url,
        }
    }

    async fn page(&self, url: &str) -> Result<Page, ObserveError> {
        let http = |source| ObserveError::Http {
            url: url.to_string(),
            source,
        };
        let resp = self.client.get(url).send().await.map_err(http)?;
        if !resp.status().is_success() {
            return Err(ObserveError::Status {
                url: url.to_string(),
                status: resp.status().as_u16(),
            });
        }
        let text = resp.text().await.map_err(http)?;
        Page::parse(&text).map_err(|source| ObserveError::Parse {
            url: url.to_string(),
            source,
        })
    }

    /// The router's cumulative counters now.
    pub async fn router(&self) -> Result<RouterTotals, ObserveError> {
        Ok(RouterTotals::from_page(
            &self.page(&self.router_metrics_url).await?,
        ))
    }

    /// The scaled workers registered now.
    pub async fn workers(&self) -> Result<Vec<Worker>, ObserveError> {
        let entries = self.discovery.list(&self.namespace, None).await?;
        Ok(entries
            .into_iter()
            .filter_map(|e| {
                Some(Worker {
                    role: Role::of_worker(&e.instance.role)?,
                    instance_id: e.instance.instance_id,
                    http_addr: e.instance.http_addr,
                })
            })
            .collect())
    }

    /// Every role's replicas and load reports (each status page read once).
    pub async fn roles(&self) -> Result<BTreeMap<Role, RoleView>, ObserveError> {
        let workers = self.workers().await?;
        let mut pages: BTreeMap<String, Option<Page>> = BTreeMap::new();
        for addr in workers.iter().filter_map(|w| w.http_addr.as_ref()) {
            if !pages.contains_key(addr) {
                let page = self.page(&format!("http://{addr}/metrics")).await;
                if let Err(e) = &page {
                    tracing::warn!("worker load report unavailable: {e}");
                }
                pages.insert(addr.clone(), page.ok());
            }
        }
        let mut out: BTreeMap<Role, RoleView> = BTreeMap::new();
        for w in &workers {
            let view = out.entry(w.role).or_default();
            view.replicas += 1;
            let page = w.http_addr.as_ref().and_then(|a| pages.get(a)?.as_ref());
            match page.and_then(|p| engine_load(p, w.instance_id)) {
                Some(load) => view.loads.push(load),
                None => view.missing += 1,
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(requests: f64, isl: (f64, f64), ttft: (f64, f64)) -> RouterTotals {
        RouterTotals {
            requests,
            isl: SumCount {
                sum: isl.0,
                count: isl.1,
            },
            ttft: SumCount {
                sum: ttft.0,
                count: ttft.1,
            },
            ..RouterTotals::default()
        }
    }

    #[test]
    fn traffic_is_the_difference_of_two_scrapes() {
        let a = totals(100.0, (10_000.0, 100.0), (5.0, 100.0));
        let b = totals(160.0, (22_000.0, 160.0), (11.0, 160.0));
        let t = traffic(&a, &b, 30.0).unwrap();
        assert_eq!(t.requests, 60.0);
        assert_eq!(t.rps, 2.0);
        // 12,000 tokens over 60 requests.
        assert_eq!(t.isl, Some(200.0));
        // 6 s over 60 first tokens = 100 ms.
        assert!((t.ttft_ms.unwrap() - 100.0).abs() < 1e-9);
        assert_eq!(t.osl, None, "no output histogram in either scrape");
        // A restarted router: counters went back.
        assert_eq!(traffic(&b, &a, 30.0), None);
    }

    #[test]
    fn the_backlog_is_queued_requests_times_the_recent_isl() {
        let mut b = Backlog::default();
        // Lifetime: 100 requests of 500 tokens; 4 queued.
        let mut t = totals(100.0, (50_000.0, 100.0), (0.0, 0.0));
        t.queued = 4.0;
        assert_eq!(b.tokens(t), 2000.0);
        // Since then 10 requests of 2,000 tokens finished; 3 queued.
        let mut t2 = totals(110.0, (70_000.0, 110.0), (0.0, 0.0));
        t2.queued = 3.0;
        assert_eq!(b.tokens(t2), 6000.0);
        // None finished since: the lifetime mean (70,000 / 110).
        let mut t3 = t2;
        t3.queued = 11.0;
        assert!((b.tokens(t3) - 7000.0).abs() < 1e-9);
        // A router that has served nothing has no backlog to size.
        assert_eq!(Backlog::default().tokens(RouterTotals::default()), 0.0);
    }

    #[test]
    fn a_workers_load_report_is_found_by_its_id() {
        let page = Page::parse(
            "dynamo_component_queued_prefill_tokens{worker_id=\"5\"} 100\n\
             dynamo_component_queued_prefill_tokens{worker_id=\"6\"} 7\n\
             dynamo_component_scheduled_kv_tokens{worker_id=\"5\"} 300\n\
             dynamo_component_queued_kv_tokens{worker_id=\"5\"} 100\n\
             dynamo_component_kv_capacity_tokens{worker_id=\"5\"} 1000\n\
             dynamo_component_context_length{worker_id=\"5\"} 4096\n\
             dynamo_component_running_requests{worker_id=\"5\"} 3\n\
             dynamo_component_waiting_requests{worker_id=\"5\"} 1\n",
        )
        .unwrap();
        let l = engine_load(&page, 5).unwrap();
        assert_eq!(l.queued_prefill_tokens, 100.0);
        assert_eq!(l.sequences, 4.0);
        assert_eq!(l.kv_tokens, 400.0);
        assert_eq!(l.kv_capacity, 1000.0);
        assert_eq!(
            engine_load(&page, 6),
            None,
            "worker 6 reported only one gauge"
        );
    }
}
