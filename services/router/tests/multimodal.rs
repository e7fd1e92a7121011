//! Image inputs end to end: the router and a real worker serving the tiny random LLaVA
//! (`tandem model tiny-vl`) over loopback. Image tokens are counted in the usage, the prefix
//! cache keys on the image's content, and every bad input is a 4xx naming the content part.

mod common;

use base64::Engine as _;
use common::Topology;
use serde_json::{json, Value};

const MODEL: &str = "tandem-tiny-vl";

fn image(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/goldens/llava_images")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn data_url(media_type: &str, bytes: &[u8]) -> String {
    format!(
        "data:{media_type};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn png(name: &str) -> String {
    data_url("image/png", &image(name))
}

/// A chat request of one user message: `urls` as image parts, then a question.
fn chat(urls: &[String]) -> Value {
    let mut content: Vec<Value> = urls
        .iter()
        .map(|u| json!({"type": "image_url", "image_url": {"url": u}}))
        .collect();
    // Long enough to fill several KV blocks behind the image.
    let question = "What is in this picture? Describe it in detail. ".repeat(12);
    content.push(json!({"type": "text", "text": question}));
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": true,
    })
}

async fn tiny_vl(router_args: &[&str]) -> Topology {
    let dir = tandem_tiny_model::ensure_tiny_vl_model().expect("build the tiny LLaVA model");
    let dir = dir.to_str().expect("utf-8 path").to_owned();
    Topology::start_healthy(
        1,
        &[
            "--model-path",
            &dir,
            "--served-model-name",
            MODEL,
            "--enable-multimodal",
        ],
        router_args,
    )
    .await
}

fn first_logprob(body: &Value) -> f64 {
    body["choices"][0]["logprobs"]["content"][0]["logprob"]
        .as_f64()
        .unwrap_or_else(|| panic!("no logprob in {body}"))
}

