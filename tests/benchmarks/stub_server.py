"""The benchmarks' stub server: a vLLM-shaped ``/v1/completions`` + ``/v1/models`` on 127.0.0.1, in its
own process (so its memory and CPU are not the harness's). Labelled as a stub wherever it is used: it
measures the harness, not a model.

Raw asyncio, HTTP/1.1 keep-alive. It never parses a token-id prompt as JSON: ``usage.prompt_tokens`` is
the number of ids between the brackets of ``"prompt"``, and for ``return_token_ids`` the ids are echoed
as the bytes that were sent (≈ 1 ms a 128K-id request; a parse would cost the server more CPU than the
client it measures). It answers after a fixed delay and stops by itself after its lifetime.
``/stats``: requests, prompt tokens, connections and the server's own CPU seconds.

    python tests/benchmarks/stub_server.py DELAY_S LIFETIME_S [TEXT]   # prints its port, then serves
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from typing import Any

STATE = {"requests": 0, "prompt_tokens": 0, "connections": 0}
MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 1 << 20}]})
PROMPT = re.compile(rb'"prompt"\s*:\s*')
ECHO = re.compile(rb'"return_token_ids"\s*:\s*true')


def reply(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode("latin-1") + body


def completion(body: bytes, head: bytes) -> bytes:
    start = PROMPT.search(body).end()  # type: ignore[union-attr]
    ids: bytes | None
    if body[start : start + 1] == b"[":
        end = body.index(b"]", start) + 1
        ids = body[start:end]
        inner = ids[1:-1].strip()
        n = inner.count(b",") + 1 if inner else 0
    else:
        ids, n = None, len(str(json.loads(body)["prompt"]).split())
    STATE["prompt_tokens"] += n
    out = head
    if ids is not None and ECHO.search(body):
        out += b',"prompt_token_ids":' + ids + b',"token_ids":[1,2]'
    out += b'}],"usage":{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d}}' % (n, n + 2)
    return out


class Http(asyncio.Protocol):
    delay = 0.0
    head = b""

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.buf = bytearray()
        self.busy = False
        STATE["connections"] += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.pump()

    def pump(self) -> None:
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            self.handle(method, path, body)

    def send(self, data: bytes) -> None:
        self.busy = False
        if not self.t.is_closing():
            self.t.write(data)
            self.pump()

    def handle(self, method: str, path: str, body: bytes) -> None:
        if path == "/v1/models":
            self.t.write(reply(MODELS.encode()))
        elif path == "/stats":
            self.t.write(reply(json.dumps({**STATE, "cpu_s": time.process_time()}).encode()))
        elif method == "POST" and path == "/v1/completions":
            STATE["requests"] += 1
            data = reply(completion(body, self.head))
            if self.delay > 0:
                self.busy = True
                asyncio.get_running_loop().call_later(self.delay, self.send, data)
            else:
                self.t.write(data)
        else:
            self.t.write(reply(b'{"error": {"message": "not found"}}', "404 Not Found"))


async def serve(delay_s: float, lifetime_s: float, text: str) -> None:
    Http.delay = delay_s
    Http.head = (
        b'{"id":"cmpl-stub","object":"text_completion","created":0,"model":"stub","choices":[{"index":0,'
        b'"text":'
        + json.dumps(text).encode()
        + b',"logprobs":null,"finish_reason":"stop","stop_reason":"\\n"'
    )
    server = await asyncio.get_running_loop().create_server(Http, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(lifetime_s)


class StubServer:
    """The stub in a child process; ``url``; ``stats()``. It stops by itself after ``lifetime_s``,
    whatever happens to the parent."""

    def __init__(self, delay_s: float = 0.0, lifetime_s: float = 900.0, text: str = " 42") -> None:
        self.delay_s = delay_s
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(delay_s), str(lifetime_s), text], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"stub server did not start (said {line!r})")
        self.url = f"http://127.0.0.1:{line}"

    def stats(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/stats", timeout=30) as answer:
            return dict(json.loads(answer.read()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    asyncio.run(serve(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else " 42"))
