//! Caps on what a client (or a peer over gRPC) controls in one request's sampling parameters.
//! The router enforces them on the OpenAI body and the worker again on its gRPC, through
//! [`crate::SamplingParams::validate`], so a direct gRPC caller cannot skip them.

/// Most choices (`n`), and widest beam search (`best_of`).
pub const MAX_N: usize = 16;
/// Most alternatives per token with `logprobs`.
pub const MAX_LOGPROBS: usize = 20;
/// Most stop strings.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes of UTF-8.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Most `stop_token_ids` (each must also be inside the model's vocabulary, which only the
/// engine knows).
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Most `logit_bias` entries (OpenAI's own cap).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Largest bias magnitude in `logit_bias` (OpenAI's range is [-100, 100]).
pub const MAX_LOGIT_BIAS_VALUE: f32 = 100.0;
/// Largest structured-output constraint (a JSON schema, regex or grammar), in bytes.
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;
/// Most strings of a `choice` constraint.
pub const MAX_CHOICES: usize = 256;
