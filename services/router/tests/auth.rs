//! The public port's security, with the real router binary: API keys (flags, env, file) on
//! every route but the probes, 401s shaped as OpenAI's, per-key rate limits, `/debug/*` only on
//! the admin listener, the worker-id header only when asked, and HTTPS with a generated
//! certificate (a plain-HTTP or silent client on the TLS port is dropped, the server keeps
//! serving).

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bin, field, spawn_ready, start_router, start_worker, temp_dir, Topology};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

const KEY: &str = "sk-tandem-first";
const KEY2: &str = "sk-tandem-second";

/// GET `url` with optional headers: status, headers and JSON (or text) body.
async fn get(url: &str, headers: &[(&str, &str)]) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(30));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.expect("request");
    let status = r.status().as_u16();
    let h = r.headers().clone();
    let text = r.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, h, body)
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// A 401 of ours: OpenAI's error shape, `WWW-Authenticate: Bearer`, and no key echoed.
fn assert_unauthorized(what: &str, status: u16, h: &reqwest::header::HeaderMap, body: &Value) {
    assert_eq!(status, 401, "{what}: {body}");
    assert_eq!(h["www-authenticate"], "Bearer", "{what}");
    let e = &body["error"];
    assert_eq!(e["type"], "invalid_request_error", "{what}: {body}");
    assert_eq!(e["code"], "invalid_api_key", "{what}: {body}");
    assert!(e["param"].is_null(), "{what}: {body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    let text = body.to_string();
    assert!(
        !text.contains(KEY) && !text.contains(KEY2),
        "{what}: key echoed: {text}"
    );
}

/// The value of the counter line of `name` whose labels contain every one of `labels`.
fn counter(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_every_route_but_the_probes_and_debug_is_admin_only() {
    let t = Topology::start_healthy(
        1,
        &[],
        &["--api-key", KEY, "--api-key", KEY2, "--admin-port", "0"],
    )
    .await;
    let base = &t.base;
    let admin = t.admin_base();
    let auth = bearer(KEY);

    // The probes stay open (start_healthy already polled /health without a key).
    assert_eq!(get(&format!("{base}/health"), &[]).await.0, 200);
    assert_eq!(get(&format!("{base}/live"), &[]).await.0, 200);

    // /v1/models: no key, a wrong key, a key under another scheme: 401.
    let models = format!("{base}/v1/models");
    let (s, h, b) = get(&models, &[]).await;
    assert_unauthorized("no key", s, &h, &b);
    let (s, h, b) = get(&models, &[("authorization", "Bearer sk-wrong")]).await;
    assert_unauthorized("wrong key", s, &h, &b);
    let (s, h, b) = get(&models, &[("authorization", &format!("Basic {KEY}"))]).await;
    assert_unauthorized("basic scheme", s, &h, &b);
    let (s, h, b) = get(&models, &[("authorization", &format!("Bearer {KEY}x"))]).await;
    assert_unauthorized("a longer key", s, &h, &b);
    // The right keys, as a bearer token or as x-api-key.
    let (s, _, b) = get(&models, &[("authorization", &auth)]).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["data"][0]["id"], "tandem-tiny", "{b}");
    let (s, _, b) = get(&models, &[("x-api-key", KEY2)]).await;
    assert_eq!(s, 200, "{b}");

    // A chat completion: 401 without the key (body never read), 200 with it, and no
    // worker-id header without --expose-worker-id.
    let chat = json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2});
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .expect("chat");
    let (s, h) = (r.status().as_u16(), r.headers().clone());
    assert_unauthorized("chat without key", s, &h, &r.json().await.expect("json"));
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .header("authorization", &auth)
        .json(&chat)
        .send()
        .await
        .expect("chat");
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers().get("x-tandem-worker-id").is_none());
    assert!(r.headers().get("x-request-id").is_some());
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["object"], "chat.completion", "{body}");

    // /debug/* is not on the public port, with or without a key.
    let (s, h, b) = get(&format!("{base}/debug/kv_index"), &[]).await;
    assert_unauthorized("public debug without key", s, &h, &b);
    let (s, _, b) = get(
        &format!("{base}/debug/kv_index"),
        &[("authorization", &auth)],
    )
    .await;
    assert_eq!(s, 404, "{b}");
    // The admin listener serves it, behind the same keys.
    let (s, h, b) = get(&format!("{admin}/debug/kv_index"), &[]).await;
    assert_unauthorized("admin without key", s, &h, &b);
    let (s, _, b) = get(&format!("{admin}/debug/kv_index"), &[("x-api-key", KEY2)]).await;
    assert_eq!(s, 200, "{b}");
    assert!(
        b["workers"].is_object() && b["prefill_workers"].is_object(),
        "{b}"
    );
    // The admin listener serves nothing else.
    let (s, _, _) = get(&format!("{admin}/v1/models"), &[("authorization", &auth)]).await;
    assert_eq!(s, 404);

    // /metrics needs the key too, and counts the refusals.
    let (s, h, b) = get(&format!("{base}/metrics"), &[]).await;
    assert_unauthorized("metrics without key", s, &h, &b);
    let (s, _, m) = get(&format!("{base}/metrics"), &[("authorization", &auth)]).await;
    assert_eq!(s, 200);
    let m = m.as_str().expect("metrics text");
    let name = "tandem_router_unauthorized_total";
    let public = r#"listener="public""#;
    // Missing: models, Basic (no bearer token), chat, debug, metrics; invalid: wrong, longer.
    assert_eq!(
        counter(m, name, &[public, r#"reason="missing""#]),
        5.0,
        "{m}"
    );
    assert_eq!(
        counter(m, name, &[public, r#"reason="invalid""#]),
        2.0,
        "{m}"
    );
    assert_eq!(
        counter(m, name, &[r#"listener="admin""#, r#"reason="missing""#]),
        1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_apply_per_api_key() {
    // One request per ten seconds, per key.
    let t = Topology::start_healthy(
        1,
        &[],
        &[
            "--api-key",
            KEY,
            "--api-key",
            KEY2,
            "--rate-limit-requests-per-sec",
            "0.1",
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let post = |key: &'static str| {
        c.post(format!("{}/v1/completions", t.base))
            .header("authorization", bearer(key))
            .json(&json!({"model": "tandem-tiny", "prompt": "Hello", "max_tokens": 1}))
            .send()
    };
    assert_eq!(post(KEY).await.expect("first").status().as_u16(), 200);
    let second = post(KEY).await.expect("second");
    assert_eq!(
        second.status().as_u16(),
        429,
        "the first key is over its rate"
    );
    // The second key has its own bucket: not held back by the first's.
    assert_eq!(post(KEY2).await.expect("other key").status().as_u16(), 200);
    assert_eq!(post(KEY2).await.expect("again").status().as_u16(), 429);
}

/// Runs the router with `args` and `env`, expecting it to exit at start-up: its stderr.
async fn startup_error(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = tokio::process::Command::new(bin("tandem-router"));
    cmd.args([
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--insecure-internal",
    ])
    .args(args)
    .envs(env.iter().copied())
    .env("DYN_DISCOVERY_BACKEND", "file")
    .env("DYN_FILE_KV", temp_dir("unused-disc"))
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{args:?}: the router did not exit"))
        .expect("run the router");
    assert!(!out.status.success(), "{args:?}: the router started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_come_from_the_environment_and_a_file_and_bad_files_stop_the_router() {
    let dir = temp_dir("keys");
    let file = dir.join("keys.txt");
    std::fs::write(&file, "# operators\n\n  sk-from-file  \n# sk-commented\n").expect("write");
    let disc = temp_dir("keys-disc");
    let mut cmd = Command::new(bin("tandem-router"));
    cmd.args([
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--insecure-internal",
    ])
    .arg("--api-key-file")
    .arg(&file)
    .env("TANDEM_API_KEYS", "sk-env-one,sk-env-two")
    .env("DYN_DISCOVERY_BACKEND", "file")
    .env("DYN_FILE_KV", &disc);
    let router = spawn_ready(&mut cmd, "TANDEM_ROUTER_READY");
    let base = format!("http://{}", field(router.ready_line(), "http="));
    let models = format!("{base}/v1/models");
    for key in ["sk-env-one", "sk-env-two", "sk-from-file"] {
        let (s, _, b) = get(&models, &[("authorization", &bearer(key))]).await;
        assert_eq!(s, 200, "{key}: {b}");
    }
    for key in [
        "sk-commented",
        "# sk-commented",
        "sk-env-one,sk-env-two",
        "",
    ] {
        let (s, h, b) = get(&models, &[("authorization", &bearer(key))]).await;
        assert_unauthorized(key, s, &h, &b);
    }
    drop(router);

    let missing = dir.join("missing.txt");
    let e = startup_error(&["--api-key-file", missing.to_str().expect("utf-8")], &[]).await;
    assert!(
        e.contains("missing.txt") && e.contains("cannot read"),
        "{e}"
    );
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "# nothing yet\n\n").expect("write");
    let e = startup_error(&["--api-key-file", empty.to_str().expect("utf-8")], &[]).await;
    assert!(e.contains("empty.txt") && e.contains("no API key"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&disc);
}

/// A client of the HTTPS port trusting only `cert`.
fn tls_connector(cert: &str) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    let der = CertificateDer::from_pem_slice(cert.as_bytes()).expect("cert PEM");
    roots.add(der).expect("root");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

/// One HTTP/1.1 request over TLS (`Connection: close`): the status and the raw response.
async fn https(
    tls: &tokio_rustls::TlsConnector,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, String) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    let mut s = tokio::time::timeout(Duration::from_secs(30), tls.connect(name, tcp))
        .await
        .expect("handshake in time")
        .expect("handshake");
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        req.push_str("content-type: application/json\r\n");
    }
    req.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out))
        .await
        .expect("response in time")
        .expect("read");
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    (status, text)
}

/// Reads what the server sends on `tcp` until it closes: bounded, so a server that keeps a
/// bad connection open fails the test instead of hanging it.
async fn read_until_closed(mut tcp: TcpStream, within: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    let started = Instant::now();
    match tokio::time::timeout(within, tcp.read_to_end(&mut out)).await {
        Ok(_) => out, // EOF or a reset: closed either way.
        Err(_) => panic!("connection still open after {:?}", started.elapsed()),
    }
}

fn write_pem(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write PEM");
    p.to_str().expect("utf-8").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_serves_the_api_and_drops_plain_http_and_silent_clients() {
    let dir = temp_dir("tls");
    let generated = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .expect("self-signed certificate");
    let cert_pem = generated.cert.pem();
    let cert = write_pem(&dir, "cert.pem", &cert_pem);
    let key = write_pem(&dir, "key.pem", &generated.signing_key.serialize_pem());

    let disc = temp_dir("tls-disc");
    let _worker = start_worker(&disc, &[]);
    let router = start_router(
        &disc,
        1,
        &[
            "--tls-cert-path",
            &cert,
            "--tls-key-path",
            &key,
            "--api-key",
            KEY,
            "--http-header-read-timeout-secs",
            "1",
        ],
    );
    assert!(
        router.ready_line().contains("tls=on"),
        "{}",
        router.ready_line()
    );
    let addr = field(router.ready_line(), "http=");
    let tls = tls_connector(&cert_pem);

    // Healthy over HTTPS (bounded wait for the worker).
    let deadline = Instant::now() + common::READY_TIMEOUT;
    while https(&tls, &addr, "GET", "/health", &[], None).await.0 != 200 {
        assert!(Instant::now() < deadline, "router never became healthy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let auth = bearer(KEY);
    let (s, text) = https(&tls, &addr, "GET", "/v1/models", &[], None).await;
    assert_eq!(s, 401, "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{text}"
    );
    let (s, text) = https(
        &tls,
        &addr,
        "GET",
        "/v1/models",
        &[("authorization", &auth)],
        None,
    )
    .await;
    assert_eq!(s, 200, "{text}");
    assert!(text.contains("tandem-tiny"), "{text}");
    let chat = json!({"model": "tandem-tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2});
    let (s, text) = https(
        &tls,
        &addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", &auth)],
        Some(&chat),
    )
    .await;
    assert_eq!(s, 200, "{text}");
    assert!(text.contains("chat.completion"), "{text}");

    // Plain HTTP to the TLS port: the handshake fails, the connection is closed, and no
    // HTTP answer comes back.
    let mut plain = TcpStream::connect(&addr).await.expect("connect");
    plain
        .write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .expect("write");
    let got = read_until_closed(plain, Duration::from_secs(15)).await;
    assert!(
        !got.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    // A client that connects and sends nothing is dropped after the header-read timeout
    // (1 s here), so it cannot hold a connection slot.
    let silent = TcpStream::connect(&addr).await.expect("connect");
    let t0 = Instant::now();
    let got = read_until_closed(silent, Duration::from_secs(15)).await;
    assert!(got.is_empty(), "{got:?}");
    assert!(
        t0.elapsed() >= Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    // A client that does not trust the certificate fails its handshake.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    let stranger = tls_connector(&other.cert.pem());
    let tcp = TcpStream::connect(&addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    assert!(
        stranger.connect(name, tcp).await.is_err(),
        "untrusted certificate accepted"
    );
    // And the server still serves.
    let (s, text) = https(
        &tls,
        &addr,
        "GET",
        "/v1/models",
        &[("x-api-key", KEY)],
        None,
    )
    .await;
    assert_eq!(s, 200, "{text}");

    // Bad TLS settings stop the router with the file named.
    let garbage = write_pem(&dir, "garbage.pem", "not a certificate\n");
    let e = startup_error(&["--tls-cert-path", &garbage, "--tls-key-path", &key], &[]).await;
    assert!(
        e.contains("garbage.pem") && e.contains("--tls-cert-path"),
        "{e}"
    );
    let e = startup_error(&["--tls-cert-path", &cert, "--tls-key-path", &cert], &[]).await;
    assert!(
        e.contains("cert.pem") && e.contains("--tls-key-path"),
        "{e}"
    );
    let e = startup_error(&["--tls-cert-path", &cert], &[]).await;
    assert!(e.contains("--tls-key-path"), "{e}");
    drop(router);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&disc);
}

/// POSTs a greedy completion of `prompt` with `key` (and `cache_salt` when given): the
/// status, and the prompt tokens served from the worker's prefix cache (or the error body).
async fn cached_tokens(t: &Topology, key: &str, salt: Option<&str>) -> (u16, Value) {
    let mut body = json!({
        "model": "tandem-tiny",
        "prompt": (1000..1000 + 96).collect::<Vec<u32>>(),
        "max_tokens": 1,
        "temperature": 0
    });
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", t.base))
        .header("authorization", bearer(key))
        .json(&body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    let body: Value = r.json().await.expect("JSON body");
    if status != 200 {
        return (status, body);
    }
    (
        status,
        body["usage"]["prompt_tokens_details"]["cached_tokens"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_key_has_a_cache_of_its_own_with_cache_salt_per_api_key() {
    let t = Topology::start_healthy(
        1,
        &[],
        &[
            "--api-key",
            KEY,
            "--api-key",
            KEY2,
            "--cache-salt-per-api-key",
        ],
    )
    .await;
    let ok = |n: u64| (200, json!(n));
    assert_eq!(cached_tokens(&t, KEY, None).await, ok(0));
    let (status, hit) = cached_tokens(&t, KEY, None).await;
    assert_eq!(status, 200);
    assert!(
        hit.as_u64().unwrap() >= 64,
        "the same key reuses its prefix: {hit}"
    );
    // The other key sends the same prompt: nothing cached for it, nothing learnt.
    assert_eq!(cached_tokens(&t, KEY2, None).await, ok(0));
    // A request salt splits a key's cache further; the same salt under another key does not
    // reach the first key's blocks.
    assert_eq!(cached_tokens(&t, KEY2, Some("s")).await, ok(0));
    assert_eq!(cached_tokens(&t, KEY2, Some("s")).await.1, hit);
    assert_eq!(cached_tokens(&t, KEY, Some("s")).await, ok(0));
    // An empty salt is refused by name.
    let (status, body) = cached_tokens(&t, KEY, Some("")).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "cache_salt", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_share_cache_entries_only_with_the_same_cache_salt() {
    // No per-key salting: requests of every key share the cache unless they send a salt.
    let t = Topology::start_healthy(1, &[], &["--api-key", KEY, "--api-key", KEY2]).await;
    let (_, unsalted) = cached_tokens(&t, KEY, None).await;
    assert_eq!(unsalted, json!(0));
    let (_, hit) = cached_tokens(&t, KEY2, None).await;
    assert!(
        hit.as_u64().unwrap() >= 64,
        "keys share unsalted blocks: {hit}"
    );
    assert_eq!(cached_tokens(&t, KEY, Some("tenant-a")).await.1, json!(0));
    assert_eq!(cached_tokens(&t, KEY2, Some("tenant-b")).await.1, json!(0));
    assert_eq!(cached_tokens(&t, KEY2, Some("tenant-a")).await.1, hit);
}
