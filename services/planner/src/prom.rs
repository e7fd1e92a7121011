//! A reader of Prometheus' text exposition format, enough for the planner: every sample's
//! name, labels and value (comments and timestamps are skipped), summed or split by label.

use std::collections::BTreeMap;

/// One sample line: `name{label="value",...} 1.5`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A scraped page.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Page {
    pub samples: Vec<Sample>,
}

/// A line that is not a sample, with its number (from 1).
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("line {line}: not a Prometheus sample: {text:?}")]
pub struct ParseError {
    pub line: usize,
    pub text: String,
}

impl Page {
    pub fn parse(text: &str) -> Result<Page, ParseError> {
        let mut samples = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = || ParseError {
                line: i + 1,
                text: raw.chars().take(120).collect(),
            };
            samples.push(parse_line(line).ok_or_else(bad)?);
        }
        Ok(Page { samples })
    }

    /// The sum of every series of `name`; `None` when there is none.
    pub fn sum(&self, name: &str) -> Option<f64> {
        self.matching(name, |_| true)
    }

    /// The largest value of the series of `name` (a limit that several workers of one
    /// process each report); `None` when there is none.
    pub fn max(&self, name: &str) -> Option<f64> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value)
            .reduce(f64::max)
    }

    /// The sum of the series of `name` whose `key` label is `value`.
    pub fn sum_where(&self, name: &str, key: &str, value: &str) -> Option<f64> {
        self.matching(name, |s| s.label(key) == Some(value))
    }

    fn matching(&self, name: &str, keep: impl Fn(&Sample) -> bool) -> Option<f64> {
        self.samples
            .iter()
            .filter(|s| s.name == name && keep(s))
            .map(|s| s.value)
            .reduce(|a, b| a + b)
    }

    /// The series of `name`, summed per value of label `key`.
    pub fn by_label(&self, name: &str, key: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for s in self.samples.iter().filter(|s| s.name == name) {
            if let Some(v) = s.label(key) {
                *out.entry(v.to_string()).or_insert(0.0) += s.value;
            }
        }
        out
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => return None,
    };
    let (labels, rest) = if let Some(body) = rest.strip_prefix('{') {
        let end = closing_brace(body)?;
        (parse_labels(&body[..end])?, &body[end + 1..])
    } else {
        (Vec::new(), rest)
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    (!name.is_empty()).then(|| Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// The index of the `}` closing a label set, skipping quoted values.
fn closing_brace(body: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in body.char_indices() {
        match (quoted, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => quoted = !quoted,
            (false, _, '}') => return Some(i),
            _ => {}
        }
    }
    None
}

fn parse_labels(body: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut rest = body.trim();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_string();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        out.push((key, value));
        rest = after[end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP dynamo_frontend_requests_total Requests.
# TYPE dynamo_frontend_requests_total counter
dynamo_frontend_requests_total{model="m",status="success"} 10
dynamo_frontend_requests_total{model="m",status="error"} 2
dynamo_frontend_input_sequence_tokens_sum{model="m"} 1234.5
dynamo_frontend_input_sequence_tokens_bucket{model="m",le="+Inf"} 12
dynamo_component_queued_prefill_tokens{worker_id="7",note="a \"quoted\", {odd} value"} 300 1700000000
plain_gauge 3e2
"#;

    #[test]
    fn samples_sum_and_split_by_label() {
        let p = Page::parse(PAGE).unwrap();
        assert_eq!(p.sum("dynamo_frontend_requests_total"), Some(12.0));
        assert_eq!(
            p.sum_where("dynamo_frontend_requests_total", "status", "error"),
            Some(2.0)
        );
        assert_eq!(
            p.sum("dynamo_frontend_input_sequence_tokens_sum"),
            Some(1234.5)
        );
        assert_eq!(p.sum("plain_gauge"), Some(300.0));
        assert_eq!(p.sum("absent"), None);
        let q = p.by_label("dynamo_component_queued_prefill_tokens", "worker_id");
        assert_eq!(q.get("7"), Some(&300.0));
        let s = &p.samples[4];
        assert_eq!(s.label("note"), Some("a \"quoted\", {odd} value"));
        assert_eq!(p.samples[3].label("le"), Some("+Inf"));
    }

    #[test]
    fn garbage_names_its_line() {
        let err = Page::parse("ok 1\nnot a sample\n").unwrap_err();
        assert_eq!(err.line, 2);
        assert!(Page::parse("x{a=\"1\" 2").is_err(), "unclosed labels");
        assert!(Page::parse("x NaNa").is_err());
    }
}
