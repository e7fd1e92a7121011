#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tandem_fuzz_targets::model_files::safetensors_header(data);
});
