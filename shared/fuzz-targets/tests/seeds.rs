//! Writes the seed corpora of `fuzz/corpus/<target>/` (small, realistic inputs, each named
//! `seed-*`): `cargo test -p tandem-fuzz-targets --test seeds -- --ignored`. Files the fuzzer
//! added are left alone. The binary inputs (GGUF, safetensors, frames, protobuf, event
//! records) are built here rather than by hand so that they stay valid.

use std::path::Path;

use prost::Message;
use tandem_kv_protocol::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, KvStoredDump, LocalBlockHash, StoredBlock,
};
use tandem_kv_transfer::{Backend, MemoryKind, PeerAddress, RegionSecret, RemoteRegion};
use tandem_protocol::wire::IntoWire;
use tandem_worker::wire::EngineIntoWire;

fn write(target: &str, name: &str, data: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    std::fs::create_dir_all(&dir).expect("create a corpus folder");
    std::fs::write(dir.join(format!("seed-{name}")), data).expect("write a seed");
}

fn openai() {
    let t = "openai_request";
    write(
        t,
        "chat-minimal.json",
        br#"{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"Hello!"}]}"#,
    );
    write(t, "chat-full.json", br#"{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Name a colour."}]},{"role":"assistant","content":null}],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":64,"logprobs":true,"top_logprobs":3,"temperature":0.7,"top_p":0.9,"top_k":40,"min_p":0.05,"seed":42,"stop":["\n\n","END"],"n":2,"presence_penalty":0.5,"frequency_penalty":-0.5,"repetition_penalty":1.1,"ignore_eos":false,"min_tokens":1,"stop_token_ids":[151645],"skip_special_tokens":true,"user":"u-1","tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"tool_choice":"auto","chat_template_kwargs":{"enable_thinking":false}}"#);
    write(t, "chat-beams.json", br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"use_beam_search":true,"best_of":4,"n":2,"length_penalty":0.8,"early_stopping":true,"max_tokens":16}"#);
    write(t, "completion-text.json", br#"{"model":"m","prompt":"The capital of France is","max_tokens":8,"logprobs":2,"echo":false,"stop":"."}"#);
    write(
        t,
        "completion-tokens.json",
        br#"{"model":"m","prompt":[785,6722,315,9625,374],"max_tokens":4,"temperature":0}"#,
    );
    write(
        t,
        "completion-batch.json",
        br#"{"model":"m","prompt":["a","b"],"best_of":1,"suffix":""}"#,
    );
    write(
        t,
        "refused-unknown-field.json",
        br#"{"model":"m","prompt":"x","logit_bias":{"1":2}}"#,
    );
    write(
        t,
        "refused-range.json",
        br#"{"model":"m","messages":[],"temperature":9,"top_logprobs":3}"#,
    );
    write(
        t,
        "malformed.json",
        br#"{"model":"m","messages":[{"role":"user","content":"#,
    );
}

fn config() {
    let t = "config_yaml";
    write(t, "trtllm.yaml", b"# TensorRT-LLM style engine args\nmax_batch_size: 16\nmax_num_tokens: 8192\nmax_seq_len: 4096\nkv_cache_config:\n  free_gpu_memory_fraction: 0.6\n  enable_block_reuse: true\n  dtype: fp16\n  event_buffer_max_size: 1024\ncuda_graph_config:\n  enable_padding: true\n  batch_sizes: [1, 2, 4, 8]\nscheduler_config: {capacity_scheduler_policy: MAX_UTILIZATION}\ncache_transceiver_config:\n  backend: UCX\n  max_tokens_in_buffer: 8192\ndisable_overlap_scheduler: true\nguided_decoding_backend: ~\n");
    write(t, "prefill.yaml", b"tensor_parallel_size: 1\nenable_attention_dp: false\nenable_chunked_prefill: true\ncuda_graph_config: null\ncache_transceiver_config:\n  backend: TCP\n");
    write(t, "anchors.yaml", b"base: &kv\n  free_gpu_memory_fraction: 0.5\nkv_cache_config: *kv\nunknown_option: [a, {b: c}]\n'quoted key': \"x\\ty\"\n");
    write(
        t,
        "not-implemented.yaml",
        b"speculative_config:\n  decoding_type: Eagle\n",
    );
    write(t, "empty.yaml", b"");
    write(t, "list.yaml", b"- just\n- a list\n");
    write(
        t,
        "bad.yaml",
        b"max_batch_size: 4\nkv_cache_config:\n  enable_block_reuse: [unclosed\n",
    );

    let t = "config_pyliteral";
    write(
        t,
        "nested.py",
        b"{'kv_cache_config': {'enable_block_reuse': False, 'max_tokens': 4096}}",
    );
    write(t, "mixed.py", b"{\"a\": True, 'b': None, 'c': [1, 2.5, -3, 1_000], 'd': (4, 'x'), 'e': 'it\\'s \\u00e9\\n'}");
    write(
        t,
        "json.py",
        b"{\"json\": true, \"n\": null, \"f\": 1e-3, \"big\": 18446744073709551615}",
    );
    write(t, "trailing.py", b"{'trailing': [1, 2,], }");
    write(t, "bad.py", b"{'a': 1,\n 'b': Flase}");

    let t = "config_cli_env";
    write(t, "decode.txt", b"decode\n--model-path\nQwen/Qwen3-0.6B\n--max-batch-size\n32\n--free-gpu-memory-fraction\n0.5\n--kv-transport\ntcp\n$DYN_TRTLLM_MAX_NUM_TOKENS=4096\n$DYN_NAMESPACE=dynamo\n");
    write(t, "prefill.txt", b"prefill\n--disaggregation-mode\nprefill\n--override-engine-args\n{'kv_cache_config': {'enable_block_reuse': False}}\n--publish-kv-events\n$DYN_TRTLLM_STRICT_ENGINE_ARGS=true\n");
    write(t, "trtllm-flags.txt", b"decode\n--trtllm.kv_cache_config.max_tokens\n4096\n--trtllm.max_seq_len\nNone\n--trtllm.guided_decoding_backend\nxgrammar\n");
    write(t, "router.txt", b"router\n--http-port\n8000\n--router-mode\nkv\n--router-temperature\n0.5\n--router-kv-overlap-score-weight\n1.0\n$DYN_HTTP_HOST=0.0.0.0\n$ETCD_ENDPOINTS=http://127.0.0.1:2379\n");
    write(
        t,
        "bad-env.txt",
        b"decode\n$DYN_TRTLLM_FREE_GPU_MEMORY_FRACTION=1.5\n$DYN_TRTLLM_MAX_BATCH_SIZE=lots\n",
    );
}

/// A GGUF v3 file: `kv` metadata and `tensors` (name, dims, ggml type, data).
fn gguf(kv: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, Vec<u8>)]) -> Vec<u8> {
    let s = |out: &mut Vec<u8>, t: &str| {
        out.extend((t.len() as u64).to_le_bytes());
        out.extend(t.as_bytes());
    };
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (k, ty, v) in kv {
        s(&mut out, k);
        out.extend(ty.to_le_bytes());
        out.extend(v);
    }
    let mut data = Vec::new();
    for (name, dims, ty, bytes) in tensors {
        s(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend((data.len() as u64).to_le_bytes());
        data.extend(bytes);
        data.resize(data.len().next_multiple_of(32), 0);
    }
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend(data);
    out
}

fn gstr(t: &str) -> Vec<u8> {
    let mut v = (t.len() as u64).to_le_bytes().to_vec();
    v.extend(t.as_bytes());
    v
}

fn gstrs(items: &[&str]) -> Vec<u8> {
    let mut v = 8u32.to_le_bytes().to_vec();
    v.extend((items.len() as u64).to_le_bytes());
    for i in items {
        v.extend(gstr(i));
    }
    v
}

fn model_files() {
    let u32v = |x: u32| x.to_le_bytes().to_vec();
    let f32s = |n: usize| {
        (0..n)
            .flat_map(|i| (i as f32 * 0.25).to_le_bytes())
            .collect()
    };
    let kv = |arch: &str| {
        vec![
            ("general.architecture", 8, gstr(arch)),
            ("general.alignment", 4, u32v(32)),
            ("llama.block_count", 4, u32v(1)),
            ("llama.embedding_length", 4, u32v(8)),
            ("llama.feed_forward_length", 4, u32v(16)),
            ("llama.attention.head_count", 4, u32v(2)),
            ("llama.attention.head_count_kv", 4, u32v(1)),
            ("llama.context_length", 4, u32v(64)),
            ("llama.rope.freq_base", 6, 10000f32.to_le_bytes().to_vec()),
            ("tokenizer.ggml.model", 8, gstr("gpt2")),
            ("tokenizer.ggml.pre", 8, gstr("llama-bpe")),
            ("tokenizer.ggml.tokens", 9, gstrs(&["a", "b", "ab", "<s>"])),
            ("tokenizer.ggml.merges", 9, gstrs(&["a b"])),
            ("tokenizer.ggml.bos_token_id", 4, u32v(3)),
            ("tokenizer.ggml.eos_token_id", 4, u32v(3)),
        ]
    };
    // One Q8_0 block: an f16 scale (1.0) and 32 signed bytes.
    let mut q8 = 0x3c00u16.to_le_bytes().to_vec();
    q8.extend((0..32).map(|i| i as u8));
    let tensors: Vec<(&str, &[u64], u32, Vec<u8>)> = vec![
        ("token_embd.weight", &[8u64, 4][..], 0, f32s(32)),
        ("output_norm.weight", &[8u64][..], 0, f32s(8)),
        ("blk.0.ffn_up.weight", &[32u64, 1][..], 8, q8),
    ];
    write("gguf_header", "llama.gguf", &gguf(&kv("llama"), &tensors));
    let qwen: Vec<_> = kv("qwen2")
        .into_iter()
        .map(|(k, t, v)| (k.replace("llama.", "qwen2."), t, v))
        .collect();
    let qwen: Vec<(&str, u32, Vec<u8>)> = qwen
        .iter()
        .map(|(k, t, v)| (k.as_str(), *t, v.clone()))
        .collect();
    write("gguf_header", "qwen2.gguf", &gguf(&qwen, &tensors[..2]));
    let full = gguf(&kv("llama"), &tensors);
    write("gguf_header", "truncated.gguf", &full[..full.len() / 2]);

    let t = "safetensors_header";
    let bytes = |n: usize, w: usize| vec![0x3fu8; n * w];
    let mut views = Vec::new();
    let specs = [
        (
            "model.embed_tokens.weight",
            safetensors::Dtype::BF16,
            vec![4, 8],
            bytes(32, 2),
        ),
        (
            "model.norm.weight",
            safetensors::Dtype::F32,
            vec![8],
            bytes(8, 4),
        ),
        (
            "lm_head.weight",
            safetensors::Dtype::F16,
            vec![4, 8],
            bytes(32, 2),
        ),
        (
            "position_ids",
            safetensors::Dtype::I64,
            vec![2],
            bytes(2, 8),
        ),
    ];
    for (name, dtype, shape, data) in &specs {
        views.push((
            name.to_string(),
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).expect("a view"),
        ));
    }
    let st = safetensors::serialize(views, None).expect("serialize");
    write(t, "model.safetensors", &st);
    let header = br#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    let mut hand = (header.len() as u64).to_le_bytes().to_vec();
    hand.extend(header);
    hand.extend([0u8; 16]);
    write(t, "handwritten.safetensors", &hand);
    write(t, "truncated.safetensors", &st[..st.len() - 10]);

    let t = "model_config";
    write(t, "qwen3-config.json", br#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"rms_norm_eps":1e-6,"rope_theta":1000000,"max_position_embeddings":40960,"vocab_size":151936,"tie_word_embeddings":true,"torch_dtype":"bfloat16","sliding_window":null,"use_sliding_window":false}"#);
    write(t, "llama3-config.json", br#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,"rms_norm_eps":1e-5,"rope_theta":500000.0,"max_position_embeddings":131072,"vocab_size":128256,"tie_word_embeddings":false,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},"attention_bias":false,"mlp_bias":false}"#);
    write(t, "qwen2-config.json", br#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"max_position_embeddings":32768,"vocab_size":151936,"tie_word_embeddings":true,"sliding_window":4096,"use_sliding_window":false,"max_window_layers":28}"#);
    write(t, "generation-config.json", br#"{"bos_token_id":151643,"eos_token_id":[151645,151643],"pad_token_id":151643,"do_sample":true,"temperature":0.6,"top_k":20,"top_p":0.95,"repetition_penalty":1.0}"#);
}

fn frames() {
    let t = "kv_transfer_frames";
    let put = |id: u64, off: u64, data: &[u8]| {
        let mut f = vec![1u8];
        f.extend(id.to_le_bytes());
        f.extend(off.to_le_bytes());
        f.extend((data.len() as u64).to_le_bytes());
        f.extend(data);
        f
    };
    let flush = |seq: u64| {
        let mut f = vec![2u8];
        f.extend(seq.to_le_bytes());
        f
    };
    let notify = |p: &[u8]| {
        let mut f = vec![3u8];
        f.extend((p.len() as u32).to_le_bytes());
        f.extend(p);
        f
    };
    let session = [
        put(1, 0, &[7; 64]),
        put(1, 4032, &[9; 64]),
        flush(1),
        notify(b"lease 42 layer 0 done"),
    ]
    .concat();
    write(t, "session.bin", &session);
    let refused = [
        put(1, 4090, &[1; 16]),
        put(2, 0, &[1; 4]),
        put(1, u64::MAX - 1, &[1; 4]),
        flush(2),
        flush(3),
    ]
    .concat();
    write(t, "refused-puts.bin", &refused);
    write(
        t,
        "unknown-kind.bin",
        &[notify(b"x"), vec![9, 0, 0]].concat(),
    );
    write(t, "truncated.bin", &put(1, 0, &[5; 32])[..40]);

    let t = "kv_transfer_descriptor";
    let mut region = RemoteRegion {
        backend: Backend::Tcp,
        peer: PeerAddress(b"10.0.0.7:7001".to_vec()),
        region_id: 3,
        base: 0x7f00_0000_1000,
        len: 1 << 20,
        rkey: vec![],
        secret: RegionSecret::from_bytes(vec![0x5e; RegionSecret::LEN]),
        memory: MemoryKind::Host,
        check: 0,
    };
    region.seal();
    write(t, "tcp.pb", &region.clone().into_wire().encode_to_vec());
    write(t, "tcp.json", &serde_json::to_vec(&region).expect("json"));
    let mut ucx = RemoteRegion {
        backend: Backend::Ucx,
        peer: PeerAddress(vec![0x11, 0x22, 0x33, 0x44, 0, 1, 2, 3]),
        rkey: vec![0xab; 24],
        secret: RegionSecret::default(),
        memory: MemoryKind::Cuda { device: 1 },
        ..region.clone()
    };
    ucx.seal();
    write(t, "ucx-cuda.pb", &ucx.clone().into_wire().encode_to_vec());
    write(t, "ucx-cuda.json", &serde_json::to_vec(&ucx).expect("json"));
    let unsealed = RemoteRegion { check: 1, ..region };
    write(t, "unsealed.pb", &unsealed.into_wire().encode_to_vec());
}

fn events() {
    let record = |kind: u8, payload: &[u8]| {
        let mut r = vec![kind];
        r.extend((payload.len() as u16).to_le_bytes());
        r.extend(payload);
        r
    };
    let h = ExternalSequenceBlockHash;
    let l = LocalBlockHash;
    let stored = |id: u64, parent: Option<u64>, blocks: &[u64]| KvCacheEvent {
        event_id: id,
        data: KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(h),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|&b| KvCacheStoredBlockData {
                    block_hash: h(b),
                    tokens_hash: l(b + 100),
                })
                .collect(),
        }),
        dp_rank: 0,
    };
    let removed = KvCacheEvent {
        event_id: 3,
        data: KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![h(12)],
        }),
        dp_rank: 0,
    };
    let cleared = KvCacheEvent {
        event_id: 4,
        data: KvCacheEventData::Cleared,
        dp_rank: 0,
    };
    let nats = |worker: u64, ev: &KvCacheEvent| {
        let env = serde_json::json!({"worker_id": worker, "event": ev});
        record(0, &serde_json::to_vec(&env).expect("json"))
    };
    let grpc = |ev: &KvCacheEvent| record(1, &ev.clone().into_wire().encode_to_vec());
    let query = record(3, &[101u64, 111, 112].map(u64::to_le_bytes).concat());
    let t = "kv_events";
    let nats_seq = [
        nats(5, &stored(1, None, &[1, 2])),
        nats(5, &stored(2, Some(2), &[3])),
        nats(5, &removed),
        query.clone(),
        nats(5, &cleared),
    ]
    .concat();
    write(t, "nats.bin", &nats_seq);
    let dump = KvStoredDump {
        last_event_id: 2,
        blocks: vec![
            StoredBlock {
                parent_hash: None,
                block_hash: h(11),
                tokens_hash: l(111),
            },
            StoredBlock {
                parent_hash: Some(h(11)),
                block_hash: h(12),
                tokens_hash: l(112),
            },
        ],
    };
    let grpc_seq = [
        record(2, &dump.into_wire().encode_to_vec()),
        grpc(&removed),
        grpc(&stored(5, Some(11), &[13])),
        grpc(&stored(9, None, &[20])),
        query,
        grpc(&cleared),
    ]
    .concat();
    write(t, "grpc.bin", &grpc_seq);
}

#[test]
#[ignore = "writes the seed corpora; run by hand after changing a format"]
fn seeds() {
    openai();
    config();
    model_files();
    frames();
    events();
}
