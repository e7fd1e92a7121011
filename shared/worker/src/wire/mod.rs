//! Conversions between the messages of `proto/worker.proto` and the engine's and
//! kv-transfer's types, both ways (the leaf crates' types convert in
//! `tandem_protocol::wire`, with the same traits):
//! - [`request`]: requests, their outputs, and the prefill hand-off state (engine types);
//! - [`region`]: the KV transfer region of a decode worker (kv-transfer's).

pub mod region;
pub mod request;

pub use tandem_protocol::wire::{sub, FromWire, IntoWire, TryFromWire, WireError};

// The orphan rule forbids implementing the protocol crate's traits for the engine's types
// here (both are foreign to this crate), so these read the same under their own names.

/// Converts an engine or kv-transfer value into the message that carries it.
pub trait EngineIntoWire {
    type Wire;
    fn into_wire(self) -> Self::Wire;
}

/// Converts a message that cannot be malformed into the engine value it carries.
pub trait EngineFromWire<W> {
    fn from_wire(wire: W) -> Self;
}

/// Converts a peer's message into the engine value it carries, or says which field is wrong.
pub trait EngineTryFromWire<W>: Sized {
    fn try_from_wire(wire: W) -> Result<Self, WireError>;
}

/// A required sub-message `field`, converted to an engine value; errors name their path.
pub fn engine_sub<W, T: EngineTryFromWire<W>>(
    value: Option<W>,
    field: &str,
) -> Result<T, WireError> {
    let wire = tandem_protocol::wire::required(value, field)?;
    T::try_from_wire(wire).map_err(|e| e.within(field))
}