fn usage(body: &Value) -> (u64, u64) {
    let u = &body["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_prompts_count_their_tokens_and_key_the_cache_by_content() {
    let t = tiny_vl(&[]).await;
    let (a, b) = (png("a_gradient.png"), png("b_stripes.png"));

    let (status, first, _) = t
        .post("/v1/chat/completions", chat(std::slice::from_ref(&a)))
        .await;
    assert_eq!(status, 200, "{first}");
    let (prompt_tokens, cached) = usage(&first);
    assert_eq!(cached, 0);

    let (status, two, _) = t
        .post("/v1/chat/completions", chat(&[a.clone(), b.clone()]))
        .await;
    assert_eq!(status, 200, "{two}");
    // The second image adds its 16 image tokens and the template's newline.
    assert_eq!(
        usage(&two).0,
        prompt_tokens + 17,
        "image tokens are counted"
    );

    let (_, again, _) = t
        .post("/v1/chat/completions", chat(std::slice::from_ref(&a)))
        .await;
    assert_eq!(first_logprob(&again), first_logprob(&first));
    assert!(
        usage(&again).1 >= 16,
        "the same image is a prefix cache hit: {again}"
    );

    let (status, other, _) = t.post("/v1/chat/completions", chat(&[b])).await;
    assert_eq!(status, 200, "{other}");
    assert_ne!(
        first_logprob(&other),
        first_logprob(&first),
        "another image changes the first token's logprob"
    );
    assert!(
        usage(&other).1 < 16,
        "another image behind the same text misses from the image on: {other}"
    );

    // Without --allowed-local-media-path, file: URLs are refused.
    let file = format!("file://{}", std::env::temp_dir().join("x.png").display());
    let (status, body, _) = t.post("/v1/chat/completions", chat(&[file])).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "messages[0].content[0]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_images_are_refused_naming_the_part() {
    let folder = common::temp_dir("media");
    let inside = folder.join("a.png");
    std::fs::write(&inside, image("a_gradient.png")).unwrap();
    let outside = common::temp_dir("elsewhere").join("b.png");
    std::fs::write(&outside, image("b_stripes.png")).unwrap();
    let escape = folder.join("escape.png");
    std::os::unix::fs::symlink(&outside, &escape).unwrap();
    let folder_arg = folder.to_str().unwrap().to_owned();
    let t = tiny_vl(&[
        "--allowed-local-media-path",
        &folder_arg,
        "--max-file-size-mb",
        "1",
        "--max-images-per-request",
        "20",
    ])
    .await;

    let (status, ok, _) = t
        .post(
            "/v1/chat/completions",
            chat(&[format!("file://{}", inside.display())]),
        )
        .await;
    assert_eq!(
        status, 200,
        "a file inside the allowed folder is read: {ok}"
    );

    let gif = data_url("image/png", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;");
    let big = data_url("image/png", &vec![0u8; 1024 * 1024 + 1]);
    let cases: Vec<(String, u16, &str)> = vec![
        ("data:image/png;base64,@@@".into(), 400, "base64"),
        (gif, 400, "GIF"),
        (
            data_url("image/png", &image("a_gradient.png")[..100]),
            400,
            "decode",
        ),
        ("data:text/plain;base64,aGk=".into(), 400, "media type"),
        (format!("file://{}", outside.display()), 400, "outside"),
        (format!("file://{}", escape.display()), 400, "outside"),
        (format!("file://{}/../x.png", folder.display()), 400, ""),
        (
            "https://example.invalid/cat.png".into(),
            400,
            "cannot fetch",
        ),
        // Internal addresses are refused before any connection (no --media-allow-internal).
        ("http://127.0.0.1:9/cat.png".into(), 400, "internal address"),
        ("http://localhost:9/cat.png".into(), 400, "internal address"),
        ("http://[::1]:9/cat.png".into(), 400, "internal address"),
        (big, 413, "exceeds"),
    ];
    for (url, want, says) in cases {
        let (status, body, _) = t.post("/v1/chat/completions", chat(&[url])).await;
        assert_eq!(status, want, "{body}");
        assert_eq!(body["error"]["param"], "messages[0].content[0]", "{body}");
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{says:?} not in {msg:?}");
    }

    let many: Vec<String> = (0..17).map(|_| png("a_gradient.png")).collect();
    let (status, body, _) = t.post("/v1/chat/completions", chat(&many)).await;
    assert_eq!(status, 400, "{body}");
    // The model's 16 is below the router's 20.
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("limit of 16"), "{msg}");

    let mut audio = chat(&[]);
    audio["messages"][0]["content"][0] = json!({"type": "input_audio", "input_audio": {}});
    let (status, body, _) = t.post("/v1/chat/completions", audio).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "messages[0].content[0]");

    // The worker still serves after all of that.
    let (status, body, _) = t
        .post("/v1/chat/completions", chat(&[png("b_stripes.png")]))
        .await;
    assert_eq!(status, 200, "{body}");
    let _ = std::fs::remove_dir_all(&folder);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_model_refuses_images() {
    let t = Topology::start_healthy(1, &[], &[]).await;
    let mut body = chat(&[png("a_gradient.png")]);
    body["model"] = json!("tandem-tiny");
    let (status, resp, _) = t.post("/v1/chat/completions", body).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["param"], "messages[0].content[0]");
    assert!(resp["error"]["message"]
        .as_str()
        .unwrap()
        .contains("does not take images"));
}

/// The greedy tokens and first logprob of an image chat request on `t`.
async fn greedy(t: &Topology, urls: &[String]) -> Greedy {
    let mut body = chat(urls);
    body["max_tokens"] = json!(8);
    let (status, resp, _) = t.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{resp}");
    let tokens = resp["choices"][0]["logprobs"]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c["token"].clone())
        .collect();
    (tokens, first_logprob(&resp), usage(&resp).0)
}

/// What [`greedy`] returns.
type Greedy = (Vec<Value>, f64, u64);

