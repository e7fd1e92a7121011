#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tandem_fuzz_targets::openai::openai_request(data);
});
