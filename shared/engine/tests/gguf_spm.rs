//! SentencePiece vocabularies from GGUF (`tokenizer.ggml.model = llama`): a small SentencePiece
//! BPE model trained as Llama's is configured, written into `goldens/gguf/spm_vocab.gguf` the
//! way llama.cpp's converter writes vocabularies, and the ids the `sentencepiece` package gives
//! for a few texts (`scripts/goldens/make_gguf_spm_goldens.py`). The tokenizer built from the
//! GGUF metadata must give the same ids and decode them back to the text.

use std::path::PathBuf;

use tandem_engine::model::gguf::GgufFile;
use tandem_engine::tokenizer::gguf::tokenizer_files;
use tandem_engine::tokenizer::Tokenizer;

#[test]
fn sentencepiece_vocab_encodes_like_sentencepiece() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/gguf");
    let f = GgufFile::open(&dir.join("spm_vocab.gguf")).expect("open");
    let files = tokenizer_files(&f).expect("tokenizer files");
    let tok = Tokenizer::from_bytes(&files.tokenizer_json, "spm_vocab.gguf").expect("tokenizer");
    let g: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("spm_ids.json")).unwrap()).unwrap();
    let bos = g["bos_id"].as_u64().unwrap() as u32;
    for case in g["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(tok.decode(&got, false).unwrap(), text, "{text:?}");
        // add_bos_token: the BOS comes first when special tokens are added.
        let with = tok.encode(text, true).unwrap();
        assert_eq!(with[0], bos);
        assert_eq!(&with[1..], &want[..]);
    }
}
