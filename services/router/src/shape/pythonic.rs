//! The pythonic tool-call format (Llama 3.2 / 4): `[get_weather(city="Paris", days=3),
//! get_time()]`, a Python list of calls with keyword arguments whose values are Python
//! literals (strings, numbers, True / False / None, lists, dicts). Parsed here by a small
//! recursive descent into JSON; anything else is not a call.

use serde_json::{Map, Number, Value};

use super::tools::ToolCall;

/// The calls of a whole output, or None when it is not such a list.
pub fn parse(text: &str) -> Option<Vec<ToolCall>> {
    let mut p = Parser {
        s: text.trim().as_bytes(),
        i: 0,
    };
    p.eat(b'[')?;
    let mut calls = Vec::new();
    loop {
        p.skip_ws();
        if p.peek()? == b']' && calls.is_empty() {
            return None;
        }
        calls.push(p.call()?);
        p.skip_ws();
        match p.next()? {
            b',' => continue,
            b']' => break,
            _ => return None,
        }
    }
    p.skip_ws();
    (p.i == p.s.len()).then_some(calls)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        self.skip_ws();
        (self.next()? == c).then_some(())
    }

    fn ident(&mut self) -> Option<String> {
        self.skip_ws();
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.')
        {
            self.i += 1;
        }
        let id = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        (!id.is_empty() && !id.as_bytes()[0].is_ascii_digit()).then(|| id.to_string())
    }

    /// `name(key=value, ...)`.
    fn call(&mut self) -> Option<ToolCall> {
        let name = self.ident()?;
        self.eat(b'(')?;
        let mut args = Map::new();
        self.skip_ws();
        if self.peek()? == b')' {
            self.i += 1;
        } else {
            loop {
                let key = self.ident()?;
                self.eat(b'=')?;
                let value = self.value()?;
                args.insert(key, value);
                self.skip_ws();
                match self.next()? {
                    b',' => continue,
                    b')' => break,
                    _ => return None,
                }
            }
        }
        Some(ToolCall {
            name,
            arguments: Value::Object(args).to_string(),
        })
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_ws();
        match self.peek()? {
            b'"' | b'\'' => self.string().map(Value::String),
            b'[' => self.list(b'[', b']'),
            b'(' => self.list(b'(', b')'),
            b'{' => self.dict(),
            c if c == b'-' || c.is_ascii_digit() => self.number(),
            _ => match self.ident()?.as_str() {
                "True" => Some(Value::Bool(true)),
                "False" => Some(Value::Bool(false)),
                "None" => Some(Value::Null),
                _ => None,
            },
        }
    }

    fn string(&mut self) -> Option<String> {
        let quote = self.next()?;
        let mut out = Vec::new();
        loop {
            match self.next()? {
                c if c == quote => break,
                b'\\' => out.push(match self.next()? {
                    b'n' => b'\n',
                    b't' => b'\t',
                    b'r' => b'\r',
                    c => c,
                }),
                c => out.push(c),
            }
        }
        String::from_utf8(out).ok()
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E'))
        {
            self.i += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        match text.parse::<i64>() {
            Ok(n) => Some(Value::Number(n.into())),
            Err(_) => Number::from_f64(text.parse::<f64>().ok()?).map(Value::Number),
        }
    }

    fn list(&mut self, open: u8, close: u8) -> Option<Value> {
        self.eat(open)?;
        let mut items = Vec::new();
        loop {
            self.skip_ws();
            if self.peek()? == close {
                self.i += 1;
                return Some(Value::Array(items));
            }
            items.push(self.value()?);
            self.skip_ws();
            match self.next()? {
                b',' => continue,
                c if c == close => return Some(Value::Array(items)),
                _ => return None,
            }
        }
    }

    fn dict(&mut self) -> Option<Value> {
        self.eat(b'{')?;
        let mut map = Map::new();
        loop {
            self.skip_ws();
            if self.peek()? == b'}' {
                self.i += 1;
                return Some(Value::Object(map));
            }
            let key = match self.value()? {
                Value::String(s) => s,
                other => other.to_string(),
            };
            self.eat(b':')?;
            map.insert(key, self.value()?);
            self.skip_ws();
            match self.next()? {
                b',' => continue,
                b'}' => return Some(Value::Object(map)),
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_calls_become_json_arguments() {
        let out = r#"[get_weather(city="Paris", days=3, metric=True), get_time(), note(text='it\'s', tags=["a", 'b'], opts={"x": None, "y": -1.5})]"#;
        let calls = parse(out).expect("parses");
        let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["get_weather", "get_time", "note"]);
        assert_eq!(
            calls[0].arguments,
            r#"{"city":"Paris","days":3,"metric":true}"#
        );
        assert_eq!(calls[1].arguments, "{}");
        assert_eq!(
            calls[2].arguments,
            r#"{"text":"it's","tags":["a","b"],"opts":{"x":null,"y":-1.5}}"#
        );
        for bad in [
            "[]",
            "get_time()",
            "[f(1)]",
            "[f(a=)]",
            "[f(a=1) g()]",
            "[f(a=x)]",
            "[f(a='open)]",
            "[f()] tail",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
