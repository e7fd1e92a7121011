//! Reasoning split from content: `<think>` ... `</think>` (`--dyn-reasoning-parser` qwen3,
//! basic, deepseek_r1). DeepSeek-R1's template opens the block in the prompt, so its output
//! starts inside it; Qwen3's model opens it itself. Streaming-safe: a tag split across two
//! deltas is held back until it is whole.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// The reasoning formats built in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// The output may open a `<think>` block itself (qwen3, basic).
    Think,
    /// The output starts inside the block (deepseek_r1).
    StartsThinking,
}

impl ReasoningFormat {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "qwen3" | "basic" => Some(ReasoningFormat::Think),
            "deepseek_r1" => Some(ReasoningFormat::StartsThinking),
            _ => None,
        }
    }
}

/// One choice's position in its output: inside the reasoning block or not, and the text held
/// back because it may be the start of a tag.
#[derive(Debug)]
pub struct ThinkSplitter {
    thinking: bool,
    /// Whether a block was opened and closed already (only one is split out).
    closed: bool,
    /// Content right after `</think>` drops its leading newlines.
    trim_content: bool,
    held: String,
}

impl ThinkSplitter {
    pub fn new(format: ReasoningFormat) -> Self {
        Self {
            thinking: format == ReasoningFormat::StartsThinking,
            closed: false,
            trim_content: false,
            held: String::new(),
        }
    }

    /// Splits new text into (content, reasoning).
    pub fn push(&mut self, text: &str) -> (String, String) {
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);
        let (mut content, mut reasoning) = (String::new(), String::new());
        loop {
            if self.thinking {
                // A model that opens the block although the prompt did: drop the tag.
                if reasoning.is_empty() && buf.trim_start().starts_with(OPEN) {
                    buf = buf.trim_start()[OPEN.len()..].to_string();
                }
                match buf.find(CLOSE) {
                    Some(i) => {
                        reasoning.push_str(&buf[..i]);
                        buf = buf[i + CLOSE.len()..].to_string();
                        self.thinking = false;
                        self.closed = true;
                        self.trim_content = true;
                    }
                    None => {
                        let keep = partial_tag(&buf, CLOSE);
                        reasoning.push_str(&buf[..buf.len() - keep]);
                        self.held = buf[buf.len() - keep..].to_string();
                        break;
                    }
                }
            } else {
                let open = (!self.closed).then(|| buf.find(OPEN)).flatten();
                match open {
                    Some(i) => {
                        self.push_content(&mut content, &buf[..i]);
                        buf = buf[i + OPEN.len()..].to_string();
                        self.thinking = true;
                    }
                    None => {
                        let keep = if self.closed {
                            0
                        } else {
                            partial_tag(&buf, OPEN)
                        };
                        self.push_content(&mut content, &buf[..buf.len() - keep]);
                        self.held = buf[buf.len() - keep..].to_string();
                        break;
                    }
                }
            }
        }
        (content, reasoning)
    }

    /// What is held back at the end of the output: (content, reasoning).
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.thinking {
            true => (String::new(), held),
            false => (held, String::new()),
        }
    }

    fn push_content(&mut self, out: &mut String, text: &str) {
        let text = match self.trim_content {
            true => text.trim_start_matches(['\n', '\r']),
            false => text,
        };
        if !text.is_empty() {
            self.trim_content = false;
        }
        out.push_str(text);
    }
}

/// Length of the longest suffix of `buf` that is a proper prefix of `tag` (held back).
pub fn partial_tag(buf: &str, tag: &str) -> usize {
    (1..tag.len().min(buf.len() + 1))
        .rev()
        .find(|&n| buf.is_char_boundary(buf.len() - n) && tag.starts_with(&buf[buf.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `step` bytes (on char boundaries) and joins the results.
    fn split(format: ReasoningFormat, text: &str, step: usize) -> (String, String) {
        let mut s = ThinkSplitter::new(format);
        let (mut c, mut r) = (String::new(), String::new());
        let mut i = 0;
        while i < text.len() {
            let mut j = (i + step).min(text.len());
            while !text.is_char_boundary(j) {
                j += 1;
            }
            let (dc, dr) = s.push(&text[i..j]);
            c.push_str(&dc);
            r.push_str(&dr);
            i = j;
        }
        let (dc, dr) = s.finish();
        (c + &dc, r + &dr)
    }

    #[test]
    fn think_blocks_split_at_any_delta_boundary() {
        let text = "<think>Let me see: 2+2.</think>\n\nIt is 4 <b>.";
        for step in 1..text.len() {
            let (c, r) = split(ReasoningFormat::Think, text, step);
            assert_eq!(r, "Let me see: 2+2.", "step {step}");
            assert_eq!(c, "It is 4 <b>.", "step {step}");
        }
        let (c, r) = split(ReasoningFormat::StartsThinking, "hmm</think>ok", 3);
        assert_eq!((c.as_str(), r.as_str()), ("ok", "hmm"));
        // No block at all: everything is content; an unclosed block is all reasoning.
        assert_eq!(
            split(ReasoningFormat::Think, "plain <thin", 2),
            ("plain <thin".into(), String::new())
        );
        assert_eq!(
            split(ReasoningFormat::StartsThinking, "still thinking", 4),
            (String::new(), "still thinking".into())
        );
    }
}
