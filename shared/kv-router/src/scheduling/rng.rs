//! The routing choices' generator: the workspace's [`SplitMix64`], reproducible in tests with
//! a fixed seed ([`SplitMix64::new`]) and seeded from the clock in production
//! ([`SplitMix64::from_entropy`]).

pub use tandem_rng::SplitMix64;
