"""A checkpoint directory with NO weights for a Qwen3.5/3.6-27B-shaped model, for SGLang's
`--load-format dummy` (random weights initialised on the GPU at start-up).

    python3 build_27b.py OUT

Dimensions: the published Qwen3.5-27B / Qwen3.6-27B config.json (hidden 5120, 64 layers in the
pattern linear,linear,linear,full; 24 query heads, 4 KV heads, head_dim 256, attention output
gate; Gated-DeltaNet 16 key heads x 128, 48 value heads x 128, conv 4; intermediate 17408;
vocab 248320; one MTP layer; the 27-layer 1152-wide vision tower). The tokenizer is the small
byte-level BPE of bench/real_sglang/build_model.py, padded with filler tokens to 248320 ids so
that every id the random model samples decodes to text (detokenizer work like a real model's).
"""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build_model as bm  # noqa: E402

VOCAB = 248320


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    fast = bm.build_tokenizer(out, 8192)
    tj_path = out / "tokenizer.json"
    tj = json.loads(tj_path.read_text())
    vocab = tj["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tj.get("added_tokens", [])}
    i = 0
    for new_id in range(VOCAB):
        if new_id in taken:
            continue
        vocab[f"\u0120w{i}"] = new_id  # decodes to " w<i>"
        i += 1
    tj_path.write_text(json.dumps(tj, ensure_ascii=False))
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast.from_pretrained(out)
    fast.chat_template = bm.CHAT_TEMPLATE
    assert len(fast) == VOCAB, len(fast)
    print("tokenizer:", len(fast), "ids; id 200000 ->", repr(fast.decode([200000, 200001])))

    config = bm.qwen3_5_config(fast, Namespace(hidden=5120, layers=64, vocab=8192))
    text = config["text_config"]
    text.update(
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=262144,
        vocab_size=VOCAB,
    )
    text["rope_parameters"] = {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
    }
    config["vision_config"].update(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        num_position_embeddings=2304,
        out_hidden_size=5120,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": fast.eos_token_id,
                "pad_token_id": fast.pad_token_id,
                "do_sample": True,
                "temperature": 1.0,
            },
            indent=2,
        )
    )
    try:
        bm.save_processor(out, fast)
    except Exception as exc:  # SGLang may still start without it
        print(f"processor not saved: {exc!r}")
    # save_processor re-saves the tokenizer: check the padding survived.
    again = PreTrainedTokenizerFast.from_pretrained(out)
    assert len(again) == VOCAB, len(again)
    t = text
    attn = 16 * (5120 * (24 * 256 * 2 + 2 * 4 * 256) + 24 * 256 * 5120)
    gdn = 48 * (
        5120 * (16 * 128 * 2 + 48 * 128) + 5120 * 48 * 128 + 2 * 5120 * 48 + 48 * 128 * 5120
    )
    mlp = 64 * 3 * 5120 * t["intermediate_size"]
    emb = 2 * VOCAB * 5120
    params = attn + gdn + mlp + emb
    print(f"text params ~{params / 1e9:.2f}B (bf16 {params * 2 / 2**30:.1f} GiB)")
    print("saved", out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
