//! The engine end to end on the built-in tiny model with the CPU backend:
//! - continuation: export a request after its prompt and some tokens, import it into a fresh
//!   engine, continue — the tokens and text are those of an uninterrupted run, for greedy and
//!   for seeded sampling with penalties and a stop string;
//! - structured outputs: JSON under a schema (seeded sampling at temperature 1, 100 seeds),
//!   regex, choice and Lark constraints, and logit bias; a constrained request continues
//!   across an export and import exactly (the grammar replays its output); a backend that
//!   samples on its device gets each step's grammar mask in the plan and draws the same tokens
//!   as the host path;
//! - many concurrent requests through a small block pool (forcing preemption) all complete,
//!   each with its solo output, and every block returns to the pool.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::backend::cpu::CpuBackend;
use tandem_engine::backend::{Backend, DeviceSample, SeqInput, StepOutput};
use tandem_engine::engine::{
    CapacitySchedulerPolicy, Engine, EngineConfig, EngineHandle, FinishReason, Request,
    RequestOutput, StopReason,
};
use tandem_engine::error::EngineError;
use tandem_engine::kv::layout::{KvDtype, KvLayout};
use tandem_engine::model::{LoadOptions, LoadedModel};
use tandem_engine::sampler::{SamplePlan, SamplingParams};
use tandem_engine::tokenizer::Tokenizer;
use tandem_text::Constraint;

const T: Duration = Duration::from_secs(300);
const BLOCK: usize = 8;

struct Tiny {
    model: LoadedModel,
    tokenizer: Arc<Tokenizer>,
}

fn tiny() -> Tiny {
    let dir = tandem_engine::tiny::ensure_tiny_model().expect("build the tiny model");
    let model = LoadedModel::load(&dir, &LoadOptions::default()).expect("load the tiny model");
    let tokenizer = Arc::new(Tokenizer::load(&dir).expect("load the tokenizer"));
    Tiny { model, tokenizer }
}

/// The CPU backend, running one step per permit, so the test decides where the export lands.
struct Gated {
    inner: CpuBackend,
    permits: std::sync::mpsc::Receiver<()>,
}

impl Backend for Gated {
    fn layout(&self) -> &KvLayout {
        self.inner.layout()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        self.permits
            .recv_timeout(T)
            .map_err(|_| EngineError::InvalidInput("test gate closed or timed out".into()))?;
        self.inner.forward(batch)
    }
    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        self.inner.export_blocks(blocks)
    }
    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        self.inner.import_blocks(blocks, data)
    }
}

/// The CPU backend as a device sampler: it samples each row by its plan (the rule a device
/// kernel follows), counting the steps it sampled and the plans that carried a grammar mask.
struct DeviceSampled {
    inner: CpuBackend,
    masked_plans: Arc<std::sync::atomic::AtomicUsize>,
}

