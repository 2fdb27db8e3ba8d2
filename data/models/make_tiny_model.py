"""Write a tiny random Qwen3-shaped model directory that real SGLang can serve on CPU.

    python data/models/make_tiny_model.py OUT_DIR      # needs the `tokenizers` package

Nothing is downloaded: ``config.json`` describes a two-layer Qwen3 (hidden 64, 4 heads); SGLang
fills the weights at random with ``--load-format dummy``, so the directory has no weight files. The
byte-level BPE tokenizer is trained here from the words of the bundled sample datasets plus
generated words; the chat template is the demo model's (Qwen3's layout: ``<think>`` blocks opened
and closed, ``enable_thinking=False`` closes an empty one). Deterministic: the same files each run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # the SGLang env has it

HERE = Path(__file__).resolve().parent
SAMPLES = HERE.parent / "samples"
DEMO_TOKENIZER_CONFIG = HERE / "demo" / "tokenizer_config.json"

# Token ids as the template and the server see them; ordinary tokens follow.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]
VOCAB = 4096
CONTEXT = 2048

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "max_position_embeddings": CONTEXT,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def corpus_words() -> list[str]:
    """A few thousand words: those of the sample prompts plus syllable words, in a fixed order."""
    words: set[str] = set()
    for path in sorted(SAMPLES.glob("*.jsonl")):
        words.update(re.findall(r"[A-Za-z]+|[0-9]+|[^\sA-Za-z0-9]", path.read_text(encoding="utf-8")))
    syllables = ["ka", "lo", "mi", "ren", "tas", "vo", "quel", "zu", "bri", "on", "ed", "ing"]
    words.update(a + b + c for a in syllables for b in syllables for c in ["", *syllables])
    return sorted(words)


def build_tokenizer(out: Path) -> int:
    """Train the BPE tokenizer and write tokenizer.json; returns its vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(THINK), special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    words = corpus_words()
    # Sentences (words with spaces) teach the merges for " word" as generation produces it.
    lines = [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
    tok.train_from_iterator(lines * 3, trainer)
    tok.add_tokens(THINK)  # not special: reasoning parsers look for them in the decoded text
    tok.save(str(out / "tokenizer.json"))
    return int(tok.get_vocab_size())


def tokenizer_config(vocab: dict[str, int]) -> dict[str, object]:
    template = json.loads(DEMO_TOKENIZER_CONFIG.read_text())["chat_template"]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": CONTEXT,
        "added_tokens_decoder": {
            str(vocab[t]): {"content": t, "special": t in SPECIAL, "lstrip": False, "rstrip": False,
                            "normalized": False, "single_word": False}
            for t in SPECIAL + THINK
        },
        "chat_template": template,
    }


def make(out: Path) -> Path:
    """Write the model directory ``out`` (created if missing) and return it."""
    out.mkdir(parents=True, exist_ok=True)
    size = build_tokenizer(out)
    if size > VOCAB:
        raise RuntimeError(f"tokenizer has {size} tokens, more than vocab_size {VOCAB}")
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    # vocab_size = the tokenizer's: every id the random model samples decodes to text
    config = dict(CONFIG, vocab_size=size, eos_token_id=vocab["<|im_end|>"],
                  bos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(vocab), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [vocab["<|im_end|>"], vocab["<|endoftext|>"]], "do_sample": False}, indent=2) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny_model.py OUT_DIR")
    print(make(Path(sys.argv[1])))
