"""A recording proxy on loopback in front of moto: every AWS call, with the tags its target carried.

A test double named as such. Packer (custom_endpoint_ec2) and boto3 (AWS_ENDPOINT_URL) talk to the
proxy; for each request it asks moto, before forwarding, which tags the resources the call names
carry at that moment, then logs the call (service, action, region, resource ids, the tags the request
itself sets) and forwards it. It can refuse chosen EC2 actions as IAM would (UnauthorizedOperation,
HTTP 403) to make Packer fail after CreateImage and record its cleanup. moto enforces no IAM: what
the calls may do is decided afterwards by iamaudit.evaluate against the shipped policy.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

# EC2 query parameters that name an existing resource (a trailing .N is stripped first).
_ID_PARAMS = (
    "InstanceId",
    "ImageId",
    "SourceImageId",
    "SnapshotId",
    "GroupId",
    "VolumeId",
    "ResourceId",
    "KeyName",
)
# Ids a creating call returns, from the first element of that name in EC2's XML reply.
_CREATED = {
    "RunInstances": "instanceId",
    "CreateImage": "imageId",
    "CopyImage": "imageId",
    "CreateSecurityGroup": "groupId",
    "CreateKeyPair": "keyName",
    "CreateSnapshot": "snapshotId",
}
_REGION = re.compile(r"Credential=[^/]+/\d{8}/([a-z0-9-]+)/([a-z0-9-]+)/aws4_request")
_DENIED = (
    '<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>UnauthorizedOperation</Code>'
    "<Message>You are not authorized to perform this operation. (awsrecorder: {action} refused)</Message>"
    "</Error></Errors><RequestID>awsrecorder</RequestID></Response>"
)


def _strip_index(name: str) -> str:
    return re.sub(r"\.\d+$", "", name)


def ec2_request_tags(params: dict[str, str]) -> dict[str, dict[str, str]]:
    """resource type -> tags a request sets (TagSpecification.N...), '' for CreateTags' own Tag.N."""
    found: dict[str, dict[str, str]] = {}
    for name, value in params.items():
        spec = re.fullmatch(r"TagSpecification\.(\d+)\.Tag\.(\d+)\.Key", name)
        if spec:
            kind = params.get(f"TagSpecification.{spec[1]}.ResourceType", "")
            found.setdefault(kind, {})[value] = params.get(
                f"TagSpecification.{spec[1]}.Tag.{spec[2]}.Value", ""
            )
        plain = re.fullmatch(r"Tag\.(\d+)\.Key", name)
        if plain:
            found.setdefault("", {})[value] = params.get(f"Tag.{plain[1]}.Value", "")
    return found


@dataclass
class Recorder:
    """The proxy's state: where moto is, what it refuses, and what it has seen."""

    moto_url: str
    refuse: set[str] = field(default_factory=set)
    calls: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _ec2(self, region: str) -> Any:
        return boto3.client(
            "ec2",
            region_name=region,
            endpoint_url=self.moto_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def tags_of(self, region: str, resource: str) -> dict[str, str]:
        """The tags moto holds for one resource id (a key pair by name) right now."""
        ec2 = self._ec2(region)
        if not re.match(r"^[a-z]+-[0-9a-f]+$", resource):
            pairs = ec2.describe_key_pairs(Filters=[{"Name": "key-name", "Values": [resource]}])["KeyPairs"]
            return {t["Key"]: t["Value"] for p in pairs for t in p.get("Tags", [])}
        found = ec2.describe_tags(Filters=[{"Name": "resource-id", "Values": [resource]}])["Tags"]
        return {t["Key"]: t["Value"] for t in found}

    def ec2_entry(self, region: str, params: dict[str, str]) -> dict[str, Any]:
        action = params.get("Action", "?")
        resources = sorted(
            {v for k, v in params.items() if _strip_index(k) in _ID_PARAMS and v},
        )
        entry: dict[str, Any] = {"service": "ec2", "action": action, "region": region}
        if resources:
            entry["resources"] = {r: self.tags_of(region, r) for r in resources}
        request_tags = ec2_request_tags(params)
        if request_tags:
            entry["request_tags"] = request_tags
        # The few request parameters the policy's conditions read.
        kept = {k: v for k, v in params.items() if k in ("InstanceType", "SourceRegion", "KmsKeyId", "Name")}
        kept.update(
            {k: v for k, v in params.items() if k.endswith(".Ebs.KmsKeyId") or k.endswith("Attribute")}
        )
        if "Description.Value" in params:
            kept["Description.Value"] = params["Description.Value"]
        if "ImdsSupport.Value" in params:
            kept["ImdsSupport.Value"] = params["ImdsSupport.Value"]
        if kept:
            entry["params"] = dict(sorted(kept.items()))
        return entry


def _handler(recorder: Recorder) -> type[http.server.BaseHTTPRequestHandler]:
    moto = urllib.parse.urlsplit(recorder.moto_url)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(moto.hostname or "127.0.0.1", moto.port or 80, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
            conn.request(self.command, self.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
            conn.close()
            return reply.status, reply.getheaders(), data

        def _entry(self, body: bytes) -> dict[str, Any] | None:
            match = _REGION.search(self.headers.get("Authorization", ""))
            region, service = (match[1], match[2]) if match else ("us-east-1", "?")
            target = self.headers.get("X-Amz-Target", "")
            if target:  # JSON protocol (SSM, KMS): the action is in a header, the resource in the body.
                payload = json.loads(body or b"{}")
                named = {
                    k: v for k, v in payload.items() if k in ("Name", "Path", "KeyId") and isinstance(v, str)
                }
                return {"service": service, "action": target.rsplit(".", 1)[-1], "region": region, **named}
            params = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
            if self.command == "POST" and "Action" in params:
                if service == "ec2":
                    return recorder.ec2_entry(region, params)
                return {"service": service, "action": params["Action"], "region": region}
            return {"service": service, "action": self.command, "region": region, "path": self.path}

        def _handle(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            entry = self._entry(body)
            refused = entry is not None and entry["service"] == "ec2" and entry["action"] in recorder.refuse
            if refused:
                assert entry is not None
                status, headers, data = (
                    403,
                    [("Content-Type", "text/xml")],
                    _DENIED.format(action=entry["action"]).encode(),
                )
            else:
                status, headers, data = self._forward(body)
            if entry is not None:
                entry["status"] = status
                created = _CREATED.get(entry["action"])
                if created and status == 200:
                    found = re.search(rf"<{created}>([^<]+)</{created}>", data.decode(errors="replace"))
                    if found:
                        entry["created"] = found[1]
                with recorder.lock:
                    recorder.calls.append(entry)
            self.send_response(status)
            for key, value in headers:
                if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle  # noqa: N815 (http.server's names)

        def log_message(self, *args: Any) -> None:
            """Quiet: the record is the log."""

    return Handler


@contextmanager
def recording(moto_url: str, refuse: set[str] | None = None) -> Iterator[tuple[str, Recorder]]:
    """(proxy URL, recorder) for the duration of the block."""
    recorder = Recorder(moto_url, refuse or set())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(recorder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", recorder
    finally:
        server.shutdown()
        server.server_close()


def write(path: Path, calls: list[dict[str, Any]], about: dict[str, Any]) -> None:
    path.write_text(json.dumps({"about": about, "calls": calls}, indent=1, sort_keys=True) + "\n")
