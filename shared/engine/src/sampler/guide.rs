//! Structured outputs: a request's [`Constraint`] compiled by llguidance over the model's
//! tokenizer into a per-sequence [`Guide`], which masks each step's logits to the tokens that
//! keep the output inside the grammar and follows the tokens sampled.
//!
//! The token table (every token's bytes in a trie) is built once per engine, on the first
//! constrained request. A guide is a function of the constraint and the tokens generated so
//! far, so a sequence continued on another engine (disaggregation, migration) rebuilds it by
//! replaying its output: nothing of llguidance's state travels.
//!
//! JSON is generated compact (no free whitespace between tokens): the grammar then leaves the
//! model no way to spend its budget on spaces, and even a random model closes its objects.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use tandem_text::{Constraint, Tokenizer};

/// Why a constraint could not be compiled or followed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GuideError {
    #[error("structured outputs need the model's tokenizer, and this engine has none")]
    NoTokenizer,
    #[error("cannot build the structured-output token table from the tokenizer: {0}")]
    TokenTable(String),
    #[error("the json_schema is not valid JSON: {0}")]
    SchemaNotJson(String),
    #[error("the {kind} constraint does not compile: {reason}")]
    Compile { kind: &'static str, reason: String },
    /// The grammar refused a token or could not compute a mask (llguidance's reason).
    #[error("the structured-output grammar failed: {0}")]
    Matcher(String),
}

impl GuideError {
    /// The request's own fault (a constraint that does not compile), not the engine's.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            GuideError::SchemaNotJson(_) | GuideError::Compile { .. }
        )
    }
}

/// Compiles constraints for one engine: its tokenizer, vocabulary and EOS ids, and the token
/// table built on first use.
pub struct Guides {
    tokenizer: Option<Arc<Tokenizer>>,
    vocab: usize,
    eos: Vec<u32>,
    factory: OnceLock<Result<Arc<ParserFactory>, GuideError>>,
}

impl Guides {
    pub fn new(tokenizer: Option<Arc<Tokenizer>>, vocab: usize, eos: Vec<u32>) -> Self {
        Self {
            tokenizer,
            vocab,
            eos,
            factory: OnceLock::new(),
        }
    }

    /// A guide at the start of the output.
    pub fn compile(&self, c: &Constraint) -> Result<Guide, GuideError> {
        let factory = self.factory()?;
        let grammar = grammar_of(c)?;
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| GuideError::Compile {
                kind: c.kind(),
                reason: e.to_string(),
            })?;
        let mut guide = Guide {
            matcher: Matcher::new(Ok(parser)),
            mask: None,
        };
        // A grammar whose first mask fails (an unsatisfiable schema) is refused up front.
        guide.prepare();
        match guide.mask.as_ref() {
            Some(Err(e)) => Err(GuideError::Compile {
                kind: c.kind(),
                reason: e.to_string(),
            }),
            _ => Ok(guide),
        }
    }

    fn factory(&self) -> Result<&Arc<ParserFactory>, GuideError> {
        self.factory
            .get_or_init(|| self.build_factory())
            .as_ref()
            .map_err(Clone::clone)
    }

    fn build_factory(&self) -> Result<Arc<ParserFactory>, GuideError> {
        let tokenizer = self.tokenizer.clone().ok_or(GuideError::NoTokenizer)?;
        let started = Instant::now();
        let env = TokenEnv::new(tokenizer, self.vocab, &self.eos)?;
        let env: llguidance::toktrie::TokEnv = Arc::new(env);
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GuideError::TokenTable(e.to_string()))?;
        factory.quiet();
        tracing::info!(
            vocab = self.vocab,
            ms = started.elapsed().as_millis() as u64,
            "structured-output token table built"
        );
        Ok(Arc::new(factory))
    }
}

