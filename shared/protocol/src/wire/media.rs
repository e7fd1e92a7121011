//! Image spans of a multimodal prompt (`tandem-kv-protocol`'s [`MediaSpan`]).

use tandem_kv_protocol::MediaSpan;

use super::{to_usize, IntoWire, TryFromWire, WireError};
use crate::worker as pb;

impl IntoWire for MediaSpan {
    type Wire = pb::MediaSpan;
    fn into_wire(self) -> pb::MediaSpan {
        pb::MediaSpan {
            start: self.start as u64,
            len: self.len as u64,
            hash: self.hash,
        }
    }
}

impl TryFromWire<pb::MediaSpan> for MediaSpan {
    fn try_from_wire(s: pb::MediaSpan) -> Result<Self, WireError> {
        Ok(MediaSpan {
            start: to_usize(s.start, "start")?,
            len: to_usize(s.len, "len")?,
            hash: s.hash,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_round_trip() {
        let s = MediaSpan {
            start: 5,
            len: 16,
            hash: 0xdead_beef,
        };
        assert_eq!(MediaSpan::try_from_wire(s.into_wire()), Ok(s));
    }
}
