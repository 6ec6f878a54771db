"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, enough for huggingface_hub's create_repo and
upload_folder: it keeps what a push sends (repositories created, commits with their files) in memory, and
refuses a request without a token (401) as the Hub does. Nothing leaves the machine.

    with FakeHub() as hub:          # hub.url for HF_ENDPOINT; hub.repos after the push
        ..."""

from __future__ import annotations

import base64
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml


class FakeHub:
    def __init__(self, token: str = "hf_kiln_test"):
        self.token = token
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "files": {path: bytes}, "commits": [...]}
        self.requests: list[tuple[str, str]] = []
        self.cards: list[dict] = []  # the metadata of each model card validated
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(n) if n else b""
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                return data

            def _send(self, code: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                self._send(404, {"error": f"not here: {self.path}"})

            def do_POST(self):
                hub.requests.append(("POST", self.path))
                body = self._body()
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                path = self.path.split("?")[0]
                if path == "/api/validate-yaml":  # a model card's metadata: YAML between --- lines, a mapping
                    text = json.loads(body)["content"]
                    try:
                        meta = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else {}
                    except yaml.YAMLError as e:
                        return self._send(400, {"error": f"invalid YAML: {e}"})
                    if not isinstance(meta, dict):
                        return self._send(400, {"error": "the metadata is not a mapping"})
                    hub.cards.append(meta)
                    return self._send(200, {"warnings": []})
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    private = bool(req.get("private")) or req.get("visibility") == "private"
                    hub.repos.setdefault(repo, {"private": private, "files": {}, "commits": []})
                    return self._send(200, {"url": f"{hub.url}/{repo}", "name": repo})
                parts = path.split("/")  # /api/models/{owner}/{name}/{preupload|commit}/{revision}
                if len(parts) >= 7 and parts[1] == "api" and parts[2] == "models":
                    repo, action = f"{parts[3]}/{parts[4]}", parts[5]
                    if repo not in hub.repos:
                        return self._send(404, {"error": f"repository {repo} not found"})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False, "oid": None} for f in files]})
                    if action == "commit":
                        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                        header = next(x["value"] for x in lines if x["key"] == "header")
                        files = {x["value"]["path"]: base64.b64decode(x["value"]["content"])
                                 for x in lines if x["key"] == "file"}
                        hub.repos[repo]["files"].update(files)
                        hub.repos[repo]["commits"].append({"summary": header.get("summary"), "files": sorted(files)})
                        oid = f"{len(hub.repos[repo]['commits']):040x}"
                        return self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                                                "pullRequestUrl": None})
                self._send(404, {"error": f"not here: {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
