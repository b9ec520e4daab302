"""The README's examples, run as written: the quick start (on a free port) serves and answers its first request,
and the Python example prints the expected answer."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

from hypic.data.tasks import extract_answer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def quick_start() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    return next(block for block in blocks if "-m hypic.serve --device cpu" in block)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_shell(script: str, timeout_s: float) -> subprocess.CompletedProcess:
    """bash in a session of its own, so a hung run takes its background server down with it."""
    process = subprocess.Popen(["bash", "-e", "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_quick_start_serves_and_answers_the_first_request() -> None:
    script = quick_start().replace("8000", str(free_port())) + "kill %1\nwait\n"
    done = run_shell(script, timeout_s=300)
    assert done.returncode == 0, done.stderr[-2000:]
    body = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))  # after the server's line
    expected = re.search(r"Linda Gruzeifei's locker code is (\d+)\.", quick_start()).group(1)
    assert extract_answer(body["choices"][0]["text"]) == expected
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_python_example_prints_the_expected_answer() -> None:
    example = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "AsyncEngine" in b)
    done = run_shell(f"python3 - <<'PY'\n{example}PY\n", timeout_s=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = re.search(r"expected: (.+)$", done.stdout.strip()).group(1)
    assert extract_answer(done.stdout.strip().splitlines()[0]) == answer