/// Each case's greedy output on `t` is the expected one (tokens, prompt tokens, and the
/// first logprob within 1e-4).
async fn assert_same_greedy(t: &Topology, cases: &[(&str, &[String], &Greedy)]) {
    for (name, urls, want) in cases {
        let got = greedy(t, urls).await;
        assert_eq!(got.0, want.0, "{name}: greedy tokens");
        assert_eq!(got.2, want.2, "{name}: prompt tokens");
        assert!(
            (got.1 - want.1).abs() < 1e-4,
            "{name}: first logprob {} vs {}",
            got.1,
            want.1
        );
    }
}

/// Every role's flags for the tiny LLaVA in `dir`, images enabled, TCP transfers.
fn multimodal_args(dir: &str) -> [&str; 7] {
    [
        "--model-path",
        dir,
        "--served-model-name",
        MODEL,
        "--kv-transport",
        "tcp",
        "--enable-multimodal",
    ]
}

/// A router over `worker` (and the other workers registered in `disc`), healthy.
async fn routed(disc: std::path::PathBuf, worker: common::Proc, router_args: &[&str]) -> Topology {
    let router = common::start_router(&disc, 1, router_args);
    let t = Topology {
        base: format!("http://{}", common::field(router.ready_line(), "http=")),
        workers: vec![worker],
        router: Some(router),
        discovery: disc,
    };
    t.wait_healthy().await;
    t
}

/// A prefill worker, a `pd` decode worker and a router that always disaggregates, once the
/// router prefills remotely.
async fn disaggregated(disc: std::path::PathBuf, worker_args: &[&str]) -> (common::Proc, Topology) {
    let prefill = common::start_role(&disc, "tandem-prefill", "prefill", worker_args, &[]);
    let decode = common::start_role(&disc, "tandem-decode", "pd", worker_args, &[]);
    let t = routed(disc, decode, &["--enforce-disagg", "--expose-worker-id"]).await;
    wait_remote_prefill(&t).await;
    (prefill, t)
}

/// Waits (bounded) until the router has seen the prefill worker: a text request is
/// prefilled remotely.
async fn wait_remote_prefill(t: &Topology) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (status, body, headers) = t.post("/v1/chat/completions", chat(&[])).await;
        if status == 200 && headers.contains_key("x-tandem-prefill-worker-id") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never prefilled remotely: {status} {body} {headers:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The tiny LLaVA's folder, two images, and an aggregated worker's greedy output for the
/// first image and for both: what the disaggregated topologies must reproduce.
async fn aggregated_reference() -> (String, [String; 2], Greedy, Greedy) {
    let dir = tandem_tiny_model::ensure_tiny_vl_model().expect("build the tiny LLaVA model");
    let dir = dir.to_str().unwrap().to_owned();
    let agg = tiny_vl(&[]).await;
    let urls = [png("a_gradient.png"), png("b_stripes.png")];
    let want_one = greedy(&agg, &urls[..1]).await;
    let want_two = greedy(&agg, &urls).await;
    (dir, urls, want_one, want_two)
}

/// EP/D: the prefill worker encodes the images and pushes the prompt's KV to a `pd` decode
/// worker (`--enforce-disagg`); the output equals the aggregated worker's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encode_in_prefill_equals_aggregated() {
    let (dir, urls, want_one, want_two) = aggregated_reference().await;

    let disc = common::temp_dir("epd");
    let (_prefill, t) = disaggregated(disc, &multimodal_args(&dir)).await;
    assert_same_greedy(
        &t,
        &[
            ("one image", &urls[..1], &want_one),
            ("two images", &urls[..], &want_two),
        ],
    )
    .await;
}

/// A counter or gauge of a worker's `/metrics` (summed over its label sets that contain
/// `labels`); 0 when absent.
async fn metric(worker: &common::Proc, name: &str, labels: &str) -> f64 {
    let addr = common::field(worker.ready_line(), "http=");
    common::metric_sum(&format!("http://{addr}/metrics"), name, labels).await
}

