//! The tiny random LLaVA model (`tandem model tiny-vl OUT_DIR`): a CLIP vision tower, the
//! two-layer GELU projector and the tiny Llama's decoder, in the folder layout of
//! `llava-hf/llava-1.5-7b-hf`, which transformers' `LlavaForConditionalGeneration` and
//! `AutoProcessor` (`LlavaProcessor` with a `CLIPImageProcessor`) load:
//! - `config.json` (`model_type: "llava"`, a Llama `text_config`, a CLIP `vision_config`);
//! - `model.safetensors` under the Hub's legacy names (`vision_tower.vision_model.*`,
//!   `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`),
//!   f32, from the crate's PRNG ([`crate::weights`]);
//! - the real Qwen3 tokenizer files with `<image>` added as a special token
//!   ([`IMAGE_TOKEN_ID`], the next free id) and a LLaVA-1.5 chat template
//!   ([`TINY_VL_CHAT_TEMPLATE`], also in `chat_template.json`);
//! - `preprocessor_config.json`, `processor_config.json` and `generation_config.json`.
//!
//! Vision tower: 56×56 images in 14×14 patches, so 16 patches plus the class token; LLaVA
//! takes the hidden state before the last of its 3 layers (`vision_feature_layer: -2`) and
//! drops the class token (`"default"`), so each image is [`TINY_VL_IMAGE_TOKENS`] = 16 tokens
//! of the decoder's width.

use std::path::{Path, PathBuf};

use tandem_config::paths::cache_dir;

use crate::shapes::DecoderShape;
use crate::tokenizer::ensure_tokenizer_files;
use crate::write::{generation_config, pretty, random_tensors, serialize_safetensors, write_file};
use crate::{
    build_once, family_config_json, family_dims, random_init, Family, TinyDims, TinyModelError,
    WeightDtype,
};

/// Bump when the tiny LLaVA's generator output changes (the cache folder name carries it).
pub const TINY_VL_VERSION: u32 = 1;
/// Seed of the tiny LLaVA's weights.
pub const TINY_VL_SEED: u64 = 0x7a4d_656d_2024_0200;
/// The image placeholder token of the prompt, expanded by the processor into
/// [`TINY_VL_IMAGE_TOKENS`] copies.
pub const IMAGE_TOKEN: &str = "<image>";
/// Its id: the first id after the Qwen3 tokenizer's own (151,643 BPE tokens and 26 added ones,
/// the last `</think>` = 151,668). Within the decoder's vocab of 151,936.
pub const IMAGE_TOKEN_ID: u32 = 151_669;

/// Dimensions of a CLIP vision tower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VisionDims {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub channels: usize,
    pub projection_dim: usize,
}

impl VisionDims {
    /// Patches per image.
    pub const fn patches(&self) -> usize {
        let side = self.image_size / self.patch_size;
        side * side
    }
}

/// The tiny LLaVA's vision tower.
pub const TINY_VL_VISION: VisionDims = VisionDims {
    hidden: 32,
    intermediate: 64,
    layers: 3,
    heads: 2,
    image_size: 56,
    patch_size: 14,
    channels: 3,
    projection_dim: 32,
};

/// Image tokens per image in the prompt (`image_seq_length`): the patches, without the class
/// token.
pub const TINY_VL_IMAGE_TOKENS: usize = TINY_VL_VISION.patches();

/// The tiny LLaVA's decoder: the tiny Llama family model's dims ([`family_dims`]) with
/// Qwen3's vocab of 151,936, so that every id of the tokenizer, `<image>` included, has an
/// embedding; untied lm_head.
pub fn tiny_vl_text_dims() -> TinyDims {
    TinyDims {
        vocab: 151_936,
        tied: false,
        ..family_dims(Family::Llama)
    }
}

