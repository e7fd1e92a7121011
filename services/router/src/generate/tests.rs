//! Unit tests of the request stages that need no worker: validation and the stream stage's
//! bookkeeping of text, usage and finished choices.

use tandem_protocol::worker::Usage;

use super::*;

/// A word-level tokenizer of two words, `a` (id 0) and `b` (id 1).
pub(crate) fn assets() -> ModelAssets {
    let dir = std::env::temp_dir().join(format!("tandem-router-generate-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("tokenizer.json"),
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
           "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
           "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"b":1,"<unk>":2},
           "unk_token":"<unk>"}}"#,
    )
    .expect("write");
    let tokenizer = tandem_text::Tokenizer::load(&dir).expect("tokenizer");
    let _ = std::fs::remove_dir_all(&dir);
    ModelAssets {
        tokenizer,
        template: None,
        hash: "h".into(),
    }
}

fn output(index: u32, token_ids: Vec<u32>, finish_reason: &str) -> GenerateOutput {
    use tandem_protocol::worker::FinishReason as F;
    let finish = match finish_reason {
        "" => F::Unspecified,
        "stop" => F::Stop,
        "length" => F::Length,
        other => panic!("no finish reason {other:?} in these tests"),
    };
    GenerateOutput {
        index,
        token_ids,
        finish_reason: finish.into(),
        ..Default::default()
    }
}

#[test]
fn the_prompt_and_max_tokens_must_fit_the_context() {
    assert!(check_fits(10, Some(6), 16).is_ok());
    // An unset max_tokens counts as one token.
    assert!(check_fits(15, None, 16).is_ok());
    let e = check_fits(16, None, 16).expect_err("too long");
    assert_eq!(
        (e.status.as_u16(), e.param.as_deref()),
        (400, Some("messages"))
    );
    assert_eq!(
        e.message,
        "the prompt (16 tokens) plus max_tokens (1) exceeds the model's context length of 16 \
         tokens"
    );
    let e = check_fits(10, Some(7), 16).expect_err("too long");
    assert!(e.message.contains("max_tokens (7)"), "{}", e.message);
    let e = check_fits(0, Some(1), 16).expect_err("empty");
    assert_eq!(
        (e.status.as_u16(), e.param.as_deref()),
        (400, Some("prompt"))
    );
}

#[test]
fn no_decode_worker_says_whether_prefill_workers_serve_the_model() {
    let e = no_decode_worker("m", true);
    assert_eq!(e.status.as_u16(), 503);
    assert_eq!(
        e.message,
        "no decode worker serves `m`: only prefill workers do"
    );
    let e = no_decode_worker("m", false);
    assert_eq!(
        e.message,
        "no decode worker serves `m`: no worker serves it"
    );
}

#[test]
fn progress_sums_usage_and_counts_finished_choices() {
    let a = assets();
    let params = SamplingParams {
        n: 2,
        ..Default::default()
    };
    let mut p = Progress::new(&params, 7, false);
    let mut out = output(0, vec![0], "");
    out.usage = Some(Usage {
        prompt_tokens: 7,
        completion_tokens: 1,
        cached_tokens: 4,
    });
    let d = p.delta(&out, &a);
    assert_eq!((d.index, d.finish_reason.as_deref()), (0, None));
    assert!(d.logprobs.is_empty());
    assert_eq!(p.finished, 0);
    let mut out = output(1, vec![1], "length");
    out.usage = Some(Usage {
        prompt_tokens: 7,
        completion_tokens: 2,
        cached_tokens: 2,
    });
    let d = p.delta(&out, &a);
    assert_eq!((d.index, d.finish_reason.as_deref()), (1, Some("length")));
    assert_eq!(d.text, "b");
    assert_eq!(p.finished, 1);
    // Completion tokens add up; cached tokens are the largest seen.
    assert_eq!(
        (
            p.usage.prompt_tokens,
            p.usage.completion_tokens,
            p.usage.cached_tokens
        ),
        (7, 3, 4)
    );
    p.delta(&output(0, vec![], "stop"), &a);
    assert_eq!(p.finished, p.n);
}

#[test]
fn a_choice_holds_back_its_stop_string_and_says_nothing_after_it() {
    let a = assets();
    let params = SamplingParams {
        n: 2,
        stop: vec!["b".into()],
        ..Default::default()
    };
    let mut p = Progress::new(&params, 3, false);
    let d = p.delta(&output(0, vec![0, 1, 0], ""), &a);
    assert!(d.text.starts_with('a'), "{:?}", d.text);
    assert!(!d.text.contains('b'), "{:?}", d.text);
    let d = p.delta(&output(0, vec![0], "stop"), &a);
    assert_eq!(
        (d.text.as_str(), d.finish_reason.as_deref()),
        ("", Some("stop"))
    );
    // Each choice has its own detokenizer and stop matcher.
    let d = p.delta(&output(1, vec![0], "length"), &a);
    assert_eq!(d.text, "a");
}

#[test]
fn a_migrating_request_keeps_its_output_and_counts_it_once() {
    let a = assets();
    let one = SamplingParams::default();
    assert!(
        Progress::new(&one, 3, false).output.is_none(),
        "migration off"
    );
    let two = SamplingParams {
        n: 2,
        ..Default::default()
    };
    assert!(
        Progress::new(&two, 3, true).output.is_none(),
        "n = 2 does not migrate"
    );
    let mut p = Progress::new(&one, 3, true);
    p.delta(&output(0, vec![0, 1], ""), &a);
    p.timing.prefill_pending = false;
    // The stream broke after two tokens; the next worker reports only its own one.
    p.begin_attempt();
    assert!(
        p.timing.prefill_pending,
        "the new worker's prefill is load again"
    );
    let mut last = output(0, vec![0], "length");
    last.usage = Some(Usage {
        prompt_tokens: 5,
        completion_tokens: 1,
        cached_tokens: 0,
    });
    let d = p.delta(&last, &a);
    assert_eq!(p.output.as_deref(), Some(&[0, 1, 0][..]));
    assert_eq!((p.usage.prompt_tokens, p.usage.completion_tokens), (3, 3));
    assert_eq!(d.finish_reason.as_deref(), Some("length"));
}

#[test]
fn broken_streams_are_the_transport_failures() {
    use tonic::Code::*;
    for code in [Unknown, Unavailable, Cancelled, Aborted] {
        assert!(broken_stream(code), "{code:?}");
    }
    for code in [
        InvalidArgument,
        ResourceExhausted,
        DeadlineExceeded,
        Internal,
    ] {
        assert!(!broken_stream(code), "{code:?}");
    }
}