/// The llguidance grammar of a constraint. JSON is compact: no whitespace between tokens.
fn grammar_of(c: &Constraint) -> Result<TopLevelGrammar, GuideError> {
    Ok(match c {
        Constraint::JsonObject => {
            TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
        }
        Constraint::JsonSchema(s) => {
            let schema: serde_json::Value =
                serde_json::from_str(s).map_err(|e| GuideError::SchemaNotJson(e.to_string()))?;
            TopLevelGrammar::from_json_schema(compact(schema))
        }
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Choice(choices) => {
            let alternatives: Vec<String> =
                choices.iter().map(|c| regex_syntax::escape(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
        }
        Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
    })
}

/// The schema with llguidance's compact-JSON options, unless it sets its own.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// One sequence's position in its grammar.
pub struct Guide {
    matcher: Matcher,
    /// The mask for the next token, when computed ahead (see [`Guide::prepare`]).
    mask: Option<Result<SimpleVob, GuideError>>,
}

impl Guide {
    /// An independent copy (another choice of the same request).
    pub fn fork(&self) -> Guide {
        Guide {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
        }
    }

    /// Follows tokens generated earlier (a continued or replayed sequence).
    pub fn replay(&mut self, tokens: &[u32]) -> Result<(), GuideError> {
        for &t in tokens {
            self.advance(t)?;
        }
        Ok(())
    }

    /// Computes the next token's mask now (the engine does it while the step's forward pass
    /// runs, so sampling finds it ready).
    pub fn prepare(&mut self) {
        if self.mask.is_none() {
            let matcher = &mut self.matcher;
            let mask = catch_unwind(AssertUnwindSafe(|| matcher.compute_mask_or_eos()))
                .map_err(|_| GuideError::Matcher("computing the mask panicked".into()))
                .and_then(|m| m.map_err(|e| GuideError::Matcher(e.to_string())));
            self.mask = Some(mask);
        }
    }

    /// Sets every token the grammar does not allow next to -inf.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<(), GuideError> {
        self.prepare();
        let mask = match self.mask.as_ref() {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(e.clone()),
            None => unreachable!("prepare sets the mask"),
        };
        apply_mask(mask, logits);
        Ok(())
    }

    /// The next token's mask as `words` bitmask words (bit `t % 32` of word `t / 32`: token
    /// `t` allowed; tokens past the grammar's vocabulary are not), for a device sampler.
    pub fn mask_words(&mut self, words: usize) -> Result<Vec<u32>, GuideError> {
        self.prepare();
        match self.mask.as_ref() {
            Some(Ok(m)) => {
                let mut w = m.as_slice().to_vec();
                w.resize(words, 0);
                Ok(w)
            }
            Some(Err(e)) => Err(e.clone()),
            None => unreachable!("prepare sets the mask"),
        }
    }

    /// Whether computing the next token's mask failed (the request then fails with it).
    pub fn has_failed(&self) -> bool {
        matches!(self.mask, Some(Err(_)))
    }

    /// Why computing the next token's mask failed, if it did.
    pub fn failure(&self) -> Option<GuideError> {
        match &self.mask {
            Some(Err(e)) => Some(e.clone()),
            _ => None,
        }
    }

    /// Follows the sampled token.
    pub fn advance(&mut self, token: u32) -> Result<(), GuideError> {
        self.mask = None;
        if self.matcher.is_stopped() {
            // The grammar is complete: its mask allowed only EOS, which ends the sequence.
            return Ok(());
        }
        self.matcher
            .consume_token(token as TokenId)
            .map_err(|e| GuideError::Matcher(e.to_string()))
    }
}

/// -inf for every token whose bit is clear (and for logits past the mask).
fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    let words = mask.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        if bits == 0 {
            // Most of a grammar's mask: whole words of forbidden tokens.
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        for (j, l) in chunk.iter_mut().enumerate() {
            if bits & (1 << j) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// llguidance's view of the model's tokenizer: every token's bytes in a trie, and
/// tokenization through our own `tokenizers` instance.
struct TokenEnv {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl TokenEnv {
    fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eos: &[u32]) -> Result<Self, GuideError> {
        let table = |e: String| GuideError::TokenTable(e);
        let json: serde_json::Value = serde_json::from_str(
            &tokenizer
                .inner()
                .to_string(false)
                .map_err(|e| table(e.to_string()))?,
        )
        .map_err(|e| table(e.to_string()))?;
        // The conversion asserts on vocabularies it does not expect: a model file's fault,
        // reported as an error rather than a panic of the engine thread.
        let mut words = catch_unwind(AssertUnwindSafe(|| {
            llguidance::token_bytes_from_tokenizer_json(&json)
        }))
        .map_err(|_| table("unexpected vocabulary entries".into()))?
        .map_err(|e| table(e.to_string()))?;
        if words.len() > vocab {
            return Err(table(format!(
                "the tokenizer has {} tokens, more than the model's vocabulary of {vocab}",
                words.len()
            )));
        }
        words.resize(vocab, Vec::new());
        for (id, w) in words.iter_mut().enumerate() {
            if w.is_empty() {
                // Ids the tokenizer does not name: special tokens nothing can produce.
                *w = format!("\u{0}<[{id}]>").into_bytes();
                w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            }
        }
        let first_eos = *eos
            .first()
            .ok_or_else(|| table("the model has no EOS token".into()))?;
        if let Some(bad) = eos.iter().find(|&&t| t as usize >= vocab) {
            return Err(table(format!("EOS token {bad} is outside the vocabulary")));
        }
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        Ok(Self { tokenizer, trie })
    }
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            // The greedy fallback covers what the tokenizer refuses.
            self.tokenizer.encode(s, false).unwrap_or_default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_clears_disallowed_tokens_and_the_tail() {
        let mut m = SimpleVob::alloc(40);
        m.allow_token(1);
        m.allow_token(33);
        let mut logits = vec![1.0f32; 70];
        apply_mask(&m, &mut logits);
        let allowed: Vec<usize> = (0..70).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(allowed, vec![1, 33]);
    }

    #[test]
    fn choices_are_escaped_and_schemas_made_compact() {
        let s = compact(serde_json::json!({"type": "object"}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        let own = compact(serde_json::json!({"x-guidance": {"whitespace_flexible": true}}));
        assert_eq!(own["x-guidance"]["whitespace_flexible"], true);
        assert!(matches!(
            grammar_of(&Constraint::JsonSchema("{not json".into())),
            Err(GuideError::SchemaNotJson(_))
        ));
        assert!(grammar_of(&Constraint::Choice(vec!["a.b".into(), "(c)".into()])).is_ok());
    }

    #[test]
    fn without_a_tokenizer_constraints_are_refused() {
        let g = Guides::new(None, 100, vec![1]);
        assert!(matches!(
            g.compile(&Constraint::JsonObject),
            Err(GuideError::NoTokenizer)
        ));
    }
}
