"""Build a small random-initialised checkpoint SGLang can serve where no weights can be fetched.

Run on the GPU machine by `device.sh models` (transformers 5.12.1 from the payload, torch there):

    python bench/real_sglang/build_model.py OUT --arch qwen3       # dense Qwen3ForCausalLM
    python bench/real_sglang/build_model.py OUT --arch qwen3_5 [--no-mtp-out OUT2]
        # Qwen3_5ForConditionalGeneration (Qwen3.5 / Qwen3.6 layout: Gated-DeltaNet linear attention
        # + gated full attention every 4th layer, a tiny vision tower, and an MTP head in `mtp.*`
        # tensors, names as in the Qwen3.5/3.6 checkpoints). --no-mtp-out writes the same
        # checkpoint without the mtp.* tensors (what preflight must refuse).

The tokenizer is a byte-level BPE trained on the fly (with the Qwen chat/vision special tokens)
and a chat template; the weights are random (HF init), so the text is noise and MTP drafts are
almost never accepted (accept length ~1.0): this is for launch, plumbing and throughput tests.
config.json is written by hand from the shape of a real Qwen3.5/3.6 config (HF's config class
drops keys SGLang reads, such as full_attention_interval and attn_output_gate).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def corpus() -> list[str]:
    words = (
        "the quick brown fox jumps over the lazy dog while engineers measure power and "
        "throughput of a language model server on a graphics processor with batching "
        "explain summarise translate write prove compare describe plan list why how what"
    ).split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(2000)]


def build_tokenizer(out: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    # model_max_length as Qwen's own tokenizer_config.json sets it: without it transformers
    # reports 1e30, which SGLang 0.5.15's /v1/tokenize fails to serialize (a 500).
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=262144,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def sampling(fast):
    """Sampled generation (random weights rarely end on their own), 64 new tokens."""
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        do_sample=True,
        temperature=1.0,
        max_new_tokens=64,
    )


def padded(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def build_qwen3(out: Path, args) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fast = build_tokenizer(out, args.vocab)
    heads = max(1, args.hidden // 64)
    config = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=8192,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = sampling(fast)
    model.save_pretrained(out)
    print(f"qwen3: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


def qwen3_5_config(fast, args) -> dict:
    """A real Qwen3.5/3.6 config.json's keys, at toy sizes (27B: hidden 5120, 64 layers)."""
    layers = args.layers
    vocab = padded(len(fast))
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    text = {
        "model_type": "qwen3_5_text",
        "architectures": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": args.hidden,
        "initializer_range": 0.02,
        "intermediate_size": args.hidden * 3,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": max(1, args.hidden // 256),
        "linear_num_value_heads": max(2, args.hidden // 128),
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 32768,
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": max(2, args.hidden // 128),
        "num_hidden_layers": layers,
        "num_key_value_heads": max(1, args.hidden // 512),
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "vocab_size": vocab,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    }
    del text["architectures"]
    vision = {
        "model_type": "qwen3_5",
        "deepstack_visual_indexes": [],
        "depth": 1,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 128,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "num_heads": 2,
        "num_position_embeddings": 256,
        "out_hidden_size": args.hidden,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
        "transformers_version": "5.12.1",
    }


def build_qwen3_5(out: Path, args) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    fast = build_tokenizer(out, args.vocab)
    config_dict = qwen3_5_config(fast, args)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config = sampling(fast)
    model.save_pretrained(out, max_shard_size="50GB")
    # save_pretrained rewrites config.json from HF's class: put the hand-written one back.
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    try:
        save_processor(out, fast)
    except Exception as exc:  # the text path does not need it; SGLang may
        print(f"processor not saved: {exc!r}")

    weights = out / "model.safetensors"
    tensors = load_file(weights)
    main = dict(tensors)
    text = config_dict["text_config"]
    hidden = text["hidden_size"]
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"][0]
    prefix = f"model.language_model.layers.{full}."
    g = torch.Generator().manual_seed(1)
    mtp = {}
    for name, value in tensors.items():
        if name.startswith(prefix):
            fresh = (torch.randn(value.shape, generator=g) * 0.02).to(value.dtype)
            if name.endswith("norm.weight"):
                fresh = torch.zeros_like(value)  # Gemma-style (1 + w) norms
            mtp["mtp.layers.0." + name[len(prefix) :]] = fresh.contiguous()
    mtp["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * 0.02).to(torch.bfloat16)
    for norm in (
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ):
        mtp[norm] = torch.zeros(hidden, dtype=torch.bfloat16)
    meta = {"format": "pt"}
    if args.no_mtp_out:
        other = Path(args.no_mtp_out)
        if other.exists():
            shutil.rmtree(other)
        other.mkdir(parents=True)
        for item in out.iterdir():
            if item.name != "model.safetensors":
                shutil.copy2(item, other / item.name)
        shutil.copy2(weights, other / "model.safetensors")
    save_file({**main, **mtp}, str(weights), metadata=meta)
    total = sum(v.numel() for v in main.values())
    print(
        f"qwen3_5: {total / 1e6:.0f}M parameters + {len(mtp)} mtp.* tensors "
        f"({sum(v.numel() for v in mtp.values()) / 1e6:.1f}M): {sorted(mtp)}"
    )


def save_processor(out: Path, fast) -> None:
    """preprocessor_config.json etc., as a Qwen3.5 checkpoint ships them (SGLang loads the
    processor for a multimodal architecture even when only text is sent)."""
    from transformers import AutoProcessor, Qwen2VLImageProcessorFast, Qwen3VLProcessor

    try:
        from transformers import Qwen3VLVideoProcessor

        video = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    except Exception:  # torchvision/av missing: the processor works without video
        video = None
    image = Qwen2VLImageProcessorFast(patch_size=16, merge_size=2, temporal_patch_size=2)
    kwargs = dict(image_processor=image, tokenizer=fast, chat_template=CHAT_TEMPLATE)
    if video is not None:
        kwargs["video_processor"] = video
    proc = Qwen3VLProcessor(**kwargs)
    proc.save_pretrained(out)
    AutoProcessor.from_pretrained(out)  # fails here, not in SGLang, if it does not load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--arch", choices=["qwen3", "qwen3_5"], default="qwen3_5")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--no-mtp-out", default=None)
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 16 if args.arch == "qwen3" else 8
    started = time.monotonic()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (build_qwen3 if args.arch == "qwen3" else build_qwen3_5)(out, args)
    names = sorted(p.name for p in out.iterdir())
    print(f"saved {out} in {time.monotonic() - started:.1f} s: {names}")


if __name__ == "__main__":
    main()
