//! `dyn://namespace.component.endpoint` addresses (the `/` separator is accepted too).

use serde::Serialize;
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EndpointAddr {
    pub namespace: String,
    pub component: String,
    pub endpoint: String,
}

impl EndpointAddr {
    pub fn parse(text: &str) -> Result<Self, String> {
        let rest = text.strip_prefix("dyn://").unwrap_or(text);
        let parts: Vec<&str> = rest.split(['.', '/']).collect();
        let valid = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if parts.len() != 3 || !parts.iter().all(|p| valid(p)) {
            return Err(format!(
                "malformed endpoint {text:?}: expected dyn://namespace.component.endpoint, each part \
                 non-empty and made of letters, digits, '_' or '-'"
            ));
        }
        Ok(EndpointAddr {
            namespace: parts[0].into(),
            component: parts[1].into(),
            endpoint: parts[2].into(),
        })
    }
}

impl fmt::Display for EndpointAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dyn://{}.{}.{}",
            self.namespace, self.component, self.endpoint
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_separators_and_rejects_malformed() {
        let e = EndpointAddr::parse("dyn://ns.backend.generate").unwrap();
        assert_eq!(e.to_string(), "dyn://ns.backend.generate");
        assert_eq!(
            EndpointAddr::parse("ns/prefill/generate")
                .unwrap()
                .component,
            "prefill"
        );
        for bad in [
            "dyn://ns.comp",
            "dyn://a..b",
            "dyn://a.b.c.d",
            "dyn://a b.c.d",
            "",
            "dyn://",
        ] {
            assert!(EndpointAddr::parse(bad).is_err(), "{bad}");
        }
    }
}
