"""A checkpoint folder's content, as a digest cheap enough to take at every worker start and
every staging: what tells two folders of one name apart (another download, revision,
fine-tune or quantization) without reading 50 GB of weights.

What it reads, and why that is enough to tell such folders apart:

- whole, the small files that decide what the engine builds and what a prompt becomes:
  `config.json` (architecture, `quantization_config`), `generation_config.json`,
  `model.safetensors.index.json` (every tensor and the file holding it), the tokenizer and
  its chat template (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
  `chat_template.json`);
- of each weight file (`*.safetensors`, `*.bin`, `*.pt`, `*.pth`, `*.gguf`): its name, its
  size and the sha256 of its first, middle and last MiB (the whole file when it is smaller
  than that). A safetensors file begins with its header (every tensor's name, dtype, shape and
  offsets): another dtype or layout changes it, other values change the sampled bytes.

At most 3 MiB read per weight file: a few dozen MiB for a 27B checkpoint, against the 50 GB
its engine loads. It is a check against the common mistakes, not a proof: weights that differ
only where no sample falls, at the same sizes, share a digest (a fine-tune that touched only
some tensors could). A hub id is no folder: it has no digest, only its name
(`common.model_identity` judges it by name).

    digest(Path("/models/Qwen3-8B"))      # 'b1946ac9…' (sha256 hex)
    digest(Path("Qwen/Qwen3-8B"))         # None: not a folder here
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# Read whole: small, and each decides what a prompt becomes or what the engine builds.
WHOLE_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 1 << 20  # one MiB from the start, the middle and the end of each weight file


def _whole(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sampled(path: Path, size: int) -> str:
    """sha256 of the first, middle and last SAMPLE_BYTES (the whole file when it is small)."""
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        if size <= 3 * SAMPLE_BYTES:
            hasher.update(handle.read())
            return hasher.hexdigest()
        for offset in (0, size // 2 - SAMPLE_BYTES // 2, size - SAMPLE_BYTES):
            handle.seek(offset)
            hasher.update(handle.read(SAMPLE_BYTES))
    return hasher.hexdigest()


def digest(folder: Path) -> str | None:
    """The folder's content digest; None when it is not a readable folder or holds none of
    the files above (nothing to know it by but its name)."""
    try:
        if not folder.is_dir():
            return None
        entries = sorted(folder.iterdir())
        lines = []
        for path in entries:
            if not path.is_file():
                continue
            if path.name in WHOLE_FILES:
                lines.append(f"{path.name}\t{_whole(path)}")
            elif path.name.endswith(WEIGHT_SUFFIXES):
                size = path.stat().st_size
                lines.append(f"{path.name}\t{size}\t{_sampled(path, size)}")
    except OSError:
        return None
    if not lines:
        return None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
