"""`gpuforge node-revision publish`: a gpuforge revision as one S3 object a node can fetch offline.

The object is `git archive` of the tracked tree at an exact commit (the repository root is the
collection, so the node unpacks it as ansible_collections/gpuforge/gpu), named by that commit and
carrying its sha256 in the object's metadata. The OnNodeConfigured custom action names the same
commit and sha256 (`--revision --sha256 --bucket`); gpuforge-node fetches it through the S3 gateway
endpoint, checks the sha256 and runs it (docs/node-side.md). The names are the node's own
(roles/gpuforge_node/files/gpuforge_node.py), loaded from the collection, so they cannot drift.

The tarball carries no wheels: a revision whose ansible-core pin differs from the image's needs a new
image (gpuforge-node runs every revision with the image's runtime).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuforge import paths
from gpuforge.errors import UserError

NODE_MODULE = Path("roles") / "gpuforge_node" / "files" / "gpuforge_node.py"


def node_module() -> ModuleType:
    """The node-side entry point's module (its names for revisions and objects)."""
    path = paths.share_root() / NODE_MODULE
    spec = importlib.util.spec_from_file_location("gpuforge_node", path)
    if spec is None or spec.loader is None:
        raise UserError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpuforge_node", module)
    spec.loader.exec_module(module)
    return module


def resolve(repo: Path, rev: str) -> str:
    """The exact commit a git revision names."""
    out = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    commit = out.stdout.strip()
    if out.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise UserError(f"{rev!r} names no commit in {repo}")
    return commit


def archive(repo: Path, commit: str) -> bytes:
    """The tracked tree at the commit, as gzip'd tar (git archive: the same commit gives the same bytes)."""
    out = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar.gz", commit], capture_output=True, check=False
    )
    if out.returncode != 0:
        raise UserError(f"git archive {commit} failed: {out.stderr.decode(errors='replace').strip()}")
    return out.stdout


def custom_action_args(node: ModuleType, commit: str, sha256: str, bucket: str, prefix: str) -> list[str]:
    args = ["--revision", commit, "--sha256", sha256, "--bucket", bucket]
    if prefix != node.DEFAULT_PREFIX:
        args += ["--prefix", prefix]
    return args


def publish(s3: Any, repo: Path, rev: str, bucket: str, prefix: str) -> dict[str, Any]:
    """Upload the revision's tarball once; an object of that name with other content is refused."""
    node = node_module()
    commit = resolve(repo, rev)
    key = node.object_key(prefix, commit)
    data = archive(repo, commit)
    digest = hashlib.sha256(data).hexdigest()
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except s3.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
            raise
        head = None
    if head is not None:
        existing = head.get("Metadata", {}).get("sha256")
        if existing != digest:
            raise UserError(
                f"s3://{bucket}/{key} exists with sha256 {existing}, not {digest}: revisions are immutable"
            )
        uploaded = False
    else:
        s3.put_object(
            Bucket=bucket,
            Key=key,
            Body=data,
            ChecksumSHA256=_b64_sha256(data),
            Metadata={"sha256": digest, "revision": commit},
            ContentType="application/gzip",
        )
        uploaded = True
    return {
        "revision": commit,
        "bucket": bucket,
        "key": key,
        "sha256": digest,
        "bytes": len(data),
        "uploaded": uploaded,
        "args": custom_action_args(node, commit, digest, bucket, prefix),
    }


def _b64_sha256(data: bytes) -> str:
    import base64

    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def revision_prefix(bucket: str, prefix: str | None) -> str:
    """The key prefix to publish under (the node's default when None); a UserError for a prefix or bucket
    gpuforge-node would refuse."""
    node = node_module()
    prefix = prefix or node.DEFAULT_PREFIX
    if not prefix.endswith("/"):
        raise UserError(f"--prefix {prefix!r} must end with /")
    if not node.BUCKET_RE.match(bucket):
        raise UserError(f"--bucket {bucket!r} is not an S3 bucket name")
    return prefix
