"""Build a small random-initialised Qwen3 checkpoint and a byte-level BPE tokenizer with a chat
template, for running `transformers serve` where no weights can be downloaded.

    python bench/h200_model.py /tmp/model [--layers 16 --hidden 1024]

Random weights rarely emit the end token, so completions run to max_tokens: a steady,
predictable decode load for throughput and power measurements (the text is noise).
"""

from __future__ import annotations

import argparse
import time

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    words = (
        "the quick brown fox jumps over the lazy dog while engineers measure power and "
        "throughput of a language model server on a graphics processor with batching "
        "explain summarise translate write prove compare describe plan list why how what"
    ).split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(2000)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    started = time.monotonic()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(args.out)

    heads = max(1, args.hidden // 64)
    config = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        do_sample=True,
        temperature=1.0,
        max_new_tokens=64,
    )
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.0f}M parameters, vocab {len(fast)}, saved to {args.out} "
        f"in {time.monotonic() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
