"""Published models' config.json, the fields that size an engine: for the engine plan's
tests and for tune's points."""

from __future__ import annotations

from typing import Any

QWEN35 = "Qwen3_5ForConditionalGeneration"


def qwen35_27b() -> dict[str, Any]:
    """Qwen3.5-27B / Qwen3.6-27B's config.json (the fields that size the engine)."""
    return {
        "architectures": [QWEN35],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "hidden_size": 5120,
            "num_hidden_layers": 64,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)
            ],
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
            "intermediate_size": 17408,
            "vocab_size": 248320,
            "mtp_num_hidden_layers": 1,
        },
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304},
    }


def qwen35_toy() -> dict[str, Any]:
    """The 118M-parameter Qwen3.6-layout checkpoint `bench/real_sglang/build_model.py` writes
    for the GPU tests (hidden 1024, 8 layers, one MTP layer; its fields that size the engine)."""
    return {
        "architectures": [QWEN35],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "hidden_size": 1024,
            "num_hidden_layers": 8,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)
            ],
            "full_attention_interval": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
            "intermediate_size": 3072,
            "vocab_size": 8192,
            "mtp_num_hidden_layers": 1,
        },
        "vision_config": {"depth": 1, "hidden_size": 128, "intermediate_size": 256},
    }
