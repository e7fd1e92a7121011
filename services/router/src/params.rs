//! From OpenAI request fields to the engine's sampling parameters, with range checks that
//! name the field.

use tandem_text::limits::{self, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES, MAX_STOP_TOKEN_IDS};
use tandem_text::SamplingParams;

use crate::error::ApiError;
use crate::openai::CommonFields;

fn bad(field: &str, msg: &str) -> ApiError {
    ApiError::bad_request(format!("`{field}` {msg}"), Some(field))
}

/// Largest `n` and `logprobs` accepted (bounded so one request cannot hog a worker). The
/// caps live in `tandem_text::limits`, which the workers enforce again on their gRPC.
pub const MAX_N: i64 = limits::MAX_N as i64;
pub const MAX_LOGPROBS: i64 = limits::MAX_LOGPROBS as i64;

/// The engine's sampling parameters for a request's fields, each checked in the order the
/// groups are listed (the first bad field is the one reported), then as a whole.
pub fn sampling_params(
    mut c: CommonFields,
    logprobs: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    let mut p = SamplingParams::default();
    max_tokens(&c, &mut p)?;
    sampling(&c, &mut p)?;
    stop_strings(&mut c, &mut p)?;
    choices(&c, &mut p)?;
    penalties(&c, &mut p)?;
    stopping(&mut c, &mut p)?;
    beam_search(&c, &mut p)?;
    refuse_sampling_options_with_beams(&p, logprobs)?;
    p.logprobs = logprobs;
    p.validate()
        .map_err(|e| ApiError::bad_request(e.to_string(), Some(e.field())))?;
    Ok(p)
}

/// `max_tokens`: at least 1.
fn max_tokens(c: &CommonFields, p: &mut SamplingParams) -> Result<(), ApiError> {
    if let Some(v) = c.max_tokens {
        if v < 1 {
            return Err(bad("max_tokens", "must be at least 1"));
        }
        p.max_tokens = Some(v as usize);
    }
    Ok(())
}

/// The sampling knobs: `temperature`, `top_p`, `top_k`, `min_p` and `seed`.
fn sampling(c: &CommonFields, p: &mut SamplingParams) -> Result<(), ApiError> {
    if let Some(t) = c.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(bad("temperature", "must be between 0 and 2"));
        }
        p.temperature = t;
    }
    if let Some(v) = c.top_p {
        if !(v > 0.0 && v <= 1.0) {
            return Err(bad("top_p", "must be in (0, 1]"));
        }
        p.top_p = v;
    }
    if let Some(k) = c.top_k {
        // -1 and 0 both mean "off" (vLLM uses -1).
        if k < -1 {
            return Err(bad("top_k", "must be -1, 0 (off) or positive"));
        }
        p.top_k = k.max(0) as usize;
    }
    if let Some(v) = c.min_p {
        if !(0.0..=1.0).contains(&v) {
            return Err(bad("min_p", "must be in [0, 1]"));
        }
        p.min_p = v;
    }
    p.seed = c.seed;
    Ok(())
}

/// `stop`: at most [`MAX_STOP_STRINGS`] strings of at most [`MAX_STOP_STRING_BYTES`] bytes.
fn stop_strings(c: &mut CommonFields, p: &mut SamplingParams) -> Result<(), ApiError> {
    if let Some(stop) = c.stop.take() {
        let stops = stop.into_vec();
        if stops.len() > MAX_STOP_STRINGS {
            return Err(bad(
                "stop",
                &format!("may hold at most {MAX_STOP_STRINGS} strings"),
            ));
        }
        if stops.iter().any(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return Err(bad(
                "stop",
                &format!("strings may be at most {MAX_STOP_STRING_BYTES} bytes long"),
            ));
        }
        p.stop = stops;
    }
    Ok(())
}

/// vLLM's `priority`: an integer in the i32 range, lower served first.
pub fn priority(v: Option<i64>) -> Result<i32, ApiError> {
    v.map_or(Ok(0), |v| {
        i32::try_from(v).map_err(|_| bad("priority", "must be a 32-bit integer"))
    })
}

/// `n`: 1 to [`MAX_N`].
fn choices(c: &CommonFields, p: &mut SamplingParams) -> Result<(), ApiError> {
    if let Some(n) = c.n {
        if !(1..=MAX_N).contains(&n) {
            return Err(bad("n", &format!("must be between 1 and {MAX_N}")));
        }
        p.n = n as usize;
    }
    Ok(())
}

/// `presence_penalty` and `frequency_penalty` (-2 to 2), `repetition_penalty` (> 0).
fn penalties(c: &CommonFields, p: &mut SamplingParams) -> Result<(), ApiError> {
    for (name, v, slot) in [
        (
            "presence_penalty",
            c.presence_penalty,
            &mut p.presence_penalty,
        ),
        (
            "frequency_penalty",
            c.frequency_penalty,
            &mut p.frequency_penalty,
        ),
    ] {
        if let Some(v) = v {
            if !(-2.0..=2.0).contains(&v) {
                return Err(bad(name, "must be between -2 and 2"));
            }
            *slot = v;
        }
    }
    if let Some(v) = c.repetition_penalty {
        if !(v > 0.0 && v.is_finite()) {
            return Err(bad("repetition_penalty", "must be > 0"));
        }
        p.repetition_penalty = v;
    }
    Ok(())
}

