"""A small Hugging Face Hub on 127.0.0.1 for tests: the subset of the Hub's HTTP API that
huggingface_hub's create_repo, create_commit (upload_folder), get_paths_info and
list_repo_files use, model repos only, one branch (main), kept in memory.

Endpoints (as huggingface_hub 2.x calls them: hf_api.py, _commit_api.py, lfs.py):
  POST /api/repos/create                        {"name", "organization"|None, "type"} -> {"url"}
  POST /api/validate-yaml                       README front matter check: a base_model that is
                                                no model id is a 400, as on the Hub
  POST /api/models/OWNER/NAME/preupload/main    each file's uploadMode (lfs for .safetensors,
                                                .gguf, .bin; regular otherwise) and remote oid
  POST /OWNER/NAME.git/info/lfs/objects/batch   LFS batch: an upload action per missing object
  PUT  /lfs-upload/OID                          the object's bytes (sha256 checked)
  POST /api/models/OWNER/NAME/commit/main       NDJSON: header, file (base64), lfsFile (oid)
  POST /api/models/OWNER/NAME/paths-info/main   form paths=...: each file's git blob id, size,
                                                and its lfs {oid: sha256, size, pointerSize}
  GET  /api/models/OWNER/NAME/tree/main         every file (recursive)
  GET  /api/models/OWNER/NAME/revision/main     repo info with the head commit sha
With a token set, every /api call needs `Authorization: Bearer TOKEN` (401 otherwise).
`commits` counts the commits made, per repo.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
            f"size {size}\n").encode()


class Hub:
    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[str, dict[str, dict]] = {}  # repo -> path -> entry
        self.heads: dict[str, str] = {}
        self.commits: dict[str, int] = {}
        self.lfs: dict[str, bytes] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Hub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file(self, repo: str, path: str) -> bytes:
        entry = self.repos[repo][path]
        return self.lfs[entry["lfs"]["oid"]] if "lfs" in entry else entry["data"]

    def _entry(self, path: str, data: bytes | None, sha256: str | None, size: int) -> dict:
        if sha256 is None:  # a regular git file
            return {"type": "file", "path": path, "size": size, "oid": git_blob_sha1(data),
                    "data": data}
        pointer = lfs_pointer(sha256, size)
        return {"type": "file", "path": path, "size": size, "oid": git_blob_sha1(pointer),
                "lfs": {"oid": sha256, "size": size, "pointerSize": len(pointer)}}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, body, headers: dict | None = None) -> None:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _authorized(self) -> bool:
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self._send(401, {"error": "Invalid credentials in Authorization header"},
                               {"X-Error-Message": "Invalid credentials in Authorization header"})
                    return False
                return True

            def _repo(self, parts: list[str]) -> str | None:
                repo = "/".join(parts)
                if repo not in hub.repos:
                    self._send(404, {"error": f"Repository not found: {repo}"},
                               {"X-Error-Code": "RepoNotFound",
                                "X-Error-Message": "Repository not found"})
                    return None
                return repo

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if not self._authorized():
                    return
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                    repo = self._repo(parts[2:4])
                    if repo:
                        self._send(200, [{k: v for k, v in e.items() if k != "data"}
                                         for e in hub.repos[repo].values()])
                    return
                if parts[:2] == ["api", "models"] and len(parts) >= 5 and parts[4] == "revision":
                    repo = self._repo(parts[2:4])
                    if repo:
                        self._send(200, {"id": repo, "sha": hub.heads.get(repo, "0" * 40),
                                         "siblings": [{"rfilename": p}
                                                      for p in hub.repos[repo]]})
                    return
                self._send(404, {"error": f"not in this test hub: GET {url.path}"})

            def do_PUT(self) -> None:
                parts = urllib.parse.urlparse(self.path).path.strip("/").split("/")
                if parts[0] == "lfs-upload" and len(parts) == 2:
                    data = self._body()
                    if hashlib.sha256(data).hexdigest() != parts[1]:
                        self._send(400, {"error": "sha256 mismatch"})
                        return
                    hub.lfs[parts[1]] = data
                    self._send(200, {})
                    return
                self._send(404, {"error": f"not in this test hub: PUT {self.path}"})

            def do_POST(self) -> None:
                url = urllib.parse.urlparse(self.path)
                parts = url.path.strip("/").split("/")
                body = self._body()
                if len(parts) == 6 and parts[1].endswith(".git") and parts[2:] == \
                        ["info", "lfs", "objects", "batch"]:
                    return self._lfs_batch(json.loads(body))
                if not self._authorized():
                    return
                if parts == ["api", "repos", "create"]:
                    req = json.loads(body)
                    repo = f"{req.get('organization') or 'user'}/{req['name']}"
                    if repo in hub.repos:
                        self._send(409, {"error": "You already created this model repo",
                                         "url": f"{hub.url}/{repo}"})
                        return
                    hub.repos[repo], hub.commits[repo] = {}, 0
                    self._send(200, {"url": f"{hub.url}/{repo}"})
                    return
                if parts == ["api", "validate-yaml"]:
                    return self._validate_yaml(json.loads(body)["content"])
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo = self._repo(parts[2:4])
                    if not repo:
                        return
                    action = parts[4]
                    if action == "preupload":
                        return self._preupload(repo, json.loads(body))
                    if action == "commit":
                        return self._commit(repo, body)
                    if action == "paths-info":
                        form = urllib.parse.parse_qs(body.decode())
                        files = hub.repos[repo]
                        self._send(200, [{k: v for k, v in files[p].items() if k != "data"}
                                         for p in form.get("paths", []) if p in files])
                        return
                self._send(404, {"error": f"not in this test hub: POST {url.path}"})

            def _validate_yaml(self, content: str) -> None:
                """As the Hub: a card's base_model must be a model id, not a local path."""
                meta = {}
                if content.startswith("---\n") and "\n---\n" in content[4:]:
                    meta = yaml.safe_load(content[4:content.index("\n---\n", 4)]) or {}
                base = meta.get("base_model")
                if isinstance(base, str) and not re.fullmatch(r"[\w\-.]+(/[\w\-.]+)?", base):
                    message = (f'Invalid metadata in README.md.\n- "base_model" with value '
                               f'"{base}" is not valid. Use a model id from https://hf.co/models.')
                    self._send(400, {"error": message}, {"X-Error-Message": message.replace(
                        "\n", " ")})
                    return
                self._send(200, {"warnings": []})

            def _preupload(self, repo: str, req: dict) -> None:
                out = []
                for f in req["files"]:
                    entry = hub.repos[repo].get(f["path"])
                    lfs = f["path"].endswith(LFS_SUFFIXES)
                    oid = None
                    if entry is not None:
                        oid = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                    out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                                "shouldIgnore": False, "oid": oid})
                self._send(200, {"files": out})

            def _lfs_batch(self, req: dict) -> None:
                objects = []
                for obj in req["objects"]:
                    item = {"oid": obj["oid"], "size": obj["size"]}
                    if obj["oid"] not in hub.lfs:
                        item["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"}}
                    objects.append(item)
                self._send(200, {"transfer": "basic", "objects": objects},
                           {"Content-Type": "application/vnd.git-lfs+json"})

            def _commit(self, repo: str, body: bytes) -> None:
                files = dict(hub.repos[repo])
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    value = item["value"]
                    if item["key"] == "file":
                        data = base64.b64decode(value["content"])
                        files[value["path"]] = hub._entry(value["path"], data, None, len(data))
                    elif item["key"] == "lfsFile":
                        if value["oid"] not in hub.lfs:
                            self._send(422, {"error": f"LFS object {value['oid']} not uploaded"})
                            return
                        files[value["path"]] = hub._entry(value["path"], None, value["oid"],
                                                          value["size"])
                    elif item["key"] == "deletedFile":
                        files.pop(value["path"], None)
                hub.repos[repo] = files
                hub.commits[repo] += 1
                sha = hashlib.sha1(f"{repo}{hub.commits[repo]}".encode()).hexdigest()
                hub.heads[repo] = sha
                self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}",
                                 "commitOid": sha})

        return Handler