impl Backend for DeviceSampled {
    fn layout(&self) -> &KvLayout {
        self.inner.layout()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput, EngineError> {
        self.inner.forward(batch)
    }
    fn samples_on_device(&self) -> bool {
        true
    }
    fn forward_sampled(
        &mut self,
        batch: &[SeqInput<'_>],
        plans: &[Option<&SamplePlan>],
    ) -> Result<Vec<Option<DeviceSample>>, EngineError> {
        let out = self.inner.forward(batch)?;
        let masked = plans.iter().flatten().filter(|p| p.allowed.is_some());
        self.masked_plans
            .fetch_add(masked.count(), std::sync::atomic::Ordering::Relaxed);
        Ok(out
            .logits
            .iter()
            .zip(plans)
            .map(|(rows, plan)| {
                let (token, logprob) = plan.as_ref()?.sample_row_with_logprobs(rows.last()?);
                Some(DeviceSample { token, logprob })
            })
            .collect())
    }
    fn export_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, EngineError> {
        self.inner.export_blocks(blocks)
    }
    fn import_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<(), EngineError> {
        self.inner.import_blocks(blocks, data)
    }
}

fn engine(t: &Tiny, num_blocks: usize, policy: CapacitySchedulerPolicy) -> EngineHandle {
    let backend = CpuBackend::new(&t.model, KvDtype::F32, BLOCK, num_blocks).expect("backend");
    start(t, Box::new(backend), num_blocks, policy)
}

fn gated_engine(
    t: &Tiny,
    num_blocks: usize,
    policy: CapacitySchedulerPolicy,
) -> (EngineHandle, std::sync::mpsc::Sender<()>) {
    let inner = CpuBackend::new(&t.model, KvDtype::F32, BLOCK, num_blocks).expect("backend");
    let (tx, permits) = std::sync::mpsc::channel();
    let h = start(t, Box::new(Gated { inner, permits }), num_blocks, policy);
    (h, tx)
}

fn start(
    t: &Tiny,
    backend: Box<dyn Backend>,
    num_blocks: usize,
    policy: CapacitySchedulerPolicy,
) -> EngineHandle {
    let cfg = EngineConfig {
        max_batch_size: 8,
        max_num_tokens: 64,
        max_seq_len: 256,
        num_blocks,
        eos_token_ids: t.model.eos_token_ids(),
        capacity_scheduler_policy: policy,
        ..EngineConfig::default()
    };
    Engine::start(backend, Some(t.tokenizer.clone()), cfg).expect("start")
}

fn req(id: &str, prompt: Vec<u32>, params: SamplingParams) -> Request {
    Request {
        replayed: 0,
        request_id: id.into(),
        cache_salt: None,
        prompt,
        params,
        media: Default::default(),
    }
}

fn tokens(outs: &[RequestOutput]) -> Vec<u32> {
    outs.iter().flat_map(|o| o.token_ids.clone()).collect()
}

fn text(outs: &[RequestOutput]) -> String {
    outs.iter().map(|o| o.text.as_str()).collect()
}

async fn run(h: &EngineHandle, r: Request) -> Vec<RequestOutput> {
    let s = h.submit(r).await.expect("submit");
    tokio::time::timeout(T, s.collect()).await.expect("timeout")
}

/// Runs `params` on `prompt` uninterrupted, and again with an export after `after` tokens
/// and an import into a fresh engine; returns (uninterrupted, continued) outputs.
async fn both_ways(
    t: &Tiny,
    prompt: &[u32],
    params: SamplingParams,
    after: usize,
) -> (Vec<RequestOutput>, Vec<RequestOutput>) {
    let reference = engine(t, 64, CapacitySchedulerPolicy::GuaranteedNoEvict);
    let want = run(&reference, req("r", prompt.to_vec(), params.clone())).await;

    // `after` permits: the prompt step and `after - 1` decode steps give `after` tokens (the
    // prompt fits one step). The export lands before or after the next step.
    let (a, permits) = gated_engine(t, 64, CapacitySchedulerPolicy::GuaranteedNoEvict);
    let mut s = a.submit(req("r", prompt.to_vec(), params)).await.unwrap();
    for _ in 0..after {
        permits.send(()).unwrap();
    }
    let mut got = Vec::new();
    while tokens(&got).len() < after {
        let o = tokio::time::timeout(T, s.next()).await.unwrap().unwrap();
        assert!(
            o.finish_reason.is_none(),
            "finished before the export point"
        );
        got.push(o);
    }
    let export = a.export("r");
    permits.send(()).unwrap();
    let snap = tokio::time::timeout(T, export).await.unwrap().unwrap();
    let generated = snap.state.tokens.len() - snap.state.prompt_len;
    assert!(generated == after || generated == after + 1);
    let rest = tokio::time::timeout(T, s.collect()).await.unwrap();
    assert_eq!(
        rest.last().unwrap().finish_reason,
        Some(FinishReason::Migrated)
    );
    got.extend(rest);
    let stats = a.stats();
    permits.send(()).unwrap();
    assert_eq!(stats.await.unwrap().blocks.referenced, 0);

    let b = engine(t, 64, CapacitySchedulerPolicy::GuaranteedNoEvict);
    let s = b.import(snap).await.unwrap();
    got.extend(tokio::time::timeout(T, s.collect()).await.unwrap());
    // Drop the Migrated marker for comparison.
    got.retain(|o| o.finish_reason != Some(FinishReason::Migrated));
    (want, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuation_after_export_import_is_exact() {
    let t = tiny();
    let prompt = t
        .tokenizer
        .encode("The quick brown fox jumps over", false)
        .unwrap();

    // Greedy.
    let greedy = SamplingParams {
        max_tokens: Some(24),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let (want, got) = both_ways(&t, &prompt, greedy, 6).await;
    assert_eq!(tokens(&got), tokens(&want));
    assert_eq!(text(&got), text(&want));

    // Seeded sampling with penalties; first find a stop string that the run will hit, made
    // of text spanning a token boundary, then continue across an export with it.
    let sampled = SamplingParams {
        max_tokens: Some(40),
        seed: Some(2024),
        temperature: 0.9,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.01,
        repetition_penalty: 1.1,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        ignore_eos: true,
        logprobs: Some(2),
        ..SamplingParams::default()
    };
    let reference = engine(&t, 64, CapacitySchedulerPolicy::GuaranteedNoEvict);
    let free = run(&reference, req("f", prompt.clone(), sampled.clone())).await;
    let full = text(&free);
    let chars: Vec<char> = full.chars().collect();
    assert!(
        chars.len() > 20,
        "need some text to pick a stop string from: {full:?}"
    );
    let stop: String = chars[chars.len() * 2 / 3..chars.len() * 2 / 3 + 3]
        .iter()
        .collect();
    // Before min_tokens, a stop string does not count.
    let late = SamplingParams {
        stop: vec![stop.clone()],
        min_tokens: 40,
        ..sampled.clone()
    };
    let outs = run(&reference, req("late", prompt.clone(), late)).await;
    assert_eq!(text(&outs), full);
    let with_stop = SamplingParams {
        stop: vec![stop.clone()],
        ..sampled
    };
    let (want, got) = both_ways(&t, &prompt, with_stop, 5).await;
    let cut = full.find(&stop).unwrap();
    assert_eq!(text(&want), full[..cut], "stop string is not emitted");
    assert_eq!(
        want.last().unwrap().stop_reason,
        Some(StopReason::String(stop))
    );
    assert_eq!(tokens(&got), tokens(&want));
    assert_eq!(text(&got), text(&want));
    let lp = |o: &[RequestOutput]| -> Vec<f32> {
        o.iter()
            .flat_map(|x| x.logprobs.iter().map(|l| l.logprob))
            .collect()
    };
    assert_eq!(lp(&got), lp(&want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_with_a_small_pool_all_complete() {
    let t = tiny();
    let prompts: Vec<Vec<u32>> = [
        "Once upon a time",
        "In a galaxy far, far away there was",
        "def fibonacci(n):",
        "The capital of France is",
        "1, 2, 3, 4, 5,",
        "Roses are red, violets are",
    ]
    .iter()
    .map(|p| t.tokenizer.encode(p, false).unwrap())
    .collect();
    let params = SamplingParams {
        max_tokens: Some(24),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let solo = engine(&t, 64, CapacitySchedulerPolicy::GuaranteedNoEvict);
    let mut want = Vec::new();
    for p in &prompts {
        want.push(tokens(
            &run(&solo, req("s", p.clone(), params.clone())).await,
        ));
    }
    // 10 blocks of 8 tokens; each request grows to 4-5 blocks: they must preempt. The engine
    // holds its first step until every request is queued, so they overlap.
    let (h, permits) = gated_engine(&t, 10, CapacitySchedulerPolicy::MaxUtilization);
    let stats = h.stats();
    let mut pending = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        pending.push(h.submit(req(&format!("r{i}"), p.clone(), params.clone())));
    }
    for _ in 0..10_000 {
        permits.send(()).unwrap();
    }
    let baseline = stats.await.unwrap().blocks;
    let mut streams = Vec::new();
    for f in pending {
        streams.push(tokio::time::timeout(T, f).await.unwrap().unwrap());
    }
    for (i, s) in streams.into_iter().enumerate() {
        let outs = tokio::time::timeout(T, s.collect()).await.unwrap();
        assert_eq!(tokens(&outs), want[i], "request {i}");
        assert_eq!(
            outs.last().unwrap().finish_reason,
            Some(FinishReason::Length)
        );
    }
    let st = h.stats().await.unwrap();
    assert!(st.preemptions > 0, "the pool was meant to force preemption");
    assert_eq!((st.running, st.waiting, st.requests), (0, 0, 0));
    assert_eq!(st.blocks.referenced, baseline.referenced);
    assert_eq!(st.blocks.total, baseline.total);
}

/// The schema of the structured-output tests: every value is bounded, so a random model
/// finishes an object well within its budget.
const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"},
    "size": {"enum": ["small", "large"]},
    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}
  },
  "required": ["name", "ok", "size", "tags"],
  "additionalProperties": false
}"#;

/// Whether `text` is a JSON object valid under [`SCHEMA`].
fn valid_under_schema(text: &str) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("{e}: {text:?}"))?;
    let o = v.as_object().ok_or("not an object")?;
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    let ok = keys == ["name", "ok", "size", "tags"]
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
        && o["ok"].is_boolean()
        && matches!(o["size"].as_str(), Some("small" | "large"))
        && o["tags"]
            .as_array()
            .is_some_and(|t| t.len() <= 3 && t.iter().all(|x| x.as_u64().is_some_and(|n| n <= 99)));
    ok.then_some(())
        .ok_or_else(|| format!("not valid under the schema: {text}"))
}

fn constrained(c: Constraint, seed: u64) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(200),
        seed: Some(seed),
        temperature: 1.0,
        constraint: Some(c),
        ..SamplingParams::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_follow_their_grammar() {
    let t = tiny();
    let prompt = t
        .tokenizer
        .encode("Describe a cat as JSON:", false)
        .unwrap();
    let h = engine(&t, 256, CapacitySchedulerPolicy::GuaranteedNoEvict);

    // JSON under a schema: 100 of 100 seeds, compact, ending with EOS well within budget.
    let schema = Constraint::JsonSchema(SCHEMA.into());
    let mut streams = Vec::new();
    for seed in 0..100u64 {
        let r = req(
            &format!("j{seed}"),
            prompt.clone(),
            constrained(schema.clone(), seed),
        );
        streams.push(h.submit(r).await.expect("submit"));
    }
    let mut outs = Vec::new();
    for s in streams {
        outs.push(tokio::time::timeout(T, s.collect()).await.expect("timeout"));
    }
    let mut texts = std::collections::HashSet::new();
    for (seed, o) in outs.iter().enumerate() {
        let last = o.last().unwrap();
        assert_eq!(
            last.finish_reason,
            Some(FinishReason::Stop),
            "seed {seed}: {last:?}"
        );
        let text = text(o);
        valid_under_schema(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert!(
            !text.contains("\": ") && !text.contains(", "),
            "compact: {text}"
        );
        texts.insert(text);
    }
    assert!(
        texts.len() > 50,
        "seeds draw different objects: {}",
        texts.len()
    );

    // Regex, choice and a Lark grammar.
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let lower = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase());
    type Check = Box<dyn Fn(&str) -> bool>;
    let cases: [(Constraint, Check); 3] = [
        (
            Constraint::Regex("[0-9]{3}-[a-z]{2}".into()),
            Box::new(move |s| s.len() == 6 && digits(&s[..3]) && &s[3..4] == "-" && lower(&s[4..])),
        ),
        (
            Constraint::Choice(vec!["yes".into(), "no".into(), "a.b".into()]),
            Box::new(|s| ["yes", "no", "a.b"].contains(&s)),
        ),
        (
            Constraint::Lark("start: \"(\" NUM (\",\" NUM)* \")\"\nNUM: /[1-9]/".into()),
            Box::new(move |s| {
                s.strip_prefix('(')
                    .and_then(|r| r.strip_suffix(')'))
                    .is_some_and(|inner| {
                        inner
                            .split(',')
                            .all(|n| n.len() == 1 && digits(n) && n != "0")
                    })
            }),
        ),
    ];
    for (i, (c, check)) in cases.into_iter().enumerate() {
        for seed in 0..5 {
            let r = req(
                &format!("c{i}-{seed}"),
                prompt.clone(),
                constrained(c.clone(), seed),
            );
            let o = run(&h, r).await;
            let text = text(&o);
            assert!(check(&text), "{c:?} seed {seed}: {text:?}");
            assert_eq!(o.last().unwrap().finish_reason, Some(FinishReason::Stop));
        }
    }

    // A schema that does not compile is the request's error, before anything runs.
    let bad = req(
        "bad",
        prompt.clone(),
        constrained(Constraint::JsonSchema("{\"type\": 5}".into()), 1),
    );
    let e = h.submit(bad).await.err().expect("refused");
    assert!(e.to_string().contains("json_schema"), "{e}");

    // Logit bias: +100 on one token makes greedy decoding pick it every time.
    let target = t.tokenizer.encode(" banana", false).unwrap()[0];
    let biased = SamplingParams {
        max_tokens: Some(5),
        ignore_eos: true,
        logit_bias: vec![(target, 100.0)],
        ..SamplingParams::greedy()
    };
    let o = run(&h, req("bias", prompt.clone(), biased)).await;
    assert_eq!(tokens(&o), vec![target; 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_request_continues_across_export_and_import() {
    let t = tiny();
    let prompt = t.tokenizer.encode("JSON:", false).unwrap();
    let params = constrained(Constraint::JsonSchema(SCHEMA.into()), 7);
    let (want, got) = both_ways(&t, &prompt, params, 4).await;
    valid_under_schema(&text(&want)).unwrap();
    assert_eq!(tokens(&got), tokens(&want));
    assert_eq!(text(&got), text(&want));
}

/// A device sampler gets each step's grammar mask in its plans: constrained requests draw the
/// same tokens (seeded, temperature 1) as on the host path, and are valid under the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_sampler_applies_the_grammar_mask_of_its_plans() {
    let t = tiny();
    let prompt = t
        .tokenizer
        .encode("Describe a cat as JSON:", false)
        .unwrap();
    let host = engine(&t, 256, CapacitySchedulerPolicy::GuaranteedNoEvict);
    let masked_plans = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let backend = DeviceSampled {
        inner: CpuBackend::new(&t.model, KvDtype::F32, BLOCK, 256).expect("backend"),
        masked_plans: masked_plans.clone(),
    };
    let device = start(
        &t,
        Box::new(backend),
        256,
        CapacitySchedulerPolicy::GuaranteedNoEvict,
    );
    let cases = [
        Constraint::JsonSchema(SCHEMA.into()),
        Constraint::Regex("[0-9]{3}-[a-z]{2}".into()),
    ];
    for (i, c) in cases.iter().enumerate() {
        for seed in 0..4 {
            let params = constrained(c.clone(), seed);
            let want = run(
                &host,
                req(&format!("h{i}-{seed}"), prompt.clone(), params.clone()),
            )
            .await;
            let got = run(
                &device,
                req(&format!("d{i}-{seed}"), prompt.clone(), params),
            )
            .await;
            assert_eq!(tokens(&got), tokens(&want), "{c:?} seed {seed}");
            assert_eq!(got.last().unwrap().finish_reason, Some(FinishReason::Stop));
        }
    }
    valid_under_schema(&text(
        &run(
            &device,
            req("d-json", prompt.clone(), constrained(cases[0].clone(), 9)),
        )
        .await,
    ))
    .unwrap();
    assert!(
        masked_plans.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the grammar's masks never reached the device sampler"
    );
}
