//! The router's OpenAI request bodies and their parameter validation.

use tandem_router::chat::normalize_messages;
use tandem_router::error::ApiError;
use tandem_router::openai::{parse_body, ChatCompletionRequest, CompletionRequest};
use tandem_router::params::{chat_logprobs, completion_logprobs, sampling_params, MAX_N};

/// A refusal must be the client's fault (4xx) and name what is wrong.
fn client_error(e: &ApiError) {
    assert!(
        e.status.is_client_error(),
        "a request body gave {}: {}",
        e.status,
        e.message
    );
    assert!(!e.message.is_empty());
}

/// One body, parsed as both a chat and a completion request; what parses goes through the
/// same checks as in the handlers (messages, logprobs, sampling parameters).
pub fn openai_request(data: &[u8]) {
    match parse_body::<ChatCompletionRequest>(data) {
        Ok(req) => {
            if let Err(e) = normalize_messages(&req.messages) {
                client_error(&e);
            }
            match chat_logprobs(req.logprobs, req.top_logprobs) {
                Ok(lp) => checked_params(req.common(), lp),
                Err(e) => client_error(&e),
            }
        }
        Err(e) => client_error(&e),
    }
    match parse_body::<CompletionRequest>(data) {
        Ok(req) => match completion_logprobs(req.logprobs) {
            Ok(lp) => checked_params(req.common(), lp),
            Err(e) => client_error(&e),
        },
        Err(e) => client_error(&e),
    }
}

fn checked_params(common: tandem_router::openai::CommonFields, lp: Option<usize>) {
    match sampling_params(common, lp) {
        Ok(p) => {
            // What the router accepts, the engine's own validation accepts too.
            assert_eq!(p.validate(), Ok(()), "{p:?}");
            assert!(p.n >= 1 && p.n as i64 <= MAX_N, "{p:?}");
            assert!(p.max_tokens != Some(0), "{p:?}");
        }
        Err(e) => client_error(&e),
    }
}
