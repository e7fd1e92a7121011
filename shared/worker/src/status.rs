//! Engine errors as gRPC statuses, by the error's class (never by its message): a caller's
//! mistake is `INVALID_ARGUMENT` (or `NOT_FOUND` / `ALREADY_EXISTS`), an engine out of room or
//! over `--engine-request-limit` is `RESOURCE_EXHAUSTED`, an engine that stopped, died or has
//! a full command queue is `UNAVAILABLE` (a router retries those elsewhere, or answers 503),
//! and a failure inside the worker is `INTERNAL`.

use tandem_engine::error::{EngineError, ErrorClass};
use tonic::{Code, Status};

/// The gRPC code of an engine error.
pub fn engine_code(e: &EngineError) -> Code {
    match e.class() {
        ErrorClass::Invalid => Code::InvalidArgument,
        ErrorClass::NotFound => Code::NotFound,
        ErrorClass::AlreadyExists => Code::AlreadyExists,
        ErrorClass::Exhausted => Code::ResourceExhausted,
        ErrorClass::Unavailable => Code::Unavailable,
        ErrorClass::Internal => Code::Internal,
    }
}

/// An engine error as the status a gRPC caller gets.
pub fn engine_status(e: EngineError) -> Status {
    Status::new(engine_code(&e), e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_class_maps_to_its_code() {
        let params = tandem_engine::sampler::SamplingParams {
            n: 0,
            ..Default::default()
        };
        let invalid = EngineError::from(params.validate().expect_err("n = 0"));
        let cases = [
            (invalid, Code::InvalidArgument),
            (
                EngineError::InvalidRequest("too long".into()),
                Code::InvalidArgument,
            ),
            (
                EngineError::DuplicateRequest("a".into()),
                Code::AlreadyExists,
            ),
            (EngineError::UnknownLease(3), Code::NotFound),
            (
                EngineError::Overloaded { limit: 2 },
                Code::ResourceExhausted,
            ),
            (
                EngineError::OutOfBlocks {
                    needed: 9,
                    available: 1,
                },
                Code::ResourceExhausted,
            ),
            (EngineError::QueueFull { capacity: 4 }, Code::Unavailable),
            (EngineError::Stopped, Code::Unavailable),
            (EngineError::Backend("cuda".into()), Code::Internal),
        ];
        for (e, code) in cases {
            let s = engine_status(e);
            assert_eq!(s.code(), code, "{}", s.message());
        }
    }
}
