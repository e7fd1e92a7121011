//! A parser for the Python literals Dynamo users write in `--override-engine-args`
//! (`{'kv_cache_config': {'enable_block_reuse': False}}`): dicts, lists, tuples, strings in
//! single or double quotes, ints, floats, `True`, `False` and `None`. JSON is a subset except
//! for `true/false/null`, which are accepted too.

use serde_json::{Map, Number, Value};

/// A parse failure with its 1-based position.
#[derive(Debug, PartialEq)]
pub struct LiteralError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

pub fn parse(text: &str) -> Result<Value, LiteralError> {
    let mut p = Parser {
        chars: text.chars().collect(),
        pos: 0,
    };
    let value = p.value()?;
    p.skip_ws();
    if p.pos < p.chars.len() {
        return Err(p.error("unexpected trailing characters"));
    }
    Ok(value)
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

impl Parser {
    fn error(&self, message: &str) -> LiteralError {
        let before = &self.chars[..self.pos.min(self.chars.len())];
        let line = before.iter().filter(|c| **c == '\n').count() + 1;
        let column = before.iter().rev().take_while(|c| **c != '\n').count() + 1;
        LiteralError {
            line,
            column,
            message: message.to_string(),
        }
    }

    fn skip_ws(&mut self) {
        while self.pos < self.chars.len() && self.chars[self.pos].is_whitespace() {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.chars.get(self.pos).copied()
    }

    fn expect(&mut self, c: char) -> Result<(), LiteralError> {
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(&format!("expected '{c}'")))
        }
    }

    fn value(&mut self) -> Result<Value, LiteralError> {
        match self.peek() {
            Some('{') => self.dict(),
            Some('[') => self.sequence('[', ']'),
            Some('(') => self.sequence('(', ')'),
            Some(q @ ('\'' | '"')) => self.string(q).map(Value::String),
            Some(c) if c == '-' || c == '+' || c == '.' || c.is_ascii_digit() => self.number(),
            Some(c) if c.is_alphabetic() => self.word(),
            Some(_) => Err(self.error("unexpected character")),
            None => Err(self.error("unexpected end of input")),
        }
    }

    fn dict(&mut self) -> Result<Value, LiteralError> {
        self.expect('{')?;
        let mut map = Map::new();
        loop {
            if self.peek() == Some('}') {
                self.pos += 1;
                return Ok(Value::Object(map));
            }
            let key = match self.peek() {
                Some(q @ ('\'' | '"')) => self.string(q)?,
                _ => return Err(self.error("dict keys must be quoted strings")),
            };
            self.expect(':')?;
            let value = self.value()?;
            map.insert(key, value);
            match self.peek() {
                Some(',') => self.pos += 1,
                Some('}') => {}
                _ => return Err(self.error("expected ',' or '}'")),
            }
        }
    }

    fn sequence(&mut self, open: char, close: char) -> Result<Value, LiteralError> {
        self.expect(open)?;
        let mut items = Vec::new();
        loop {
            if self.peek() == Some(close) {
                self.pos += 1;
                return Ok(Value::Array(items));
            }
            items.push(self.value()?);
            match self.peek() {
                Some(',') => self.pos += 1,
                Some(c) if c == close => {}
                _ => return Err(self.error(&format!("expected ',' or '{close}'"))),
            }
        }
    }

    fn string(&mut self, quote: char) -> Result<String, LiteralError> {
        self.pos += 1;
        let mut out = String::new();
        while let Some(&c) = self.chars.get(self.pos) {
            self.pos += 1;
            match c {
                c if c == quote => return Ok(out),
                '\\' => {
                    let Some(&e) = self.chars.get(self.pos) else {
                        break;
                    };
                    self.pos += 1;
                    match e {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        // Python's (and JSON's) control escapes.
                        'b' => out.push('\u{8}'),
                        'f' => out.push('\u{c}'),
                        'v' => out.push('\u{b}'),
                        'a' => out.push('\u{7}'),
                        '0' => out.push('\0'),
                        'u' => {
                            let hex: String = self.chars.iter().skip(self.pos).take(4).collect();
                            let code = u32::from_str_radix(&hex, 16)
                                .ok()
                                .filter(|_| hex.len() == 4)
                                .and_then(char::from_u32)
                                .ok_or_else(|| self.error("bad \\u escape"))?;
                            self.pos += 4;
                            out.push(code);
                        }
                        other => out.push(other),
                    }
                }
                '\n' => return Err(self.error("newline inside a string")),
                c => out.push(c),
            }
        }
        Err(self.error("unterminated string"))
    }

    fn number(&mut self) -> Result<Value, LiteralError> {
        let start = self.pos;
        while let Some(&c) = self.chars.get(self.pos) {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+' | '_') {
                self.pos += 1;
            } else {
                break;
            }
        }
        let text: String = self.chars[start..self.pos]
            .iter()
            .filter(|c| **c != '_')
            .collect();
        if let Ok(i) = text.parse::<i64>() {
            return Ok(Value::Number(i.into()));
        }
        if let Ok(u) = text.parse::<u64>() {
            return Ok(Value::Number(u.into()));
        }
        text.parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| {
                self.pos = start;
                self.error(&format!("invalid number '{text}'"))
            })
    }

    fn word(&mut self) -> Result<Value, LiteralError> {
        let start = self.pos;
        while let Some(&c) = self.chars.get(self.pos) {
            if c.is_alphanumeric() || c == '_' {
                self.pos += 1;
            } else {
                break;
            }
        }
        let word: String = self.chars[start..self.pos].iter().collect();
        match word.as_str() {
            "True" | "true" => Ok(Value::Bool(true)),
            "False" | "false" => Ok(Value::Bool(false)),
            "None" | "null" => Ok(Value::Null),
            _ => {
                self.pos = start;
                Err(self.error(&format!("unknown name '{word}' (strings must be quoted)")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_literals_become_json() {
        let cases = [
            (
                "{'kv_cache_config': {'enable_block_reuse': False}}",
                json!({"kv_cache_config": {"enable_block_reuse": false}}),
            ),
            (
                "{\"a\": True, 'b': None, 'c': [1, 2.5, -3], 'd': (4, 'x')}",
                json!({"a": true, "b": null, "c": [1, 2.5, -3], "d": [4, "x"]}),
            ),
            (
                "{'nested': {'deeper': {'k': 'it\\'s'}}, 'e': []}",
                json!({"nested": {"deeper": {"k": "it's"}}, "e": []}),
            ),
            ("{'trailing': [1, 2,], }", json!({"trailing": [1, 2]})),
            (
                "{'ctl': '\\b\\f\\v\\a', 'json': \"\\u0008\"}",
                json!({"ctl": "\u{8}\u{c}\u{b}\u{7}", "json": "\u{8}"}),
            ),
            (
                "{\"json\": true, \"n\": null, \"f\": 1e-3}",
                json!({"json": true, "n": null, "f": 0.001}),
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(parse(text).unwrap(), expected, "{text}");
        }
    }

    #[test]
    fn errors_carry_line_and_column() {
        let err = parse("{'a': 1,\n 'b': Flase}").unwrap_err();
        assert_eq!((err.line, err.column), (2, 7));
        assert!(err.message.contains("Flase"));
        assert!(parse("{'a': 1").unwrap_err().message.contains("expected"));
        assert!(parse("{'a': 'open")
            .unwrap_err()
            .message
            .contains("unterminated"));
        assert!(parse("{a: 1}").unwrap_err().message.contains("quoted"));
        assert!(parse("{} x").unwrap_err().message.contains("trailing"));
    }
}
