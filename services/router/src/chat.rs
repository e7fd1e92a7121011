//! Turning chat messages into a prompt with the model's chat template.

use serde_json::Value;

use crate::error::ApiError;
use crate::models::ModelAssets;
use crate::openai::ChatCompletionRequest;

/// Validates `messages` and flattens text-only content parts into strings.
pub fn normalize_messages(messages: &Value) -> Result<Value, ApiError> {
    let list = messages
        .as_array()
        .ok_or_else(|| ApiError::bad_request("`messages` must be an array", Some("messages")))?;
    if list.is_empty() {
        return Err(ApiError::bad_request(
            "`messages` must not be empty",
            Some("messages"),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, msg) in list.iter().enumerate() {
        let param = format!("messages[{i}]");
        let obj = msg.as_object().ok_or_else(|| {
            ApiError::bad_request(format!("`{param}` must be an object"), Some(&param))
        })?;
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_request(format!("`{param}.role` must be a string"), Some(&param))
        })?;
        if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::bad_request(
                format!("`{param}.role` {role:?} is not a known role"),
                Some(&param),
            ));
        }
        let mut obj = obj.clone();
        if role == "assistant" {
            template_tool_calls(&mut obj);
        }
        match obj.get("content") {
            // An assistant turn that only called tools: templates read its content as text.
            None | Some(Value::Null) if role == "assistant" => {
                obj.insert("content".into(), Value::String(String::new()));
            }
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                let content = content_parts(&param, parts)?;
                obj.insert("content".into(), content);
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    format!("`{param}.content` must be a string or an array of parts"),
                    Some(&param),
                ))
            }
        }
        out.push(Value::Object(obj));
    }
    Ok(Value::Array(out))
}

/// An assistant turn's tool calls as chat templates expect them (vLLM's convention): each
/// call's `function.arguments` JSON text parsed into its value, so templates that print
/// `arguments | tojson` and those that print a string both render it once.
fn template_tool_calls(msg: &mut serde_json::Map<String, Value>) {
    let Some(Value::Array(calls)) = msg.get_mut("tool_calls") else {
        return;
    };
    for call in calls {
        if let Some(args) = call.pointer_mut("/function/arguments") {
            if let Some(v) = args
                .as_str()
                .and_then(|s| serde_json::from_str::<Value>(s).ok())
            {
                *args = v;
            }
        }
    }
}

/// A message's content parts for the template: text parts joined into one string when there
/// is no image; else the parts in order, each `image_url` as `{"type": "image"}` (the chat
/// templates of multimodal models place one image token there). Whether the model takes
/// images is checked before (`prepare::chat_images`).
fn content_parts(param: &str, parts: &[Value]) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut out = Vec::with_capacity(parts.len());
    let mut images = false;
    for (j, part) in parts.iter().enumerate() {
        match part.get("type").and_then(Value::as_str) {
            Some("text") => {
                let t = part.get("text").and_then(Value::as_str).unwrap_or_default();
                text.push_str(t);
                out.push(serde_json::json!({"type": "text", "text": t}));
            }
            Some("image_url") => {
                images = true;
                out.push(serde_json::json!({"type": "image"}));
            }
            other => {
                let param = format!("{param}.content[{j}]");
                return Err(ApiError::bad_request(
                    format!(
                        "`{param}` of type {:?} is not supported (text and image_url are)",
                        other.unwrap_or("?")
                    ),
                    Some(&param),
                ));
            }
        }
    }
    Ok(match images {
        true => Value::Array(out),
        false => Value::String(text),
    })
}

/// Renders and tokenizes a chat request.
pub fn chat_prompt(
    assets: &ModelAssets,
    req: &ChatCompletionRequest,
) -> Result<Vec<u32>, ApiError> {
    let template = assets.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no chat template; use /v1/completions", None)
    })?;
    let messages = normalize_messages(&req.messages)?;
    if let Some(kw) = &req.chat_template_kwargs {
        if !kw.is_object() {
            return Err(ApiError::bad_request(
                "`chat_template_kwargs` must be an object",
                Some("chat_template_kwargs"),
            ));
        }
    }
    let tools = match (&req.tools, &req.tool_choice) {
        (_, Some(Value::String(s))) if s == "none" => None,
        (Some(t), _) if !t.is_array() => {
            return Err(ApiError::bad_request(
                "`tools` must be an array",
                Some("tools"),
            ))
        }
        (t, _) => t.as_ref(),
    };
    let rendered = template
        .render(&tandem_text::ChatRequest {
            messages: &messages,
            tools,
            add_generation_prompt: true,
            extra: req.chat_template_kwargs.as_ref(),
        })
        .map_err(|e| {
            ApiError::bad_request(
                format!("the chat template failed on these messages: {e}"),
                Some("messages"),
            )
        })?;
    assets.tokenizer.encode(&rendered, false).map_err(|e| {
        ApiError::bad_request(format!("cannot tokenize the prompt: {e}"), Some("messages"))
    })
}
