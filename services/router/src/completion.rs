//! The prompt side of `/v1/completions`: a batch of prompts split into single prompts, the
//! fill-in-the-middle prompt a `suffix` asks for (where the model's tokenizer has FIM tokens),
//! and the prompt text `echo` returns.

use serde_json::Value;

use crate::error::ApiError;
use crate::limits::MAX_BATCH_PROMPTS;
use crate::models::ModelView;
use crate::openai::PromptField;

/// The FIM tokens of the Qwen / StarCoder families: prefix, suffix, middle.
const FIM: [&str; 3] = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];

fn bad(msg: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(msg.into(), Some(param))
}

/// The single prompts of `prompt` (a string, token ids, or a batch of either), each wrapped
/// for fill-in-the-middle when `suffix` is set.
pub fn prompts(
    view: &ModelView,
    prompt: PromptField,
    suffix: Option<&str>,
) -> Result<Vec<PromptField>, ApiError> {
    let singles = match prompt {
        PromptField::Batch(items) => batch(items)?,
        single => vec![single],
    };
    match suffix.filter(|s| !s.is_empty()) {
        None => Ok(singles),
        Some(suffix) => singles
            .into_iter()
            .map(|p| fill_in_the_middle(view, p, suffix))
            .collect(),
    }
}

/// A batch's items: strings or lists of token ids, at least one, at most
/// [`MAX_BATCH_PROMPTS`].
fn batch(items: Vec<Value>) -> Result<Vec<PromptField>, ApiError> {
    if items.is_empty() {
        return Err(bad("`prompt` is an empty list", "prompt"));
    }
    if items.len() > MAX_BATCH_PROMPTS {
        return Err(bad(
            format!(
                "`prompt` holds {} prompts; at most {MAX_BATCH_PROMPTS} are accepted per request",
                items.len()
            ),
            "prompt",
        ));
    }
    items
        .into_iter()
        .enumerate()
        .map(
            |(i, item)| match serde_json::from_value::<PromptField>(item) {
                Ok(PromptField::Batch(_)) | Err(_) => Err(bad(
                    format!("`prompt[{i}]` must be a string or a list of token ids"),
                    "prompt",
                )),
                Ok(p) => Ok(p),
            },
        )
        .collect()
}

/// `<|fim_prefix|>{prompt}<|fim_suffix|>{suffix}<|fim_middle|>`, when the tokenizer has
/// those tokens; a clear 400 otherwise.
fn fill_in_the_middle(
    view: &ModelView,
    prompt: PromptField,
    suffix: &str,
) -> Result<PromptField, ApiError> {
    let tk = &view.assets.tokenizer;
    if FIM.iter().any(|t| tk.token_to_id(t).is_none()) {
        return Err(bad(
            format!(
                "`suffix` needs fill-in-the-middle tokens ({}), which model `{}`'s tokenizer \
                 does not have",
                FIM.join(", "),
                view.name
            ),
            "suffix",
        ));
    }
    let PromptField::Text(prefix) = prompt else {
        return Err(bad("`suffix` needs a text prompt, not token ids", "suffix"));
    };
    Ok(PromptField::Text(format!(
        "{}{prefix}{}{suffix}{}",
        FIM[0], FIM[1], FIM[2]
    )))
}

/// The prompt as `echo` returns it: the text as sent, or the token ids decoded.
pub fn echo_text(view: &ModelView, prompt: &PromptField, ids: &[u32]) -> String {
    match prompt {
        PromptField::Text(t) => t.clone(),
        _ => view.assets.tokenizer.decode(ids, false).unwrap_or_default(),
    }
}
