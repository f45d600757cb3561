"""The compose file, read as Compose reads it (no Docker engine needed)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from harness.env import ROOT

COMPOSE = ROOT / "compose.yaml"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def load_compose() -> dict[str, Any]:
    """The compose file as Compose sees it before interpolation (YAML anchors merged)."""
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` (nested), `${VAR:?error}`, `$VAR` and `$$`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, end = 0, i + 1
            for end in range(i + 1, len(text)):  # the brace that closes this one
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if not depth:
                    break
            out.append(_substitute(text[i + 2 : end], env))
            i = end + 1
        elif text[i] == "$" and (match := _NAME.match(text, i + 1)):
            out.append(env.get(match.group(), ""))
            i = match.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _substitute(body: str, env: Mapping[str, str]) -> str:
    match = _NAME.match(body)
    assert match, f"bad variable reference ${{{body}}}"
    name, rest = match.group(), body[match.end() :]
    value = env.get(name)
    unset_or_empty = not value
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if rest.startswith(op):
            arg = rest[len(op) :]
            missing = unset_or_empty if op.startswith(":") else value is None
            if op.endswith("-"):
                return interpolate(arg, env) if missing else str(value)
            if op.endswith("?"):
                if missing:
                    raise KeyError(f"{name}: {arg}")
                return str(value)
            return "" if missing else interpolate(arg, env)
    assert not rest, f"unsupported variable reference ${{{body}}}"
    return value or ""


def service_environment(service: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """A service's container environment: a key without a value comes from `env` or is unset."""
    result: dict[str, str] = {}
    for key, value in (service.get("environment") or {}).items():
        if value is None:
            if key in env:
                result[key] = env[key]
            continue
        result[key] = interpolate(str(value), env)
    return result


def argv(service: Mapping[str, Any]) -> list[str]:
    """entrypoint + command, each in list or string form."""
    parts: list[str] = []
    for field in ("entrypoint", "command"):
        value = service.get(field) or []
        parts += shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    return parts


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)
