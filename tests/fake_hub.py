"""A local stand-in for the Hugging Face Hub's upload API: the calls huggingface_hub makes
for `HfApi.create_repo` and `HfApi.create_commit` (validate-yaml, repos/create, preupload,
commit), over an in-memory repo table.

Every file is answered "regular" at preupload, so the commit carries its bytes (base64 in
the ndjson body) and the test can compare them with what was on disk. A request without
`Authorization: Bearer <token>` of the expected token is refused with 401, as the Hub does.
Every request is recorded (method, path, JSON body, whether it was authorised).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from huggingface_hub import ModelCard


@dataclass
class FakeHub:
    token: str
    repos: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> visibility, files
    requests: list[dict[str, Any]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                authorised = self.headers.get("Authorization") == f"Bearer {hub.token}"
                hub.requests.append({"method": "POST", "path": self.path, "authorised": authorised,
                                     "body": body.decode(errors="replace")})  # fmt: skip
                if not authorised:
                    return self.answer(
                        401, {"error": "Invalid credentials in Authorization header"}
                    )
                status, doc = hub.route(self.path, body)
                return self.answer(status, doc)

            def answer(self, status: int, doc: dict[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def route(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        path = path.split("?")[0]
        if path == "/api/validate-yaml":  # create_commit asks before it uploads a README.md
            return self.validate(json.loads(body)["content"])
        if path == "/api/repos/create":
            doc = json.loads(body)
            repo = f"{doc['organization']}/{doc['name']}"
            self.repos.setdefault(repo, {"visibility": doc.get("visibility"), "files": {}})
            return 200, {"url": f"{self.url}/{repo}"}
        parts = path.split("/")  # ['', 'api', 'models', ns, name, op, revision]
        if len(parts) == 7 and parts[:3] == ["", "api", "models"]:
            repo = f"{parts[3]}/{parts[4]}"
            if repo not in self.repos:
                return 404, {"error": f"Repository {repo} not found"}
            if parts[5] == "preupload":
                files = json.loads(body)["files"]
                return 200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                        "shouldIgnore": False} for f in files]}  # fmt: skip
            if parts[5] == "commit":
                return 200, self.commit(repo, body)
        return 404, {"error": f"no such endpoint: {path}"}

    def validate(self, content: str) -> tuple[int, dict[str, Any]]:
        """What this stand-in can check of the Hub's metadata rules: the YAML header parses
        into huggingface_hub's ModelCardData, and its typed keys have their types."""
        try:
            data = ModelCard(content).data.to_dict()
        except Exception as exc:  # any parse failure is the Hub's 400
            return 400, {"errors": [{"message": str(exc)}]}
        wrong = [k for k in ("library_name", "license") if not isinstance(data.get(k, ""), str)]
        wrong += [] if isinstance(data.get("tags", []), list) else ["tags"]
        if wrong or not data:
            return 400, {"errors": [{"message": f"invalid metadata: {wrong or 'empty'}"}]}
        return 200, {"errors": [], "warnings": []}

    def commit(self, repo: str, body: bytes) -> dict[str, Any]:
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                value = item["value"]
                self.repos[repo]["files"][value["path"]] = base64.b64decode(value["content"])
        oid = hashlib.sha1(body).hexdigest()
        return {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid,
                "pullRequestUrl": None}  # fmt: skip
