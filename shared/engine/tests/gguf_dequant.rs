//! GGUF container parsing and dequantization against goldens made by the reference `gguf`
//! Python package (`scripts/goldens/make_gguf_goldens.py`): `goldens/gguf/quants.gguf` holds
//! one small tensor per supported type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and one
//! unsupported (Q5_0); `quants_f32.bin` their values as `gguf.quants.dequantize` computes them.
//! Ours must equal them exactly (same f32 operations in the same order).

use std::path::PathBuf;

use tandem_engine::model::gguf::{GgufFile, Value};

fn goldens() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/gguf")
}

#[test]
fn dequantization_matches_the_gguf_package() {
    let dir = goldens();
    let f = GgufFile::open(&dir.join("quants.gguf")).expect("open");
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("quants.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("quants_f32.bin")).unwrap();
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut at = 0;
    let mut checked = vec![];
    for t in index["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let n: usize = shape.iter().product();
        let want = &all[at..at + n];
        at += n;
        let got = f
            .tensor_f32(name, &shape)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.len(), n);
        let bad: Vec<(usize, f32, f32)> = got
            .iter()
            .zip(want)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| (i, *a, *b))
            .take(5)
            .collect();
        assert!(bad.is_empty(), "{name}: (index, ours, gguf) {bad:?}");
        assert!(want.iter().any(|v| *v != 0.0), "{name}: all zero");
        checked.push(t["type"].as_str().unwrap().to_string());
    }
    assert_eq!(at, all.len());
    assert_eq!(
        checked,
        ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
    );
}

#[test]
fn metadata_values_and_errors() {
    let f = GgufFile::open(&goldens().join("quants.gguf")).expect("open");
    assert_eq!(f.version, 3);
    assert_eq!(
        f.get("general.architecture").and_then(Value::as_str),
        Some("llama")
    );
    assert_eq!(f.get("test.string").and_then(Value::as_str), Some("héllo"));
    let strs: Vec<&str> = f
        .get("test.strings")
        .and_then(Value::as_array)
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(strs, ["a", "bc", ""]);
    assert_eq!(f.get("test.f32").and_then(Value::as_f64), Some(0.5));
    assert_eq!(f.get("test.u64").and_then(Value::as_u64), Some(1 << 40));
    assert_eq!(f.get("test.bool").and_then(Value::as_bool), Some(true));
    // GGUF dims are fastest-first; shapes are reported in Hugging Face order.
    assert_eq!(f.tensor("q4_k").unwrap().shape(), vec![3, 512]);
    let e = f.tensor_f32("q5_0", &[3, 512]).unwrap_err().to_string();
    assert!(
        e.contains("tensor q5_0") && e.contains("Q5_0") && e.contains("not supported"),
        "{e}"
    );
    let e = f.tensor_f32("q8_0", &[512, 3]).unwrap_err().to_string();
    assert!(e.contains("shape"), "{e}");
    let e = f.tensor_f32("nope", &[1]).unwrap_err().to_string();
    assert!(e.contains("tensor nope") && e.contains("missing"), "{e}");
    // Not a GGUF file, and a truncated one.
    let dir = std::env::temp_dir().join(format!("tandem-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("x.gguf");
    std::fs::write(&p, b"GGML....").unwrap();
    let e = GgufFile::open(&p).unwrap_err().to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
    let bytes = std::fs::read(goldens().join("quants.gguf")).unwrap();
    std::fs::write(&p, &bytes[..200]).unwrap();
    let e = GgufFile::open(&p).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