/// E/P/D: an encode worker runs the vision tower and writes the embeddings into the prefill
/// worker's memory over the transfer layer; the output equals the aggregated worker's, the
/// same image twice is an embedding-cache hit, the bytes moved are in both sides' metrics, and
/// no embedding region is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_encode_workers_equal_aggregated() {
    let (dir, urls, want_one, want_two) = aggregated_reference().await;

    let disc = common::temp_dir("e-p-d");
    let base = multimodal_args(&dir);
    let encoder_args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--multimodal-embedding-cache-capacity-gb", "0.1"])
        .collect();
    let client_args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--encode-endpoint", "dyn://dynamo.encode.generate"])
        .collect();
    let encoder = common::start_role(&disc, "tandem-encode", "encode", &encoder_args, &[]);
    let (prefill, t) = disaggregated(disc, &client_args).await;
    assert_same_greedy(
        &t,
        &[
            ("one image", &urls[..1], &want_one),
            ("two images", &urls[..], &want_two),
            ("one image again", &urls[..1], &want_one),
        ],
    )
    .await;
    // Four images went to the encode worker; the first (a) and second (b) were encoded, the
    // other two were a again: cache hits.
    let hits = metric(&encoder, "tandem_encode_images_total", "cache=\"hit\"").await;
    let misses = metric(&encoder, "tandem_encode_images_total", "cache=\"miss\"").await;
    assert_eq!((hits, misses), (2.0, 2.0), "embedding cache hits, misses");
    // 16 image tokens x hidden 64 x 4 bytes per image, four images, both sides.
    let per_image = 16.0 * 64.0 * 4.0;
    let written = metric(&encoder, "tandem_encode_bytes_written_total", "").await;
    let received = metric(&prefill, "tandem_worker_embedding_bytes_received_total", "").await
        + metric(
            &t.workers[0],
            "tandem_worker_embedding_bytes_received_total",
            "",
        )
        .await;
    assert_eq!(
        written,
        4.0 * per_image,
        "bytes written by the encode worker"
    );
    assert_eq!(
        received, written,
        "bytes received by the prefill and decode workers"
    );
    for w in [&prefill, &t.workers[0]] {
        let live = metric(w, "tandem_worker_embedding_regions", "state=\"live\"").await;
        let q = metric(
            w,
            "tandem_worker_embedding_regions",
            "state=\"quarantined\"",
        )
        .await;
        assert_eq!((live, q), (0.0, 0.0), "embedding regions left");
    }
}

/// Waits (bounded) until a worker's embedding regions are `(live, quarantined)`.
async fn wait_regions(worker: &common::Proc, want: (f64, f64)) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let live = metric(worker, "tandem_worker_embedding_regions", "state=\"live\"").await;
        let q = metric(
            worker,
            "tandem_worker_embedding_regions",
            "state=\"quarantined\"",
        )
        .await;
        if (live, q) == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "embedding regions (live, quarantined) still {:?}, want {want:?}",
            (live, q)
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Waits (bounded) until `path` exists.
async fn wait_file(path: &std::path::Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// An aggregated worker with `--encode-endpoint` gives up on an encode call whose write is
/// held (the failpoint stands for a put in flight): the request fails, and the region stays
/// quarantined until the encode worker's write has ended (then it is freed), or until the
/// encode worker is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_encode_call_frees_its_region_only_once_the_writer_stopped() {
    let dir = tandem_tiny_model::ensure_tiny_vl_model().expect("build the tiny LLaVA model");
    let dir = dir.to_str().unwrap().to_owned();
    let disc = common::temp_dir("encode-fence");
    let holds = common::temp_dir("encode-hold");
    let base = multimodal_args(&dir);
    let hold_env = [("TANDEM_FAILPOINT_ENCODE_HOLD_DIR", holds.to_str().unwrap())];
    let mut encoder = common::start_role(&disc, "tandem-encode", "encode", &base, &hold_env);
    let worker_args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--encode-endpoint", "dyn://dynamo.encode.generate"])
        .chain(["--kv-lease-ttl-secs", "1"])
        .collect();
    let worker = common::start_role(&disc, "tandem-decode", "agg", &worker_args, &[]);
    let t = routed(disc, worker, &[]).await;
    let (status, body, _) = t
        .post("/v1/chat/completions", chat(&[png("a_gradient.png")]))
        .await;
    assert_eq!(status, 200, "{body}");
    wait_regions(&t.workers[0], (0.0, 0.0)).await;

    // Held, then released: the write lands in the quarantined region, which is then freed.
    let (hold, reached) = (holds.join("hold"), holds.join("reached"));
    std::fs::write(&hold, b"").unwrap();
    let (status, body, _) = t
        .post("/v1/chat/completions", chat(&[png("b_stripes.png")]))
        .await;
    assert!(
        status >= 500,
        "a timed-out encode call fails the request: {status} {body}"
    );
    wait_file(&reached).await;
    wait_regions(&t.workers[0], (0.0, 1.0)).await;
    std::fs::remove_file(&hold).unwrap();
    wait_regions(&t.workers[0], (0.0, 0.0)).await;

    // Held, then the encode worker dies: nothing can write any more, the region is freed.
    std::fs::remove_file(&reached).unwrap();
    std::fs::write(&hold, b"").unwrap();
    let jpeg = data_url("image/jpeg", &image("c_checker.jpg"));
    let (status, body, _) = t.post("/v1/chat/completions", chat(&[jpeg])).await;
    assert!(status >= 500, "{status} {body}");
    wait_file(&reached).await;
    wait_regions(&t.workers[0], (0.0, 1.0)).await;
    encoder.child.kill().unwrap();
    encoder.child.wait().unwrap();
    wait_regions(&t.workers[0], (0.0, 0.0)).await;
}

