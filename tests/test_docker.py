"""The serving image (Dockerfile, docker/): built, run with a trained checkpoint mounted, and asked for a
completion through the official `openai` client.

    python -m pytest -q tests/test_docker.py

Needs a Docker daemon that answers `docker info`: `.ci/run` installs Debian's docker.io and starts dockerd
where it can; elsewhere these tests are skipped, saying why. docker/build.sh builds the image (on this
machine's own base and wheels when no registry can be reached); its layers are cached, so only the first
build is slow (minutes: torch and the dependencies), and a changed `gpt/` rebuilds only the last layers.
"""

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install -e '.[dev]'")
import httpx  # noqa: E402  (installed with openai)

from gpt import load_checkpoint  # noqa: E402
from gpt.infer.sampling import complete  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "gpt:test"
KEY = "s3cret-for-the-container"


def docker(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60, check=check, env=env)


def wait_healthy(name: str, seconds: float = 180) -> None:
    """Until the image's HEALTHCHECK (python asking /health inside) says healthy; fails with the logs."""
    deadline = time.monotonic() + seconds
    while (state := docker("inspect", "-f", "{{.State.Status}} {{.State.Health.Status}}", name).stdout.split()) != [
        "running",
        "healthy",
    ]:
        logs = docker("logs", name, check=False)
        assert state[0] == "running", f"the container stopped: {state}\n{logs.stdout}{logs.stderr}"
        assert time.monotonic() < deadline, f"not healthy in {seconds} s: {state}\n{logs.stdout}{logs.stderr}"
        time.sleep(1)


@pytest.fixture(scope="module")
def image():
    if shutil.which("docker") is None:
        pytest.skip("no docker command on this machine (Debian: apt-get install docker.io; .ci/run does it as root)")
    info = docker("info", check=False)
    if info.returncode != 0:
        said = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        pytest.skip(f"no Docker daemon answers `docker info` ({said}); .ci/run starts one where it can")
    build = subprocess.run(
        [str(ROOT / "docker" / "build.sh"), IMAGE], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    assert build.returncode == 0, f"docker/build.sh failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    return IMAGE


@contextlib.contextmanager
def serving(image: str, model: Path):
    """The image running with `model` mounted read-only at /model, its port published on loopback, the API
    key from the environment; yields its name and base URL once the HEALTHCHECK says healthy, then removes it."""
    name = f"gpt-test-{uuid.uuid4().hex[:8]}"
    run = ["run", "-d", "--name", name, "-p", "127.0.0.1::8000", "-v", f"{model}:/model:ro"]
    run += ["-e", "GPT_SERVE_API_KEY", "--health-interval", "2s", image, "--threads", "1"]
    docker(*run, env={**os.environ, "GPT_SERVE_API_KEY": KEY})  # `-e NAME`: the key never on a command line
    try:
        wait_healthy(name)
        port = docker("port", name, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
        yield name, f"http://127.0.0.1:{port}"
    finally:
        docker("rm", "-f", name, check=False)


def test_the_image_serves_a_completion_as_the_library_does(image, trained_run, tmp_path):
    # One test, not several: pytest-xdist would give each worker its own build and container.
    model = tmp_path / "shakespeare-char"
    shutil.copytree(trained_run, model)
    for path in [model, *model.rglob("*")]:  # the image's user (uid 10001) reads it
        path.chmod(0o755 if path.is_dir() else 0o644)
    with serving(image, model) as (name, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["model"]  # the mount's directory name
        r = client.completions.create(model="model", prompt="ROMEO:", max_tokens=30, temperature=0)
        lm, tok, _ = load_checkpoint(trained_run)
        assert r.choices[0].text == complete(lm, tok, "ROMEO:", max_new_tokens=30, temperature=0, top_k=None)[0]
        assert r.usage.completion_tokens == 30

        wrong = openai.OpenAI(base_url=url + "/v1", api_key="not-the-key", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):  # the key came from the container's environment
            wrong.completions.create(model="model", prompt="ROMEO:", max_tokens=1)
        health = httpx.get(url + "/health", timeout=10)  # the probe's route needs no key
        assert health.status_code == 200 and health.json()["status"] == "ok"

        status = docker("exec", name, "cat", "/proc/1/status").stdout  # process 1: gpt serve itself (exec'd)
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert uids == ["10001"] * 4, status  # not root
        assert "gpt" in docker("exec", name, "cat", "/proc/1/cmdline").stdout
