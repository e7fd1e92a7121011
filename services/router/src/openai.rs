//! The OpenAI request bodies the router accepts. Unknown fields are refused by name (400)
//! rather than silently dropped; fields that exist in the API but not in Tandem yet are
//! refused with a message saying so.

use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
    /// vLLM's extra parameters for beam search (width `best_of`, or `n`).
    pub best_of: Option<i64>,
    pub use_beam_search: Option<bool>,
    pub length_penalty: Option<f32>,
    pub early_stopping: Option<bool>,
    /// OpenAI's `logit_bias`: token id (as a string) to a bias in [-100, 100].
    pub logit_bias: Option<LogitBias>,
    #[serde(skip)]
    pub guided: Guided,
}

pub type LogitBias = std::collections::BTreeMap<String, f32>;

/// The structured-output fields: OpenAI's `response_format`, vLLM's `guided_*` and Dynamo's
/// `nvext.guided_*` (at most one of them per request).
#[derive(Debug, Clone, Default)]
pub struct Guided {
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub nvext: Option<NvExt>,
}

/// Dynamo's `nvext` extension object: the guided-decoding fields and the direct-routing target.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvExt {
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// Only llguidance is built in; other names are refused.
    pub guided_decoding_backend: Option<String>,
    /// `--router-mode direct`: the worker (instance id) to send the request to.
    pub backend_instance_id: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Value,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub chat_template_kwargs: Option<Value>,
    /// Recorded in the logs with the request id.
    pub user: Option<String>,
    /// vLLM's queue priority: lower is served first (default 0).
    pub priority: Option<i64>,
    /// vLLM's prefix-cache salt: the request shares cached KV only with requests of the same
    /// salt (and, with `--cache-salt-per-api-key`, the same API key).
    pub cache_salt: Option<String>,
    // Flattened fields cannot be combined with deny_unknown_fields in serde, so they are
    // listed here again.
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
    /// vLLM's extra parameters for beam search (width `best_of`, or `n`).
    /// Beam width (vLLM accepts it on chat too).
    pub best_of: Option<i64>,
    pub use_beam_search: Option<bool>,
    pub length_penalty: Option<f32>,
    pub early_stopping: Option<bool>,
    pub logit_bias: Option<LogitBias>,
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub nvext: Option<NvExt>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Batch(Vec<Value>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: PromptField,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    pub user: Option<String>,
    /// vLLM's queue priority: lower is served first (default 0).
    pub priority: Option<i64>,
    /// vLLM's prefix-cache salt (see the chat request's).
    pub cache_salt: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
    /// vLLM's extra parameters for beam search (width `best_of`, or `n`).
    pub use_beam_search: Option<bool>,
    pub length_penalty: Option<f32>,
    pub early_stopping: Option<bool>,
    pub logit_bias: Option<LogitBias>,
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub nvext: Option<NvExt>,
}

macro_rules! common_of {
    ($r:expr) => {
        CommonFields {
            max_tokens: $r.max_tokens,
            temperature: $r.temperature,
            top_p: $r.top_p,
            top_k: $r.top_k,
            min_p: $r.min_p,
            seed: $r.seed,
            stop: $r.stop.clone(),
            n: $r.n,
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
            repetition_penalty: $r.repetition_penalty,
            ignore_eos: $r.ignore_eos,
            min_tokens: $r.min_tokens,
            stop_token_ids: $r.stop_token_ids.clone(),
            skip_special_tokens: $r.skip_special_tokens,
            use_beam_search: $r.use_beam_search,
            best_of: $r.best_of,
            length_penalty: $r.length_penalty,
            early_stopping: $r.early_stopping,
            logit_bias: $r.logit_bias.clone(),
            guided: Guided {
                response_format: $r.response_format.clone(),
                guided_json: $r.guided_json.clone(),
                guided_regex: $r.guided_regex.clone(),
                guided_choice: $r.guided_choice.clone(),
                guided_grammar: $r.guided_grammar.clone(),
                nvext: $r.nvext.clone(),
            },
        }
    };
}

impl ChatCompletionRequest {
    pub fn common(&self) -> CommonFields {
        let mut c = common_of!(self);
        if self.max_completion_tokens.is_some() {
            c.max_tokens = self.max_completion_tokens;
        }
        c
    }
}

impl CompletionRequest {
    pub fn common(&self) -> CommonFields {
        common_of!(self)
    }
}

/// Parses a JSON body into `T`, turning every failure into a 400 that names the field.
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        if let Some(rest) = msg.strip_prefix("unknown field `") {
            let field = rest.split('`').next().unwrap_or_default();
            return ApiError::bad_request(
                format!("unsupported field `{field}`: Tandem does not support it (yet)"),
                Some(field),
            );
        }
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::bad_request(format!("malformed JSON body: {msg}"), None);
        }
        let param = (path != ".").then_some(path.as_str());
        match param {
            Some(p) => ApiError::bad_request(format!("invalid value for `{p}`: {msg}"), Some(p)),
            None => ApiError::bad_request(format!("invalid request body: {msg}"), None),
        }
    })
}