/// CLIP's image normalisation (OpenAI CLIP, as llava-1.5's `preprocessor_config.json`).
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// `config.json` of the tiny LLaVA, shaped like llava-1.5-7b-hf's.
pub fn tiny_vl_config_json() -> serde_json::Value {
    let v = TINY_VL_VISION;
    let text = family_config_json(Family::Llama, &tiny_vl_text_dims(), "float32");
    serde_json::json!({
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_seq_length": TINY_VL_IMAGE_TOKENS,
        "image_token_index": IMAGE_TOKEN_ID,
        "model_type": "llava",
        "multimodal_projector_bias": true,
        "pad_token_id": 151643,
        "projector_hidden_act": "gelu",
        "text_config": text,
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
        "vision_config": {
            "model_type": "clip_vision_model",
            "attention_dropout": 0.0,
            "hidden_act": "quick_gelu",
            "hidden_size": v.hidden,
            "image_size": v.image_size,
            "intermediate_size": v.intermediate,
            "layer_norm_eps": 1e-5,
            "num_attention_heads": v.heads,
            "num_channels": v.channels,
            "num_hidden_layers": v.layers,
            "patch_size": v.patch_size,
            "projection_dim": v.projection_dim
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default"
    })
}

/// Every tensor of the tiny LLaVA (Hub legacy names and shapes), in the order written:
/// the vision tower, the projector, then the decoder's (the tiny Llama's names under
/// `language_model.`).
pub fn tiny_vl_tensor_shapes() -> Vec<(String, Vec<usize>)> {
    let v = TINY_VL_VISION;
    let d = tiny_vl_text_dims();
    let (h, im) = (v.hidden, v.intermediate);
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    let mut push = |name: String, shape: Vec<usize>| out.push((name, shape));
    let vm = "vision_tower.vision_model";
    push(format!("{vm}.embeddings.class_embedding"), vec![h]);
    push(
        format!("{vm}.embeddings.patch_embedding.weight"),
        vec![h, v.channels, v.patch_size, v.patch_size],
    );
    push(
        format!("{vm}.embeddings.position_embedding.weight"),
        vec![v.patches() + 1, h],
    );
    for p in ["weight", "bias"] {
        push(format!("{vm}.pre_layrnorm.{p}"), vec![h]);
    }
    for l in 0..v.layers {
        let lp = format!("{vm}.encoder.layers.{l}");
        for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            push(format!("{lp}.self_attn.{proj}.weight"), vec![h, h]);
            push(format!("{lp}.self_attn.{proj}.bias"), vec![h]);
        }
        for ln in ["layer_norm1", "layer_norm2"] {
            for p in ["weight", "bias"] {
                push(format!("{lp}.{ln}.{p}"), vec![h]);
            }
        }
        push(format!("{lp}.mlp.fc1.weight"), vec![im, h]);
        push(format!("{lp}.mlp.fc1.bias"), vec![im]);
        push(format!("{lp}.mlp.fc2.weight"), vec![h, im]);
        push(format!("{lp}.mlp.fc2.bias"), vec![h]);
    }
    for p in ["weight", "bias"] {
        push(format!("{vm}.post_layernorm.{p}"), vec![h]);
    }
    push(
        "multi_modal_projector.linear_1.weight".into(),
        vec![d.hidden, h],
    );
    push("multi_modal_projector.linear_1.bias".into(), vec![d.hidden]);
    push(
        "multi_modal_projector.linear_2.weight".into(),
        vec![d.hidden, d.hidden],
    );
    push("multi_modal_projector.linear_2.bias".into(), vec![d.hidden]);
    let decoder = DecoderShape {
        vocab_size: d.vocab,
        hidden_size: d.hidden,
        intermediate_size: d.intermediate,
        num_hidden_layers: d.layers,
        num_attention_heads: d.heads,
        num_key_value_heads: d.kv_heads,
        head_dim: d.head_dim,
        tie_word_embeddings: d.tied,
        qk_norm: false,
        qkv_bias: false,
        o_bias: false,
    };
    for (name, shape) in decoder.tensor_shapes() {
        push(format!("language_model.{name}"), shape);
    }
    out
}

/// Mean and std of a tiny LLaVA tensor. The decoder's follow [`random_init`] (by their
/// names without the `language_model.` prefix). In the vision tower and projector: layer
/// norm weights N(1, 0.1²) and biases N(0, 0.1²) (so that a missed or misplaced norm
/// shows); the patch convolution 1/sqrt(3·14·14) (its fan-in), so that normalised pixels
/// give O(1) patch embeddings; position embeddings N(0, 0.3²), large enough to matter beside
/// them; the class embedding N(0, 1); linear weights 1/sqrt(fan_in) and biases N(0, 0.3²) as
/// the decoders'. Activations stay O(1) through the tower and the projector.
pub fn tiny_vl_init(name: &str, shape: &[usize]) -> (f32, f32) {
    if let Some(rest) = name.strip_prefix("language_model.") {
        return random_init(rest, shape);
    }
    let is_norm = name.contains("layer_norm")
        || name.contains("pre_layrnorm")
        || name.contains("post_layernorm");
    if is_norm && name.ends_with(".weight") {
        (1.0, 0.1)
    } else if is_norm {
        (0.0, 0.1)
    } else if name.ends_with("class_embedding") {
        (0.0, 1.0)
    } else if name.ends_with("position_embedding.weight") || name.ends_with(".bias") {
        (0.0, 0.3)
    } else {
        // Linear [out, in] and the patch convolution [out, channels, k, k]: fan-in is the
        // product of all dims but the first.
        let fan_in = shape.iter().skip(1).product::<usize>().max(1);
        (0.0, 1.0 / (fan_in as f32).sqrt())
    }
}