/// When a choice may end and what its text shows: `ignore_eos`, `min_tokens` (at most
/// `max_tokens`, checked before), `stop_token_ids` and `skip_special_tokens`.
fn stopping(c: &mut CommonFields, p: &mut SamplingParams) -> Result<(), ApiError> {
    p.ignore_eos = c.ignore_eos.unwrap_or(false);
    if let Some(m) = c.min_tokens {
        if m < 0 {
            return Err(bad("min_tokens", "must be >= 0"));
        }
        if p.max_tokens.is_some_and(|max| m as usize > max) {
            return Err(bad("min_tokens", "must not exceed max_tokens"));
        }
        p.min_tokens = m as usize;
    }
    p.stop_token_ids = c.stop_token_ids.take().unwrap_or_default();
    if p.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(bad(
            "stop_token_ids",
            &format!("may hold at most {MAX_STOP_TOKEN_IDS} ids"),
        ));
    }
    if let Some(s) = c.skip_special_tokens {
        p.skip_special_tokens = s;
    }
    Ok(())
}

/// vLLM's beam search fields: `use_beam_search`, `best_of` (1 to [`MAX_N`], at least `n`,
/// checked before; more than `n` only with beam search), `length_penalty` and
/// `early_stopping`.
fn beam_search(c: &CommonFields, p: &mut SamplingParams) -> Result<(), ApiError> {
    p.use_beam_search = c.use_beam_search.unwrap_or(false);
    if let Some(b) = c.best_of {
        if !(1..=MAX_N).contains(&b) {
            return Err(bad("best_of", &format!("must be between 1 and {MAX_N}")));
        }
        if (b as usize) < p.n {
            return Err(bad("best_of", "must be >= n"));
        }
        if b as usize > p.n && !p.use_beam_search {
            return Err(bad(
                "best_of",
                "> n is only supported with `use_beam_search: true` (sampling best_of is not \
                 implemented)",
            ));
        }
        p.best_of = Some(b as usize);
    }
    if let Some(v) = c.length_penalty {
        if !v.is_finite() {
            return Err(bad("length_penalty", "must be finite"));
        }
        p.length_penalty = v;
    }
    p.early_stopping = c.early_stopping.unwrap_or(false);
    Ok(())
}

/// Beam search is deterministic: the sampling-only options set on `p` (or `logprobs`) are
/// refused with it, naming the field, rather than ignored (see `SamplingParams`).
fn refuse_sampling_options_with_beams(
    p: &SamplingParams,
    logprobs: Option<usize>,
) -> Result<(), ApiError> {
    if !p.use_beam_search {
        return Ok(());
    }
    for (set, field) in [
        (logprobs.is_some(), "logprobs"),
        (!p.stop.is_empty(), "stop"),
        (p.min_tokens > 0, "min_tokens"),
        (p.repetition_penalty != 1.0, "repetition_penalty"),
        (p.presence_penalty != 0.0, "presence_penalty"),
        (p.frequency_penalty != 0.0, "frequency_penalty"),
    ] {
        if set {
            return Err(bad(field, "is not supported with `use_beam_search`"));
        }
    }
    Ok(())
}

/// Chat `logprobs: true` + `top_logprobs: k`.
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top) {
        (false, Some(_)) => Err(bad("top_logprobs", "requires `logprobs: true`")),
        (false, None) => Ok(None),
        (true, None) => Ok(Some(0)),
        (true, Some(k)) if (0..=MAX_LOGPROBS).contains(&k) => Ok(Some(k as usize)),
        (true, Some(_)) => Err(bad(
            "top_logprobs",
            &format!("must be between 0 and {MAX_LOGPROBS}"),
        )),
    }
}

