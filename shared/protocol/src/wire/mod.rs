//! Conversions between the messages of `proto/worker.proto` and the types they carry, both
//! ways, and why a peer's message could not be turned into the value it stands for.
//!
//! The pairs convert through the traits below: [`IntoWire`] (never fails), [`FromWire`] and
//! [`TryFromWire`] (a peer's message may be malformed: a [`WireError`] naming the offending
//! field by its path in the message, `lease.region`, `state.sampler.rng`, which a gRPC
//! handler answers as `INVALID_ARGUMENT`; never a panic). This crate holds the conversions
//! of the leaf crates' types, which router and worker share:
//! - [`text`]: sampling parameters, token logprobs, stop reasons, stop-string matching
//!   (`tandem-text`);
//! - [`kv_events`]: KV block events and the stored-block dump (`tandem-kv-protocol`).
//!
//! The worker converts the engine's and kv-transfer's own types (requests, the prefill
//! hand-off state, the transfer region) with the same traits.

pub mod kv_events;
pub mod media;
pub mod text;

/// Converts a value into the message that carries it.
pub trait IntoWire {
    type Wire;
    fn into_wire(self) -> Self::Wire;
}

/// Converts a message that cannot be malformed into the value it carries.
pub trait FromWire<W> {
    fn from_wire(wire: W) -> Self;
}

/// Converts a peer's message into the value it carries, or says which field is wrong.
pub trait TryFromWire<W>: Sized {
    fn try_from_wire(wire: W) -> Result<Self, WireError>;
}

/// A required sub-message `field`, converted; errors name their path through it.
pub fn sub<W, T: TryFromWire<W>>(value: Option<W>, field: &str) -> Result<T, WireError> {
    let wire = required(value, field)?;
    T::try_from_wire(wire).map_err(|e| e.within(field))
}

/// A malformed message from a peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A sub-message (or a `oneof`) that must be set is not.
    #[error("missing field `{0}`")]
    MissingField(String),
    /// An enum value this version does not know, or the unspecified (zero) value.
    #[error("field `{field}`: invalid enum value {value}")]
    InvalidEnum { field: String, value: i32 },
    /// A number that does not fit the type it stands for on this host.
    #[error("field `{field}`: {value} is out of range")]
    OutOfRange { field: String, value: u64 },
    /// A field set where this call cannot take it.
    #[error("field `{field}`: {reason}")]
    Unsupported { field: String, reason: &'static str },
}

impl WireError {
    pub fn missing(field: &str) -> Self {
        WireError::MissingField(field.to_owned())
    }

    pub fn invalid_enum(field: &str, value: i32) -> Self {
        WireError::InvalidEnum {
            field: field.to_owned(),
            value,
        }
    }

    /// The same error seen from the message that contains `parent`: its field path gets
    /// `parent.` in front.
    pub fn within(self, parent: &str) -> Self {
        let prefix = |field: String| format!("{parent}.{field}");
        match self {
            WireError::MissingField(field) => WireError::MissingField(prefix(field)),
            WireError::InvalidEnum { field, value } => WireError::InvalidEnum {
                field: prefix(field),
                value,
            },
            WireError::OutOfRange { field, value } => WireError::OutOfRange {
                field: prefix(field),
                value,
            },
            WireError::Unsupported { field, reason } => WireError::Unsupported {
                field: prefix(field),
                reason,
            },
        }
    }

    /// The path of the offending field.
    pub fn field(&self) -> &str {
        match self {
            WireError::MissingField(field)
            | WireError::InvalidEnum { field, .. }
            | WireError::OutOfRange { field, .. }
            | WireError::Unsupported { field, .. } => field,
        }
    }
}

/// A required sub-message, or [`WireError::MissingField`] naming it.
pub fn required<T>(value: Option<T>, field: &str) -> Result<T, WireError> {
    value.ok_or_else(|| WireError::missing(field))
}

/// A `u64` count as a `usize`, or [`WireError::OutOfRange`] naming it.
pub fn to_usize(value: u64, field: &str) -> Result<usize, WireError> {
    usize::try_from(value).map_err(|_| WireError::OutOfRange {
        field: field.to_owned(),
        value,
    })
}

impl From<WireError> for tonic::Status {
    fn from(e: WireError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_grow_from_the_inside_out_and_become_invalid_argument() {
        let e = WireError::missing("rng").within("sampler").within("state");
        assert_eq!(e, WireError::MissingField("state.sampler.rng".into()));
        assert_eq!(e.field(), "state.sampler.rng");
        let e = WireError::invalid_enum("backend", 7).within("region");
        assert_eq!(
            e.to_string(),
            "field `region.backend`: invalid enum value 7"
        );
        let status = tonic::Status::from(WireError::missing("lease.region"));
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), "missing field `lease.region`");
        assert_eq!(required(Some(3), "x"), Ok(3));
        assert_eq!(required::<u8>(None, "x"), Err(WireError::missing("x")));
        assert_eq!(to_usize(5, "n"), Ok(5));
    }
}