/// Writes the tiny LLaVA's weights (`model.safetensors`, f32), `config.json` and
/// `generation_config.json` into `out_dir` (created if absent); no tokenizer or processor
/// files ([`write_tiny_vl_model`] writes those too).
pub fn write_tiny_vl_weights(out_dir: &Path) -> Result<(), TinyModelError> {
    std::fs::create_dir_all(out_dir).map_err(|e| TinyModelError::io(out_dir, e))?;
    let dtype = WeightDtype::F32;
    let tensors = random_tensors(&tiny_vl_tensor_shapes(), TINY_VL_SEED, dtype, tiny_vl_init);
    let st_path = out_dir.join("model.safetensors");
    write_file(&st_path, &serialize_safetensors(&st_path, &tensors, dtype)?)?;
    write_file(
        &out_dir.join("config.json"),
        &pretty(&tiny_vl_config_json()),
    )?;
    write_file(
        &out_dir.join("generation_config.json"),
        &pretty(&generation_config()),
    )
}

/// Writes the whole tiny LLaVA folder into `out_dir` (created if absent): weights and
/// configs ([`write_tiny_vl_weights`]), the Qwen3 tokenizer files (fetched into the cache
/// first if needed) with `<image>` added and the LLaVA chat template, and the processor's
/// configs.
pub fn write_tiny_vl_model(out_dir: &Path) -> Result<(), TinyModelError> {
    let tok_dir = ensure_tokenizer_files()?;
    write_tiny_vl_weights(out_dir)?;
    write_vl_tokenizer_files(&tok_dir, out_dir)?;
    write_file(
        &out_dir.join("chat_template.json"),
        &pretty(&serde_json::json!({ "chat_template": TINY_VL_CHAT_TEMPLATE })),
    )?;
    write_file(
        &out_dir.join("preprocessor_config.json"),
        &pretty(&preprocessor_config()),
    )?;
    write_file(
        &out_dir.join("processor_config.json"),
        &pretty(&processor_config()),
    )
}

/// The tiny LLaVA's folder in the cache, built there if absent (see
/// [`crate::ensure_tiny_model`]).
pub fn ensure_tiny_vl_model() -> Result<PathBuf, TinyModelError> {
    let dir = cache_dir().join(format!("tiny-llava-v{TINY_VL_VERSION}"));
    build_once(&dir, write_tiny_vl_model)?;
    Ok(dir)
}

/// The chat template, modelled on llava-1.5-7b-hf's: `ROLE: ` before each non-system
/// message; for a list content, `<image>\n` for each `{"type": "image"}` or
/// `{"type": "image_url"}` part first, then each `{"type": "text"}` part's text and a space;
/// a string content as it is, and a space; `ASSISTANT:` as the generation prompt. One user
/// message with an image and a text gives `USER: <image>\nWhat is this? ASSISTANT:`.
/// Written on one line with plain `if`/`for` so that Jinja2 and minijinja render it alike.
pub const TINY_VL_CHAT_TEMPLATE: &str = concat!(
    "{% for message in messages %}",
    "{% if message['role'] != 'system' %}{{ message['role'] | upper }}{{ ': ' }}{% endif %}",
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}",
    "{% else %}",
    "{% for part in message['content'] %}",
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<image>\\n' }}{% endif %}",
    "{% endfor %}",
    "{% for part in message['content'] %}",
    "{% if part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}",
    "{% endfor %}",
    "{% endif %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
);

