#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tandem_fuzz_targets::kv_events::kv_events(data);
});
