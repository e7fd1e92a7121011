//! Log-probabilities as the engine reports them and the API returns them.

use serde::{Deserialize, Serialize};

/// The chosen token's log-probability and the top alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, most likely first: `(token, logprob)`.
    pub top: Vec<(u32, f32)>,
}