/// A one-connection-at-a-time HTTP/1.1 server on loopback for image URLs: `/a.png` (the
/// gradient), `/redirect` (302 to it), `/loop` (302 to itself), `/missing` (404), `/slow`
/// (answers after 5 s), `/big` (2 MiB). Returns its address.
async fn image_server() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let png = image("a_gradient.png");
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let png = png.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = sock.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).into_owned();
                let path = req.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let (head, body): (String, Vec<u8>) = match path.as_str() {
                    "/a.png" => ("200 OK\r\nContent-Type: image/png".into(), png),
                    "/redirect" => ("302 Found\r\nLocation: /a.png".into(), vec![]),
                    "/loop" => ("302 Found\r\nLocation: /loop".into(), vec![]),
                    "/slow" => {
                        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                        ("200 OK".into(), png)
                    }
                    "/big" => ("200 OK".into(), vec![0u8; 2 * 1024 * 1024]),
                    _ => ("404 Not Found".into(), vec![]),
                };
                let head = format!(
                    "HTTP/1.1 {head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(head.as_bytes()).await;
                let _ = sock.write_all(&body).await;
            });
        }
    });
    addr
}

/// http(s) image URLs are fetched (here from loopback, allowed with --media-allow-internal),
/// redirects followed a few times, and a missing image, a slow server, an image over the
/// size cap and a redirect loop are each a 4xx naming the part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_image_urls_are_fetched_within_bounds() {
    let server = image_server().await;
    let t = tiny_vl(&[
        "--media-allow-internal",
        "--media-fetch-timeout-secs",
        "1",
        "--max-file-size-mb",
        "1",
    ])
    .await;
    let want = greedy(&t, &[png("a_gradient.png")]).await;
    for path in ["/a.png", "/redirect"] {
        let got = greedy(&t, &[format!("http://{server}{path}")]).await;
        assert_eq!(got.0, want.0, "{path}: greedy tokens");
        assert!((got.1 - want.1).abs() < 1e-4, "{path}: first logprob");
    }
    for (path, status, says) in [
        ("/missing", 400, "HTTP 404"),
        ("/slow", 400, "longer than"),
        ("/big", 413, "limit"),
        ("/loop", 400, "redirects"),
    ] {
        let url = format!("http://{server}{path}");
        let (got, body, _) = t.post("/v1/chat/completions", chat(&[url])).await;
        assert_eq!(got, status, "{path}: {body}");
        assert_eq!(body["error"]["param"], "messages[0].content[0]", "{body}");
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{path}: {says:?} not in {msg:?}");
    }
}
