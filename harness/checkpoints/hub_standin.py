"""A Hugging Face hub on the loopback, serving repositories from local folders: the online path as a test.

`huggingface_hub` (downloads, repository info) and `datasets` (dataset repositories of parquet shards) both
follow `HF_ENDPOINT`, so with it set to this server's address every hub call of the project runs for real:
HEAD and GET of `/{repo}/resolve/{revision}/{path}` (ranges included, so an interrupted download resumes),
`/api/{models,datasets}/{repo}[/revision/{rev}]`, `/tree/{rev}[/{path}]` and `/paths-info/{rev}`, and the
hub's errors with the `X-Error-Code` header the client turns into its exceptions (repository, revision and
file not found; a gated repository without or with a wrong token).

Why not a package: olah 0.5.4 (the self-hosted mirror on the package index) serves local git repositories,
but in its offline mode answered a missing file or revision as "repository not found" (a GET of a missing file
as a 500), ignored ranges, had no gated repositories and failed repository info without a revision;
hf-local-hub 3.0.0 ships only a client for a Go server that is not on the index. docs/pipeline.md has the
evaluation. This module is the standard library's HTTP server and what the clients read, nothing more.

Layout (`publish` writes it): ROOT/{models,datasets}/<org>--<name>/<revision>/<files>, one folder per branch or
tag (its name URL-quoted: `refs%2Fconvert%2Fparquet`); a revision's commit hash is a hash of its files, so it changes with them. A file `.gated` beside the
revision folders holds the one token the repository accepts.

    blockgen hub-standin --root runs/hub     # prints `export HF_ENDPOINT=http://127.0.0.1:PORT`, serves until Ctrl-C
                                             # (the command: harness/data/hub_standin_repos.py, which also writes repositories)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

KINDS = ("models", "datasets")
GATED_FILE = ".gated"
_CHUNK = 1 << 20


def _blob_sha(path: Path) -> str:
    """The file's git blob hash: what the hub reports as a file's `oid` and `ETag` (every request names a commit,
    hashed from its files: read once per version of a file, known by its size and modification time)."""
    stat = path.stat()
    return _hashed(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _hashed(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Repo:
    root: Path
    kind: str  # "models" or "datasets"
    repo_id: str  # "org/name" or "name"

    @property
    def directory(self) -> Path:
        return self.root / self.kind / self.repo_id.replace("/", "--")

    def revisions(self) -> list[str]:
        return sorted(unquote(p.name) for p in self.directory.iterdir() if p.is_dir() and not p.name.startswith("."))

    def tree(self, revision: str) -> Path:
        """A revision's files; a name with slashes (`refs/convert/parquet`, the parquet export) is one folder."""
        return self.directory / quote(revision, safe="")

    def files(self, revision: str) -> list[str]:
        base = self.tree(revision)
        return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())

    def commit(self, revision: str) -> str:
        digest = hashlib.sha1(f"{self.kind}/{self.repo_id}@{revision}".encode())
        for name in self.files(revision):
            digest.update(f"{name}\0{_blob_sha(self.tree(revision) / name)}\0".encode())
        return digest.hexdigest()

    def find_revision(self, revision: str) -> str | None:
        """A branch or tag name, or a commit hash of one of them -> its folder's name."""
        names = self.revisions()
        if revision in names:
            return revision
        return next((n for n in names if re.fullmatch(r"[0-9a-f]{40}", revision) and self.commit(n) == revision), None)

    def token(self) -> str | None:
        gated = self.directory / GATED_FILE
        return gated.read_text().strip() if gated.is_file() else None

    def entry(self, revision: str, path: str) -> dict:
        full = self.tree(revision) / path
        if full.is_dir():
            return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}
        return {"type": "file", "oid": _blob_sha(full), "size": full.stat().st_size, "path": path}