/// Completions `logprobs: k`.
pub fn completion_logprobs(k: Option<i64>) -> Result<Option<usize>, ApiError> {
    match k {
        None => Ok(None),
        Some(k) if (0..=MAX_LOGPROBS).contains(&k) => Ok(Some(k as usize)),
        Some(_) => Err(bad(
            "logprobs",
            &format!("must be between 0 and {MAX_LOGPROBS}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beams(n: i64, best_of: i64) -> CommonFields {
        CommonFields {
            n: Some(n),
            best_of: Some(best_of),
            use_beam_search: Some(true),
            length_penalty: Some(0.5),
            max_tokens: Some(8),
            ..CommonFields::default()
        }
    }

    #[test]
    fn beam_search_fields_pass_through_and_are_checked() {
        let p = sampling_params(beams(2, 4), None).unwrap();
        assert!(p.use_beam_search);
        assert_eq!((p.n, p.best_of, p.beam_width()), (2, Some(4), 4));
        assert_eq!(p.length_penalty, 0.5);
        // best_of > n needs beam search; best_of < n never works.
        let c = CommonFields {
            use_beam_search: None,
            ..beams(2, 4)
        };
        let e = sampling_params(c, None).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("best_of"))
        );
        let e = sampling_params(beams(4, 2), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("best_of"));
        // Sampling-only options are refused with beam search, naming the field.
        let e = sampling_params(beams(2, 4), Some(1)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let c = CommonFields {
            length_penalty: Some(f32::NAN),
            ..beams(2, 4)
        };
        let e = sampling_params(c, None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("length_penalty"));
    }

    fn param_of(c: CommonFields) -> Option<String> {
        let e = sampling_params(c, None).expect_err("refused");
        assert_eq!(e.status.as_u16(), 400, "{}", e.message);
        e.param
    }

    #[test]
    fn unset_fields_keep_the_engine_defaults() {
        let p = sampling_params(CommonFields::default(), None).unwrap();
        assert_eq!(p, SamplingParams::default());
    }

    #[test]
    fn sampling_knobs_are_range_checked() {
        let c = CommonFields {
            temperature: Some(0.5),
            top_p: Some(0.9),
            top_k: Some(-1),
            min_p: Some(0.1),
            seed: Some(3),
            ..CommonFields::default()
        };
        let p = sampling_params(c, None).unwrap();
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.5, 0.9, 0));
        assert_eq!((p.min_p, p.seed), (0.1, Some(3)));
        for (c, field) in [
            (
                CommonFields {
                    temperature: Some(2.5),
                    ..CommonFields::default()
                },
                "temperature",
            ),
            (
                CommonFields {
                    top_p: Some(0.0),
                    ..CommonFields::default()
                },
                "top_p",
            ),
            (
                CommonFields {
                    top_k: Some(-2),
                    ..CommonFields::default()
                },
                "top_k",
            ),
            (
                CommonFields {
                    min_p: Some(1.5),
                    ..CommonFields::default()
                },
                "min_p",
            ),
        ] {
            assert_eq!(param_of(c).as_deref(), Some(field));
        }
    }

    #[test]
    fn stops_choices_and_penalties_are_range_checked() {
        let many = crate::openai::StopField::Many((0..17).map(|i| i.to_string()).collect());
        for (c, field) in [
            (
                CommonFields {
                    stop: Some(many),
                    ..CommonFields::default()
                },
                "stop",
            ),
            (
                CommonFields {
                    n: Some(MAX_N + 1),
                    ..CommonFields::default()
                },
                "n",
            ),
            (
                CommonFields {
                    frequency_penalty: Some(-2.5),
                    ..CommonFields::default()
                },
                "frequency_penalty",
            ),
            (
                CommonFields {
                    repetition_penalty: Some(0.0),
                    ..CommonFields::default()
                },
                "repetition_penalty",
            ),
        ] {
            assert_eq!(param_of(c).as_deref(), Some(field));
        }
    }

    #[test]
    fn min_tokens_may_not_exceed_max_tokens() {
        let c = CommonFields {
            max_tokens: Some(4),
            min_tokens: Some(4),
            ignore_eos: Some(true),
            stop_token_ids: Some(vec![5]),
            skip_special_tokens: Some(false),
            ..CommonFields::default()
        };
        let p = sampling_params(c, None).unwrap();
        assert_eq!((p.max_tokens, p.min_tokens), (Some(4), 4));
        assert!(p.ignore_eos && !p.skip_special_tokens);
        assert_eq!(p.stop_token_ids, vec![5]);
        let c = CommonFields {
            max_tokens: Some(4),
            min_tokens: Some(5),
            ..CommonFields::default()
        };
        let e = sampling_params(c, None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("min_tokens"));
        assert!(e.message.contains("max_tokens"), "{}", e.message);
    }

    #[test]
    fn the_first_bad_field_in_the_group_order_is_reported() {
        // max_tokens, then the sampling knobs, stop, n, penalties, min_tokens, beam search.
        let c = CommonFields {
            max_tokens: Some(0),
            temperature: Some(9.0),
            n: Some(0),
            min_tokens: Some(-1),
            ..CommonFields::default()
        };
        assert_eq!(param_of(c.clone()).as_deref(), Some("max_tokens"));
        let c = CommonFields {
            max_tokens: None,
            ..c
        };
        assert_eq!(param_of(c.clone()).as_deref(), Some("temperature"));
        let c = CommonFields {
            temperature: None,
            presence_penalty: Some(3.0),
            ..c
        };
        assert_eq!(param_of(c.clone()).as_deref(), Some("n"));
        let c = CommonFields { n: None, ..c };
        assert_eq!(param_of(c.clone()).as_deref(), Some("presence_penalty"));
        let c = CommonFields {
            presence_penalty: None,
            ..c
        };
        assert_eq!(param_of(c).as_deref(), Some("min_tokens"));
    }

    #[test]
    fn logprobs_pass_through_unless_beam_searching() {
        let p = sampling_params(CommonFields::default(), Some(3)).unwrap();
        assert_eq!(p.logprobs, Some(3));
        let c = CommonFields {
            stop: Some(crate::openai::StopField::One("x".into())),
            ..beams(2, 4)
        };
        assert_eq!(param_of(c).as_deref(), Some("stop"));
    }
}
