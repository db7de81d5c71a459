"""A tiny random-weight Qwen2 model + word-level tokenizer, built locally (no downloads).

``build_tiny_model(dir)`` writes a directory that ``sglang.launch_server --model-path dir`` (and
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``) load. Everything is derived from a
fixed seed, so the same arguments give the same weights, vocabulary and greedy outputs.

Every generated word is one token (alone or after a space), so a prompt of N space-separated
words from :func:`vocabulary` / :func:`make_prompt` is exactly N prompt tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN,)
_FORMAT = 1  # bump when the files written change, so cached model dirs are rebuilt
# Qwen2's pre-tokenizer split (a public constant of the Qwen2 tokenizer format).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")


def vocabulary(vocab_words: int = 512, *, seed: int = 0) -> list[str]:
    """``vocab_words`` distinct lowercase pseudo-words (deterministic in ``seed``)."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < vocab_words:
        n = rng.randint(2, 4)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def make_prompt(n_words: int, *, seed: int = 1, vocab_words: int = 512, vocab_seed: int = 0) -> str:
    """A prompt of exactly ``n_words`` vocabulary words (= ``n_words`` tokens for this model)."""
    words = vocabulary(vocab_words, seed=vocab_seed)
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(n_words))


def _build_tokenizer(words: list[str]):
    """A byte-level BPE tokenizer shaped like Qwen2's, trained until every word is one token.

    transformers 5 loads a ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``, which rebuilds
    a byte-level BPE from the saved vocab + merges with Qwen2's own pre-tokenizer, so the
    tokenizer must have exactly that shape (a word-level model would encode to nothing there).
    Training on each word alone and with a leading space, with an unbounded vocabulary, merges
    every pre-token to one token: ``"word"`` and ``" word"`` (``"Ġword"``) are both in the vocab.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1_000_000,  # never the limit: stop when every word is a single token
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([w for word in words for w in (word, " " + word)], trainer=trainer)
    return tok


def build_tiny_model(
    dir: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab_words: int = 512,
    max_position: int = 4096,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """Write a random Qwen2 model and its tokenizer to ``dir`` and return the path.

    Idempotent: if ``dir`` already holds a model built with the same arguments, it is reused.
    """
    from . import apply

    apply()  # transformers' model classes import torchvision, which needs the CPU shim

    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(dir)
    params = {
        "format": _FORMAT,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate or 4 * hidden,
        "vocab_words": vocab_words,
        "max_position": max_position,
        "seed": seed,
        "dtype": dtype,
    }
    stamp = out / "tiny_model_params.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return out
    out.mkdir(parents=True, exist_ok=True)

    words = vocabulary(vocab_words, seed=seed)
    tok = _build_tokenizer(words)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    eos_id = tok.token_to_id(EOS_TOKEN)
    vocab_size = -(-tok.get_vocab_size() // 64) * 64  # padded, like real checkpoints

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=params["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        # Untied, wider init: greedy outputs vary per prompt with clear logit margins (a tied
        # 0.02-init model just repeats the last prompt token).
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config.torch_dtype = dtype
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.generation_config.do_sample = False

    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    stamp.write_text(json.dumps(params, indent=1))
    return out
