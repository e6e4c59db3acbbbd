"""A Hugging Face Hub endpoint on loopback for tests: the file routes hf_hub_download uses
(HEAD and GET /{org}/{name}/resolve/{revision}/{file}), with the Hub's headers and error codes
(RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo; one revision, main), and a log of
what was asked with which token.
Point huggingface_hub at it with HF_ENDPOINT (read when huggingface_hub is imported)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeHub:
    models: dict[str, dict[str, bytes]]  # repo id -> file name -> bytes
    gated: dict[str, str] = field(default_factory=dict)  # repo id -> the token it takes
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, authorization)
    url: str = ""


@contextmanager
def serve_hub(hub: FakeHub) -> Iterator[FakeHub]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Authorization", "")))
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return self._error(404, "RepoNotFound")
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            if repo not in hub.models:
                return self._error(401, "RepoNotFound")
            if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {hub.gated[repo]}":
                return self._error(403, "GatedRepo")
            files = hub.models[repo]
            commit = hashlib.sha1(b"".join(sorted(files.values()))).hexdigest()
            if parts[3] not in ("main", commit):
                return self._error(404, "RevisionNotFound")
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
