"""`cbserve serve` as a user runs it (the README's serving command): a subprocess that starts its own local
Ray cluster, serves the bundled model, says where it listens, answers the official OpenAI client, and
shuts down cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from e2e_lib import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]


def test_cbserve_serve_with_config_file_serves_and_stops_on_ctrl_c() -> None:
    port = free_port()
    cli = Path(sys.executable).with_name("cbserve")
    cmd = [str(cli), "serve", "--ray-address", "local", "--config", str(ROOT / "deploy" / "serve-local.yaml"),
           "--port", str(port), "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 * 1024**2),
           "--worker-torch-threads", "1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "engine replicas ready" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(300), "cbserve serve did not get ready:\n" + "".join(lines[-40:])
        said = "".join(lines)
        assert f"http://127.0.0.1:{port}/v1" in said  # it says where it listens
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello."}])  # fmt: skip
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        reader.join(timeout=10)
        assert "shutting down" in "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
