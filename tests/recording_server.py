"""RecordingServer: a loopback OpenAI-compatible server that stores every request body it receives.

Contract tests drive a real CLI or API path against it and then assert on what each model-served
role actually sent: the passage and query a reader saw, the pages a card writer saw, the
interpretation and hint a selector saw, the evidence an answer model saw, the prompt ids a served
policy saw. It answers by role so that episodes run end to end, but its replies are scripted, not a
model's: what matters is the request, not the reply.

Roles are told apart by the system message (each role's prompt has its own) or, for the policy, by
the ``/v1/completions`` path. A role can be told to fail (``faults[role]``: ``"http500"``,
``"http400"``, ``"empty"``, ``"not_json"``, ``"garbage"``) to check that failures are counted and
reported per role. Built on the standard library's ``ThreadingHTTPServer`` (real HTTP/1.1 sockets).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from coordrl.envs.hmars_prompts import (
    ANSWER_SYSTEM,
    CARD_WRITER_SYSTEM,
    REGION_WRITER_SYSTEM,
    SELECTOR_SYSTEM,
)
from coordrl.readers.prompt import READER_INSTRUCTIONS

ROLES = ("reader", "writer", "region_writer", "selector", "answerer", "policy", "unknown")
FAULTS = ("http500", "http400", "empty", "not_json", "garbage")
_PAGE_ID = re.compile(r"\[page (\d+)\]")


def chat_role(body: dict[str, Any]) -> str:
    """The role a chat request came from, read off its system message."""
    messages = body.get("messages") or []
    system = messages[0].get("content", "") if messages and messages[0].get("role") == "system" else ""
    for role, prompt in (
        ("reader", READER_INSTRUCTIONS),
        ("writer", CARD_WRITER_SYSTEM),
        ("region_writer", REGION_WRITER_SYSTEM),
        ("selector", SELECTOR_SYSTEM),
        ("answerer", ANSWER_SYSTEM),
    ):
        if system == prompt:
            return role
    return "unknown"


def user_text(body: dict[str, Any]) -> str:
    """Content of the last user message of a chat request ('' when there is none)."""
    users = [m.get("content", "") for m in body.get("messages") or [] if m.get("role") == "user"]
    return users[-1] if users else ""


def scripted_chat_reply(role: str, body: dict[str, Any]) -> str:
    """A plausible reply per role (valid JSON where the role expects it), derived from the request."""
    text = user_text(body)
    if role == "reader":
        return "Answer: " + text.rsplit("Question: ", 1)[-1]
    if role == "writer":
        pages = _PAGE_ID.findall(text)
        return json.dumps(
            {
                "summary": "Recorded card.",
                "topics": ["recorded"],
                "entities": [],
                "page_gists": {p: "page" for p in pages},
            }
        )
    if role == "region_writer":
        return json.dumps({"summary": "Recorded region.", "submap": {}, "crossref": []})
    if role == "selector":  # the first page shown, so the answer model gets evidence
        pages = _PAGE_ID.findall(text)
        return json.dumps({"pages": [{"id": int(pages[0]), "confidence": 0.9}] if pages else []})
    if role == "answerer":
        return "<answer>recorded</answer>"
    return "Unknown"


class RecordingServer:
    """Records each request (``requests``: dicts with ``path``, ``role`` and ``body``) and replies by role.

    Args:
        policy_responder: ``body -> completion token ids`` for ``/v1/completions`` (the served policy);
            None answers 404 there.
        model: the name listed by ``/v1/models`` (default ``"recorded"``).
    """

    def __init__(
        self, policy_responder: Callable[[dict[str, Any]], list[int]] | None = None, model: str = "recorded"
    ) -> None:
        self.policy_responder = policy_responder
        self.model = model
        self.faults: dict[str, str] = {}
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def bodies(self, role: str) -> list[dict[str, Any]]:
        """Request bodies received from ``role``, in arrival order."""
        with self._lock:
            return [r["body"] for r in self.requests if r["role"] == role]

    def roles(self) -> set[str]:
        with self._lock:
            return {r["role"] for r in self.requests}

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="recording-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _send(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    self._send(
                        200, json.dumps({"object": "list", "data": [{"id": server.model, "object": "model"}]}).encode()
                    )
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw)
                role = "policy" if self.path == "/v1/completions" else chat_role(body)
                with server._lock:
                    server.requests.append({"path": self.path, "role": role, "body": body, "raw": raw})
                fault = server.faults.get(role)
                if fault == "http500":
                    return self._send(500, b'{"error": "injected"}')
                if fault == "http400":
                    return self._send(400, b'{"error": "injected"}')
                if fault == "empty":
                    return self._send(200, b"")
                if fault == "not_json":
                    return self._send(200, b"<html>not json</html>", "text/html")
                if role == "policy":
                    if server.policy_responder is None:
                        return self._send(404, b'{"error": "no policy served"}')
                    ids = server.policy_responder(body)
                    choice = {"index": 0, "text": "", "token_ids": ids, "finish_reason": "stop"}
                    return self._send(200, json.dumps({"choices": [choice]}).encode())
                text = "\x00{{garbage" if fault == "garbage" else scripted_chat_reply(role, body)
                reply = {
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    ]
                }
                self._send(200, json.dumps(reply).encode())

        return Handler
