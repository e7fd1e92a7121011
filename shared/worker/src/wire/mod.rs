//! Conversions between the messages of `proto/worker.proto` and the engine's and
//! kv-transfer's types, both ways, for the worker and (through `tandem_router::wire`) the
//! router.
//!
//! The orphan rule forbids `From`/`TryFrom` between two foreign crates' types, so the pairs
//! convert through the traits below, which read the same: [`IntoWire`] (never fails),
//! [`FromWire`] and [`TryFromWire`] (a peer's message may be malformed: a typed
//! [`WireError`] naming the field, never a panic). The modules follow the crates the types
//! belong to, so each can move beside its types as a plain `From`/`TryFrom` impl:
//! - [`text`]: sampling parameters, token logprobs, stop reasons, stop-string matching;
//! - [`kv_events`]: KV block events and the stored-block dump;
//! - [`request`]: requests, their outputs, and the prefill hand-off state (engine types);
//! - [`region`]: the KV transfer region of a decode worker (kv-transfer's).

pub mod kv_events;
pub mod region;
pub mod request;
pub mod text;

pub use tandem_protocol::WireError;

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
pub(crate) fn sub<W, T: TryFromWire<W>>(value: Option<W>, field: &str) -> Result<T, WireError> {
    let wire = tandem_protocol::wire::required(value, field)?;
    T::try_from_wire(wire).map_err(|e| e.within(field))
}
