#!/usr/bin/env python3
"""SentencePiece (`tokenizer.ggml.model = llama`) goldens for shared/engine/tests/gguf_spm.rs.

Trains a small SentencePiece BPE model as Llama's is configured (identity normalization, no
whitespace collapsing, a dummy prefix, byte fallback), writes its vocabulary into a GGUF the way
llama.cpp's converter does (tokens, scores, token types, bos/eos/unk ids; no tensors) as
shared/engine/tests/goldens/gguf/spm_vocab.gguf, and the ids `sentencepiece` itself gives for a
few texts as spm_ids.json. The engine's tokenizer built from that GGUF must give the same ids.

    pip install gguf numpy sentencepiece
    python3 scripts/goldens/make_gguf_spm_goldens.py
"""
import io
import json
import os

import sentencepiece as spm
from gguf import GGUFWriter, TokenType

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "engine", "tests", "goldens", "gguf")

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! Tokenizers split text into pieces, and pieces into ids.",
    "Numbers like 12345 and 2026 appear; so do symbols: #, %, & and (parentheses).",
    "A quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Byte fallback covers characters the vocabulary lacks, like é or 東京.",
] * 20

TEXTS = [
    "The capital of France is",
    "Hello world!  Two spaces, and a\nnewline.",
    " leading space and trailing ",
    "Unseen: ü, 東京, and emoji 🙂.",
    "12345 + 678 = 13023",
]


def main():
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=480, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, byte_fallback=True, character_coverage=1.0,
        split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            t = TokenType.UNKNOWN
        elif sp.is_control(i):
            t = TokenType.CONTROL
        elif sp.is_unused(i):
            t = TokenType.UNUSED
        elif sp.is_byte(i):
            t = TokenType.BYTE
        else:
            t = TokenType.NORMAL
        types.append(int(t))
    os.makedirs(OUT, exist_ok=True)
    w = GGUFWriter(os.path.join(OUT, "spm_vocab.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cases = [{"text": t, "ids": sp.encode(t)} for t in TEXTS]
    for c in cases:
        assert sp.decode(c["ids"]) == c["text"], c
    with open(os.path.join(OUT, "spm_ids.json"), "w") as f:
        json.dump({"generator": "scripts/goldens/make_gguf_spm_goldens.py", "bos_id": sp.bos_id(),
                   "cases": cases}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