/// `preprocessor_config.json`: llava-1.5's `CLIPImageProcessor` settings at 56 pixels
/// (resize the shortest edge to 56 with bicubic, centre crop 56×56, rescale by 1/255,
/// normalise with CLIP's mean and std).
fn preprocessor_config() -> serde_json::Value {
    let s = TINY_VL_VISION.image_size;
    serde_json::json!({
        "crop_size": { "height": s, "width": s },
        "do_center_crop": true,
        "do_convert_rgb": true,
        "do_normalize": true,
        "do_rescale": true,
        "do_resize": true,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": CLIP_STD,
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": { "shortest_edge": s }
    })
}

/// `processor_config.json`: the `LlavaProcessor`'s image token and how many tokens it
/// expands to ((56/14)² patches + 1 class token, less the class token for `"default"`).
fn processor_config() -> serde_json::Value {
    serde_json::json!({
        "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1,
        "patch_size": TINY_VL_VISION.patch_size,
        "processor_class": "LlavaProcessor",
        "vision_feature_select_strategy": "default"
    })
}

/// The Qwen3 tokenizer files from `from_dir` with `<image>` added as a special token (id
/// [`IMAGE_TOKEN_ID`], checked to be the next free one) and the LLaVA chat template, written
/// into `out_dir`.
fn write_vl_tokenizer_files(from_dir: &Path, out_dir: &Path) -> Result<(), TinyModelError> {
    let read_json = |name: &str| -> Result<serde_json::Value, TinyModelError> {
        let path = from_dir.join(name);
        let bytes = std::fs::read(&path).map_err(|e| TinyModelError::io(&path, e))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| TinyModelError::Config(format!("{}: {e}", path.display())))
    };
    let bad = |what: &str| TinyModelError::Config(format!("Qwen3 tokenizer files: {what}"));

    let mut tok = read_json("tokenizer.json")?;
    let max_vocab_id = tok
        .pointer("/model/vocab")
        .and_then(|v| v.as_object())
        .ok_or_else(|| bad("tokenizer.json has no model.vocab"))?
        .values()
        .filter_map(|v| v.as_u64())
        .max();
    let added = tok
        .get_mut("added_tokens")
        .and_then(|a| a.as_array_mut())
        .ok_or_else(|| bad("tokenizer.json has no added_tokens"))?;
    let max_added_id = added
        .iter()
        .filter_map(|t| t.get("id").and_then(|i| i.as_u64()))
        .max();
    let next_free = max_vocab_id.max(max_added_id).map_or(0, |m| m + 1);
    if next_free != u64::from(IMAGE_TOKEN_ID) {
        return Err(bad(&format!(
            "the next free id is {next_free}, not {IMAGE_TOKEN_ID}"
        )));
    }
    added.push(serde_json::json!({
        "id": IMAGE_TOKEN_ID,
        "content": IMAGE_TOKEN,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": true
    }));

    let mut cfg = read_json("tokenizer_config.json")?;
    let c = cfg
        .as_object_mut()
        .ok_or_else(|| bad("tokenizer_config.json is not an object"))?;
    c.get_mut("added_tokens_decoder")
        .and_then(|d| d.as_object_mut())
        .ok_or_else(|| bad("tokenizer_config.json has no added_tokens_decoder"))?
        .insert(
            IMAGE_TOKEN_ID.to_string(),
            serde_json::json!({
                "content": IMAGE_TOKEN,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true
            }),
        );
    if let Some(list) = c
        .get_mut("additional_special_tokens")
        .and_then(|l| l.as_array_mut())
    {
        list.push(IMAGE_TOKEN.into());
    }
    c.insert("chat_template".into(), TINY_VL_CHAT_TEMPLATE.into());

    write_file(&out_dir.join("tokenizer.json"), &pretty(&tok))?;
    write_file(&out_dir.join("tokenizer_config.json"), &pretty(&cfg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// sha256 of the tiny LLaVA's `model.safetensors`. Changing the generator changes it:
    /// bump [`TINY_VL_VERSION`] and remake the goldens (`scripts/goldens/llava.py`).
    const TINY_VL_WEIGHTS_SHA256: &str =
        "46c7126ddc31d74e4527ba97b96023bdec0598df3953e6cfea649e119f6e0e46";

    fn sha256_hex(bytes: &[u8]) -> String {
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("tandem-tiny-vl-{name}-{}", std::process::id()))
    }

    #[test]
    fn weights_are_deterministic_and_pinned() {
        let (a, b) = (temp("a"), temp("b"));
        write_tiny_vl_weights(&a).unwrap();
        write_tiny_vl_weights(&b).unwrap();
        let wa = std::fs::read(a.join("model.safetensors")).unwrap();
        let wb = std::fs::read(b.join("model.safetensors")).unwrap();
        assert!(wa == wb, "two writes differ");
        assert_eq!(sha256_hex(&wa), TINY_VL_WEIGHTS_SHA256);
        std::fs::remove_dir_all(&a).unwrap();
        std::fs::remove_dir_all(&b).unwrap();
    }

    #[test]
    fn tensors_have_the_hub_names_and_shapes() {
        let dir = temp("shapes");
        write_tiny_vl_weights(&dir).unwrap();
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let want = tiny_vl_tensor_shapes();
        assert_eq!(st.names().len(), want.len());
        for (name, shape) in &want {
            let t = st.tensor(name).unwrap();
            assert_eq!(t.shape(), &shape[..], "{name}");
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        }
        let shape = |n: &str| {
            want.iter()
                .find(|(name, _)| name == n)
                .map(|(_, s)| s.clone())
                .unwrap_or_else(|| panic!("no tensor {n}"))
        };
        let vm = "vision_tower.vision_model";
        assert_eq!(shape(&format!("{vm}.embeddings.class_embedding")), [32]);
        assert_eq!(
            shape(&format!("{vm}.embeddings.patch_embedding.weight")),
            [32, 3, 14, 14]
        );
        assert_eq!(
            shape(&format!("{vm}.embeddings.position_embedding.weight")),
            [17, 32]
        );
        assert_eq!(shape(&format!("{vm}.pre_layrnorm.bias")), [32]);
        assert_eq!(shape(&format!("{vm}.post_layernorm.weight")), [32]);
        for l in 0..3 {
            let lp = format!("{vm}.encoder.layers.{l}");
            assert_eq!(shape(&format!("{lp}.self_attn.out_proj.weight")), [32, 32]);
            assert_eq!(shape(&format!("{lp}.self_attn.k_proj.bias")), [32]);
            assert_eq!(shape(&format!("{lp}.layer_norm2.bias")), [32]);
            assert_eq!(shape(&format!("{lp}.mlp.fc1.weight")), [64, 32]);
            assert_eq!(shape(&format!("{lp}.mlp.fc1.bias")), [64]);
            assert_eq!(shape(&format!("{lp}.mlp.fc2.weight")), [32, 64]);
            assert_eq!(shape(&format!("{lp}.mlp.fc2.bias")), [32]);
        }
        assert_eq!(shape("multi_modal_projector.linear_1.weight"), [64, 32]);
        assert_eq!(shape("multi_modal_projector.linear_2.weight"), [64, 64]);
        assert_eq!(shape("multi_modal_projector.linear_2.bias"), [64]);
        assert_eq!(
            shape("language_model.model.embed_tokens.weight"),
            [151_936, 64]
        );
        assert_eq!(
            shape("language_model.model.layers.1.self_attn.k_proj.weight"),
            [16, 64]
        );
        assert_eq!(shape("language_model.model.norm.weight"), [64]);
        assert_eq!(shape("language_model.lm_head.weight"), [151_936, 64]);
        assert!(!want.iter().any(|(n, _)| n.contains("patch_embedding.bias")));

        // Norms near 1 but not 1, biases small but not 0.
        let values = |n: &str| -> Vec<f32> {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let ln = values(&format!("{vm}.encoder.layers.0.layer_norm1.weight"));
        assert!(ln.iter().all(|v| (v - 1.0).abs() < 0.5) && ln.iter().any(|v| *v != 1.0));
        let lb = values(&format!("{vm}.pre_layrnorm.bias"));
        assert!(lb.iter().all(|v| v.abs() < 0.5) && lb.iter().any(|v| *v != 0.0));

        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg, tiny_vl_config_json());
        assert_eq!(cfg["image_token_index"], IMAGE_TOKEN_ID);
        assert_eq!(cfg["image_seq_length"], 16);
        assert_eq!(cfg["text_config"]["model_type"], "llama");
        assert_eq!(cfg["text_config"]["vocab_size"], 151_936);
        assert_eq!(cfg["vision_config"]["model_type"], "clip_vision_model");
        // The decoder's tensors are the ones its config names.
        let text: Vec<_> = crate::shapes::tensor_shapes(&cfg["text_config"])
            .unwrap()
            .into_iter()
            .map(|(n, s)| (format!("language_model.{n}"), s))
            .collect();
        assert!(text.iter().all(|t| want.contains(t)));
        assert_eq!(
            want.iter()
                .filter(|(n, _)| n.starts_with("language_model."))
                .count(),
            text.len()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The committed transformers goldens (`goldens/llava/`, `scripts/goldens/llava.py`) were
    /// made from these weights, and transformers' processor made the same ids as the
    /// tokenizer here (with `<image>` expanded to 16 tokens).
    #[test]
    fn goldens_match_the_weights_and_the_tokenizer() {
        let gold = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/llava");
        let dir = temp("gold");
        write_tiny_vl_model(&dir).unwrap();
        let tok = tandem_text::Tokenizer::load(&dir).unwrap();
        for sub in ["", "cuda"] {
            let path = gold.join(sub).join("manifest.json");
            let m: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            assert_eq!(
                m["weights_sha256"],
                TINY_VL_WEIGHTS_SHA256,
                "{}",
                path.display()
            );
            assert_eq!(m["image_token_index"], IMAGE_TOKEN_ID);
            let cases = m["cases"].as_array().unwrap();
            assert_eq!(cases.len(), 3);
            for case in cases {
                let prompt = case["prompt"].as_str().unwrap();
                let expanded = prompt.replace(IMAGE_TOKEN, &IMAGE_TOKEN.repeat(16));
                let ids = tok.encode(&expanded, false).unwrap();
                let want: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
                assert_eq!(ids, want, "{}", case["case"]);
                let n_images = case["n_images"].as_u64().unwrap() as usize;
                let n = ids.iter().filter(|i| **i == IMAGE_TOKEN_ID).count();
                assert_eq!(n, n_images * TINY_VL_IMAGE_TOKENS);
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tokenizer_has_the_image_token_and_the_llava_template() {
        let dir = temp("tok");
        write_tiny_vl_model(&dir).unwrap();
        for f in [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.json",
            "preprocessor_config.json",
            "processor_config.json",
        ] {
            assert!(dir.join(f).is_file(), "{f}");
        }
        let tok = tandem_text::Tokenizer::load(&dir).unwrap();
        assert_eq!(tok.token_to_id(IMAGE_TOKEN), Some(IMAGE_TOKEN_ID));
        assert_eq!(tok.encode(IMAGE_TOKEN, false).unwrap(), [IMAGE_TOKEN_ID]);
        let ids = tok.encode("USER: <image>\nWhat is this?", false).unwrap();
        assert_eq!(ids.iter().filter(|i| **i == IMAGE_TOKEN_ID).count(), 1);
        // The Qwen3 tokens keep their ids.
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(151_645));
        assert_eq!(tok.token_to_id("</think>"), Some(151_668));
        assert!((IMAGE_TOKEN_ID as usize) < tiny_vl_text_dims().vocab);

        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap())
                .unwrap();
        assert_eq!(
            cfg["added_tokens_decoder"][IMAGE_TOKEN_ID.to_string()]["content"],
            IMAGE_TOKEN
        );
        assert_eq!(cfg["added_tokens_decoder"]["151669"]["special"], true);

        let template = tandem_text::ChatTemplate::load(&dir).unwrap().unwrap();
        let render = |messages: serde_json::Value| {
            template
                .render(&tandem_text::ChatRequest {
                    messages: &messages,
                    add_generation_prompt: true,
                    ..Default::default()
                })
                .unwrap()
        };
        assert_eq!(
            render(serde_json::json!([{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image"}
            ]}])),
            "USER: <image>\nWhat is this? ASSISTANT:"
        );
        assert_eq!(
            render(serde_json::json!([
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                    {"type": "image"},
                    {"type": "text", "text": "Compare."}
                ]},
                {"role": "assistant", "content": "Same."},
                {"role": "user", "content": "Sure?"}
            ])),
            "USER: <image>\n<image>\nCompare. ASSISTANT: Same. USER: Sure? ASSISTANT:"
        );
        let chat: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("chat_template.json")).unwrap())
                .unwrap();
        assert_eq!(chat["chat_template"], TINY_VL_CHAT_TEMPLATE);
        let proc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("processor_config.json")).unwrap())
                .unwrap();
        assert_eq!(proc["image_token"], IMAGE_TOKEN);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