def publish(root: str | Path, kind: str, repo_id: str, files: dict[str, str | Path | bytes], revision: str = "main",
            token: str | None = None) -> Repo:
    """Put files into a stand-in repository at `revision` ({path in the repository: a local file or the bytes});
    `token`: the repository is gated and accepts only it."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose from {list(KINDS)}")
    repo = Repo(Path(root), kind, repo_id)
    base = repo.tree(revision)
    for name, content in files.items():
        target = base / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            shutil.copyfile(content, target)
    if token is not None:
        (repo.directory / GATED_FILE).write_text(token)
    return repo


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path = Path(".")  # set per server by HubStandin

    def log_message(self, format, *args):  # noqa: A002 - the base class's name; requests are not logged
        pass

    def _send(self, status: int, body: bytes | dict | list = b"", headers: dict | None = None,
              content_type: str = "application/json") -> None:
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        self._send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})})

    def _open(self, kind: str, repo_id: str, revision: str | None) -> tuple[Repo, str] | None:
        """The repository and its revision's folder, or None after answering the hub's error."""
        repo = Repo(self.root, kind, repo_id)
        if not repo.directory.is_dir():
            return self._error(401, "RepoNotFound", f"Repository not found: {repo_id}")
        token = repo.token()
        if token is not None:
            given = self.headers.get("Authorization", "")
            if not given:
                return self._error(401, "GatedRepo", f"Access to {repo_id} is restricted: you must be authenticated")
            if given != f"Bearer {token}":
                return self._error(403, "GatedRepo", f"Access to {repo_id} is restricted: you are not in the authorized list")
        found = repo.find_revision(revision or "main")
        if found is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, found

    def _route(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        if any(".." in p.split("/") for p in parts):  # nothing outside the served folder, however it is spelled
            return self._error(404, "EntryNotFound", f"no such page: {url.path}")
        if len(parts) >= 3 and parts[0] == "api" and parts[1] in KINDS:
            return self._api(parts[1], parts[2:], parse_qs(url.query))
        kind = "models"
        if parts and parts[0] == "datasets":
            kind, parts = "datasets", parts[1:]
        for id_len in (1, 2):  # "name/resolve/..." or "org/name/resolve/..."
            if len(parts) > id_len + 2 and parts[id_len] == "resolve":
                return self._resolve(kind, "/".join(parts[:id_len]), parts[id_len + 1], "/".join(parts[id_len + 2:]))
        return self._error(404, "EntryNotFound", f"no such page: {url.path}")

    def _api(self, kind: str, rest: list[str], query: dict) -> None:
        actions = ("revision", "tree", "paths-info")
        id_len = 1 if len(rest) >= 2 and rest[1] in actions else min(2, len(rest))
        repo_id, action, tail = "/".join(rest[:id_len]), rest[id_len] if len(rest) > id_len else None, rest[id_len + 1:]
        if action is not None and action not in actions:
            return self._error(404, "EntryNotFound", f"no such page: {self.path}")
        opened = self._open(kind, repo_id, tail[0] if tail else None)
        if opened is None:
            return None
        repo, revision = opened
        if action in (None, "revision"):
            sha = repo.commit(revision)
            return self._send(200, {"_id": sha[:24], "id": repo_id, "sha": sha, "private": False,
                                    "gated": "manual" if repo.token() else False, "disabled": False, "tags": [],
                                    "lastModified": "2026-01-01T00:00:00.000Z", "cardData": {},
                                    "siblings": [{"rfilename": f} for f in repo.files(revision)]})
        base = repo.tree(revision)
        if action == "tree":
            sub = "/".join(tail[1:])
            if not (base / sub).is_dir():
                return self._error(404, "EntryNotFound", f"{sub} does not exist on {tail[0]}")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            found = (base / sub).rglob("*") if recursive else (base / sub).iterdir()
            return self._send(200, [repo.entry(revision, p.relative_to(base).as_posix()) for p in sorted(found)])
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode()) if length else {}
        paths = [p.strip("/") for p in form.get("paths", [])]
        return self._send(200, [repo.entry(revision, p) for p in paths if (base / p).exists()])

    def _resolve(self, kind: str, repo_id: str, revision: str, path: str) -> None:
        opened = self._open(kind, repo_id, revision)
        if opened is None:
            return None
        repo, folder = opened
        full = repo.tree(folder) / path
        if not full.is_file():
            # with the revision's commit, as the hub answers: the client then caches "not there" for offline runs
            return self._error(404, "EntryNotFound", f"{path} does not exist on {revision!r} of {repo_id}",
                               {"X-Repo-Commit": repo.commit(folder)})
        size = full.stat().st_size
        headers = {"X-Repo-Commit": repo.commit(folder), "ETag": f'"{_blob_sha(full)}"', "Accept-Ranges": "bytes",
                   "Last-Modified": formatdate(usegmt=True)}
        start, end, status = 0, size - 1, 200
        wanted = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if wanted and size > 0:  # a resumed download asks for the rest of the file
            first, last = wanted.groups()
            start = int(first) if first else max(size - int(last or 0), 0)
            end = min(int(last), size - 1) if first and last else size - 1
            if start > end:
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"}, "application/octet-stream")
            status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{size}"
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            with open(full, "rb") as f:
                f.seek(start)
                left = end - start + 1
                while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                    self.wfile.write(chunk)
                    left -= len(chunk)

    do_GET = do_HEAD = do_POST = _route


class LoopbackServer:
    """An HTTP server on 127.0.0.1 (port 0: a free one) in a background thread, used as a context manager; `endpoint`
    is its address. The stand-in below and the fault proxy (hub_faults.py) are two."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int, host: str, daemon_threads: bool = True) -> None:
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = daemon_threads
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        self._thread = threading.Thread(target=self._server.serve_forever, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def _halt(self) -> None:
        """Stop accepting: the serving thread ends (connections already open are the caller's to end)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None

    def stop(self) -> None:
        """Stop answering and free the port (requests in flight end with a dropped connection)."""
        self._halt()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class HubStandin(LoopbackServer):
    """The stand-in on 127.0.0.1 in a background thread: `with HubStandin(root) as hub: ... hub.endpoint`."""

    def __init__(self, root: str | Path, port: int = 0, host: str = "127.0.0.1") -> None:
        self.root = Path(root)
        super().__init__(type("Handler", (_Handler,), {"root": self.root}), port, host)
