#!/usr/bin/env bash
# Build, here (where PyPI and Debian's archive answer), what device.sh needs on the GPU machine,
# which reaches no registry: the SGLang payload in $CARRY/sgl and this checkout's committed code
# in $CARRY/gf. Versions and left-out files: README.md beside this (the one place they are
# stated). About 40 MB; ~2 minutes the first time (the big wheels are cached in $DL).
#
#   bash bench/real_sglang/prepare.sh            # CARRY defaults to <checkout>/.carry
#   CARRY=/path/of/the/checkout/that/travels/.carry bash bench/real_sglang/prepare.sh
#
# Output: $CARRY/sgl/site.tar.xz (one pip --target tree, stripped), $CARRY/sgl/redis/*.deb,
# $CARRY/sgl/jitcache.tar.xz (when $JITCACHE names one: first-use kernel compiles, ~40 s a start
# saved), $CARRY/gf (git archive HEAD). `.carry/` must be git-ignored where it travels.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git -C "$HERE" rev-parse --show-toplevel)
CARRY=${CARRY:-$ROOT/.carry}
DEST=$CARRY/sgl
DL=${DL:-${TMPDIR:-/tmp}/genfleet-sglang-wheels}
WORK=${WORK:-${TMPDIR:-/tmp}/genfleet-sglang-build}
# pip installs into a --target tree only wheels of its own Python: the device runs 3.12.
PY=${PY:-$(command -v python3.12 || echo python3)}
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
  || { echo "PY must be a Python 3.12 (the GPU machine's); got $("$PY" --version)" >&2; exit 2; }
mkdir -p "$DL" "$WORK/wheels" "$DEST"

pipdl() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any "$@"
}

# The pins (README.md says why each).
BIG=(sglang==0.5.15 sglang-kernel==0.4.4 flashinfer-python==0.6.12)
SMALL=(
  transformers==5.12.1 tokenizers==0.22.2
  pyzmq==27.1.0 pybase64==1.5.1 msgspec==0.23.0 setproctitle==1.3.8 partial_json_parser==0.2.1.1.post7
  dill==0.4.0 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 apache-tvm-ffi==0.1.11
  tabulate==0.10.0 python-multipart==0.0.34 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1
  fastapi==0.115.12 starlette==0.46.2 uvicorn==0.34.3 openai==2.8.0
  pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.1
  jiter==0.11.1 distro==1.9.0 sniffio==1.3.1 orjson==3.11.4
  celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2
  click-didyoumean==0.3.1 click-repl==0.4.1 click-plugins==1.1.1.2
  prompt_toolkit==3.0.52 wcwidth==0.7.0 tzlocal==5.4.5
  redis==8.1.0 pydantic-settings==2.10.1 python-dotenv==1.2.2
)
for pin in "${BIG[@]}"; do
  name=${pin%%==*}; version=${pin##*==}
  ls "$DL/${name//-/_}-$version-"*.whl >/dev/null 2>&1 || pipdl -d "$DL" "$pin"
done
pipdl -d "$WORK/wheels" "${SMALL[@]}"

rm -rf "$WORK/site" && mkdir -p "$WORK/site"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
  "$WORK"/wheels/*.whl "$DL"/sglang-0.5.15-*.whl "$DL"/flashinfer_python-0.6.12-*.whl
# sglang-kernel without FA3 (flash_ops, 578 of its 587 MB), the Blackwell build and FlashMLA.
(cd "$WORK/site" && unzip -q -o "$DL"/sglang_kernel-0.4.4-*.whl \
  -x 'sgl_kernel/flash_ops*' 'sgl_kernel/sm100/*' 'sgl_kernel/flashmla_ops*')
# flashinfer's JIT sources and pip's console scripts (device.sh writes its own launchers).
rm -rf "$WORK/site/flashinfer/data" "$WORK/site/bin"
find "$WORK/site" -name __pycache__ -type d -prune -exec rm -rf {} +
"$PY" "$HERE/patch_site.py" "$WORK/site"
tar -C "$WORK" -cf - site | xz -T0 -6 >"$DEST/site.tar.xz"

mkdir -p "$DEST/redis"
(cd "$DEST/redis" && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 libssl3)
if [ -n "${JITCACHE:-}" ] && [ -f "$JITCACHE" ]; then cp "$JITCACHE" "$DEST/jitcache.tar.xz"; fi

rm -rf "$CARRY/gf" && mkdir -p "$CARRY/gf"
git -C "$ROOT" archive HEAD | tar -x -C "$CARRY/gf"
du -sh "$DEST" "$CARRY/gf"
