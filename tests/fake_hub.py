"""A Hugging Face Hub endpoint on loopback for tests: the file routes hf_hub_download uses
(HEAD and GET /{org}/{name}/resolve/{revision}/{file}), with the Hub's headers and error codes
(RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo; one revision, main), and a log of
what was asked with which token.
Dataset repositories have a history of commits (`push` adds one) and the routes HfFileSystem
reads them by: repo_info (/api/datasets/{org}/{name}[/revision/{rev}]), the tree listing
(/api/datasets/{org}/{name}/tree/{rev}/{path}), paths-info, and ranged GETs of
/datasets/{org}/{name}/resolve/{rev}/{path}; {rev} is main (the last commit) or a commit's sha.
Point huggingface_hub at it with HF_ENDPOINT (read when huggingface_hub is imported), or a
source's endpoint=."""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
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
    datasets: dict[str, list[dict[str, bytes]]] = field(default_factory=dict)  # repo id -> its commits' files

    def push(self, repo: str, files: dict[str, bytes]) -> str:
        """A new commit of dataset `repo` holding `files`; returns its sha."""
        self.datasets.setdefault(repo, []).append(dict(files))
        return self.commit_of(repo, -1)

    def commit_of(self, repo: str, index: int) -> str:
        commits = self.datasets[repo]
        return hashlib.sha1(f"{repo}:{index % len(commits)}".encode()).hexdigest()

    def files_at(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(sha, files) of the commit `revision` names: main, or a sha."""
        commits = self.datasets[repo]
        for index in range(len(commits)):
            if revision == self.commit_of(repo, index):
                return revision, commits[index]
        return (self.commit_of(repo, -1), commits[-1]) if revision == "main" else None


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub  # set by serve_hub

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_POST(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        self.hub.requests.append((self.command, self.path, self.headers.get("Authorization", "")))
        parts = [urllib.parse.unquote(p) for p in self.path.split("?")[0].strip("/").split("/")]
        if parts[:2] == ["api", "datasets"] or parts[0] == "datasets":
            return self._dataset(parts, body)
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(404, "RepoNotFound")
        repo, name = "/".join(parts[:2]), "/".join(parts[4:])
        if repo not in self.hub.models:
            return self._error(401, "RepoNotFound")
        if repo in self.hub.gated and self.headers.get("Authorization") != f"Bearer {self.hub.gated[repo]}":
            return self._error(403, "GatedRepo")
        files = self.hub.models[repo]
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

    def _dataset(self, parts: list[str], body: bool) -> None:
        api = parts[0] == "api"
        repo = "/".join(parts[2:4] if api else parts[1:3])
        if repo not in self.hub.datasets:
            return self._error(404, "RepoNotFound")
        route = (parts[4] if len(parts) > 4 else "revision") if api else parts[3]
        at = 5 if api else 4  # /api/datasets/ORG/NAME/ROUTE/REV/PATH, /datasets/ORG/NAME/resolve/REV/PATH
        found = self.hub.files_at(repo, parts[at] if len(parts) > at else "main")
        if found is None:
            return self._error(404, "RevisionNotFound")
        sha, files = found
        path = "/".join(parts[at + 1 :])
        if route == "revision":
            return self._json({"id": repo, "sha": sha, "siblings": [{"rfilename": name} for name in files]})
        if route == "tree":
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            return self._json(_tree(files, path, query.get("recursive", ["false"])[0] in ("true", "True")))
        if route == "paths-info":
            length = int(self.headers.get("Content-Length") or 0)
            asked = urllib.parse.parse_qs(self.rfile.read(length).decode()).get("paths", [])
            return self._json([e for e in _tree(files, "", True) if e["path"] in asked])
        if route != "resolve" or path not in files:
            return self._error(404, "EntryNotFound")
        data, status, start = files[path], 200, 0
        if (asked := self.headers.get("Range")) is not None:
            first, _, last = asked.removeprefix("bytes=").partition("-")
            start, stop = int(first), min(len(data), int(last) + 1 if last else len(data))
            data, status = data[start:stop], 206
        self.send_response(status)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{hashlib.sha256(files[path]).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{start + len(data) - 1}/{len(files[path])}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _json(self, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()


@contextmanager
def serve_hub(hub: FakeHub) -> Iterator[FakeHub]:
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def _tree(files: dict[str, bytes], folder: str, recursive: bool) -> list[dict[str, object]]:
    """The Hub's tree listing of `folder`: its files and folders (all below it when recursive)."""
    prefix = folder.rstrip("/") + "/" if folder else ""
    entries: dict[str, dict[str, object]] = {}
    for name, data in sorted(files.items()):
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split("/")
        for depth in range(1, len(parts) if recursive else min(2, len(parts))):
            path = prefix + "/".join(parts[:depth])
            oid = hashlib.sha1(path.encode()).hexdigest()
            entries[path] = {"type": "directory", "oid": oid, "size": 0, "path": path}
        if recursive or len(parts) == 1:
            sha = hashlib.sha256(data).hexdigest()
            entries[name] = {
                "type": "file",
                "oid": hashlib.sha1(data).hexdigest(),
                "size": len(data),
                "path": name,
                "lfs": {"oid": sha, "size": len(data), "pointerSize": 134},
            }
    return list(entries.values())
