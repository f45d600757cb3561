#!/usr/bin/env bash
# Fill .carry/ with what bench/h200_run.sh needs on the H200 machine, which has no registry
# access and no Redis: Python 3.12 x86-64 wheels the image lacks (genfleet's worker stack and
# the fastapi/openai set `transformers serve` needs) and a Redis server unpacked from Debian
# packages. Run once, here, from the repository root; `.carry/` is git-ignored locally.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
CARRY=.carry
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.carry/' "$EXCLUDE" 2>/dev/null || echo '/.carry/' >>"$EXCLUDE"
mkdir -p "$CARRY/wheels" "$CARRY/debs" "$CARRY/redis"

# Versions: genfleet's own stack as tested here; pydantic/fastapi/openai as known to install
# together for transformers serve (see shared/real-gpu-engine.md).
WHEELS=(
  celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2
  click-didyoumean==0.3.1 click-repl==0.4.1 click-plugins==1.1.1.2
  prompt_toolkit==3.0.52 wcwidth==0.7.0 tzlocal==5.4.5
  redis==8.1.0 pydantic-settings==2.10.1 python-dotenv==1.2.2 orjson==3.11.4
  fastapi==0.115.12 starlette==0.46.2 uvicorn==0.34.3 openai==2.8.0
  pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.1
  jiter==0.11.1 distro==1.9.0 sniffio==1.3.1
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$CARRY/wheels" "${WHEELS[@]}"

(cd "$CARRY/debs" && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 libssl3)
for deb in "$CARRY"/debs/*.deb; do dpkg -x "$deb" "$CARRY/redis"; done
rm -rf "$CARRY/redis/usr/share" "$CARRY/debs"
LD_LIBRARY_PATH="$CARRY/redis/usr/lib/x86_64-linux-gnu" "$CARRY/redis/usr/bin/redis-server" \
  --version
du -sh "$CARRY"
