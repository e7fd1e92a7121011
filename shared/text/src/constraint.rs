//! Structured outputs: the grammar a request's output must follow. The router turns the
//! OpenAI / vLLM / Dynamo fields (`response_format`, `guided_json`, `guided_regex`,
//! `guided_choice`, `guided_grammar`, tool choice) into a [`Constraint`]; the engine compiles it
//! (llguidance) and masks every step's logits with it.

use serde::{Deserialize, Serialize};

use crate::limits;

/// What the output must match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this JSON Schema (the schema's JSON text).
    JsonSchema(String),
    /// A regular expression (Rust `regex` syntax) matching the whole output.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax (which embeds JSON schemas with `%json`).
    Lark(String),
}

/// Why a constraint was refused before compiling it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConstraintError {
    #[error("the {kind} constraint is empty")]
    Empty { kind: &'static str },
    #[error("the {kind} constraint is {got} bytes; at most {max} are allowed")]
    TooLarge {
        kind: &'static str,
        got: usize,
        max: usize,
    },
    #[error("the choice constraint has {got} strings; at most {max} are allowed")]
    TooManyChoices { got: usize, max: usize },
}

impl Constraint {
    /// Its kind, as the API names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "json_object",
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Lark(_) => "grammar",
        }
    }

    /// Size caps and emptiness; whether it compiles is the engine's check.
    pub fn validate(&self) -> Result<(), ConstraintError> {
        let kind = self.kind();
        let bytes = match self {
            Constraint::JsonObject => return Ok(()),
            Constraint::JsonSchema(s) | Constraint::Regex(s) | Constraint::Lark(s) => {
                if s.trim().is_empty() {
                    return Err(ConstraintError::Empty { kind });
                }
                s.len()
            }
            Constraint::Choice(c) => {
                if c.is_empty() {
                    return Err(ConstraintError::Empty { kind });
                }
                if c.len() > limits::MAX_CHOICES {
                    return Err(ConstraintError::TooManyChoices {
                        got: c.len(),
                        max: limits::MAX_CHOICES,
                    });
                }
                c.iter().map(String::len).sum()
            }
        };
        if bytes > limits::MAX_CONSTRAINT_BYTES {
            return Err(ConstraintError::TooLarge {
                kind,
                got: bytes,
                max: limits::MAX_CONSTRAINT_BYTES,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_oversized_constraints_are_refused() {
        assert!(Constraint::JsonObject.validate().is_ok());
        assert!(Constraint::Regex("[a-z]+".into()).validate().is_ok());
        assert_eq!(
            Constraint::Regex(" ".into()).validate(),
            Err(ConstraintError::Empty { kind: "regex" })
        );
        assert_eq!(
            Constraint::Choice(vec![]).validate(),
            Err(ConstraintError::Empty { kind: "choice" })
        );
        let big = "x".repeat(limits::MAX_CONSTRAINT_BYTES + 1);
        assert!(matches!(
            Constraint::Lark(big).validate(),
            Err(ConstraintError::TooLarge {
                kind: "grammar",
                ..
            })
        ));
        let many = vec!["a".to_string(); limits::MAX_CHOICES + 1];
        assert!(matches!(
            Constraint::Choice(many).validate(),
            Err(ConstraintError::TooManyChoices { .. })
        ));
    }
}
