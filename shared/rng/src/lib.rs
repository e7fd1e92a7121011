//! The workspace's seedable pseudo-random generators, with no dependencies so that any crate
//! can use them and their output never changes with an upgrade: seeded streams feed golden
//! files (the tiny model's weights), recorded results (load-test workloads) and requests'
//! sampling, all of which must stay bit-identical.
//!
//! - [`SplitMix64`] (Steele, Lea & Flood): one `u64` of state, the generator of the tiny
//!   model's weights, of routing choices and of load-test workloads; [`splitmix64`] is its
//!   step on a bare `u64`.
//! - [`Xoshiro256StarStar`] (Blackman & Vigna): four `u64`s of state, seeded through
//!   splitmix64 as its authors recommend; the sampler's per-request stream.

mod splitmix;
mod xoshiro;

pub use splitmix::{splitmix64, SplitMix64};
pub use xoshiro::Xoshiro256StarStar;

/// SplitMix64's increment (2^64 / φ, odd), also a common multiplier for spreading seeds.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The top 53 bits of `x` as a float uniform in `[0, 1)`.
pub fn unit_f64(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}
