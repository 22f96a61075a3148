"""The shipped SSM Command document (ssm/gpuforge-apply.yml): where it is, its parameters, its script.

Systems Manager checks each parameter value against the document's allowedPattern/allowedValues and
then replaces `{{ Name }}` in the step's commands with it as text. The CLI checks the same rules before
it sends anything (a bad value is the user's mistake, exit 2), and the lab's Run Command stand-in
(tests/ssmdouble.py) renders the script with them as Systems Manager would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuforge import paths
from gpuforge.errors import UserError

DEFAULT_NAME = "gpuforge-apply"
SHIPPED = Path("ssm") / "gpuforge-apply.yml"
ENTRY_POINT = "/usr/local/sbin/gpuforge-node"

# {{ Name }} with optional blanks inside the braces, as in AWS's own documents.
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}")


@dataclass(frozen=True)
class Document:
    path: Path
    text: str
    content: dict[str, Any]

    @property
    def parameters(self) -> dict[str, dict[str, Any]]:
        params: dict[str, dict[str, Any]] = self.content.get("parameters") or {}
        return params

    def script(self) -> str:
        """The aws:runShellScript step's commands as one script, placeholders left in."""
        (step,) = self.content["mainSteps"]
        return "\n".join(step["inputs"]["runCommand"])


def shipped_path() -> Path:
    return paths.share_root() / SHIPPED


def load(path: Path | None = None) -> Document:
    """The shipped document (or the one at `path`), parsed; a clear error when it is not a Command doc."""
    path = path or shipped_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read the SSM document {path}: {exc.strerror}") from exc
    content = yaml.safe_load(text)
    if not isinstance(content, dict) or content.get("schemaVersion") != "2.2":
        raise UserError(f"{path} is not an SSM Command document with schemaVersion 2.2")
    return Document(path, text, content)


def check_parameters(doc: Document, given: dict[str, str]) -> dict[str, str]:
    """Every parameter's value (given or default) after the document's own rules; UserError names the first
    value they refuse, as Systems Manager would refuse the command."""
    unknown = sorted(set(given) - set(doc.parameters))
    if unknown:
        raise UserError(f"the document {doc.path.name} has no parameter {', '.join(unknown)}")
    values: dict[str, str] = {}
    for name, spec in doc.parameters.items():
        value = given.get(name, spec.get("default"))
        if value is None:
            raise UserError(f"parameter {name} has no value and no default")
        value = str(value)
        allowed = spec.get("allowedValues")
        if allowed is not None and value not in [str(v) for v in allowed]:
            raise UserError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")
        pattern = spec.get("allowedPattern")
        if pattern is not None and re.fullmatch(pattern, value) is None:
            raise UserError(f"{name}={value!r} does not match {pattern} ({spec.get('description', '')})")
        values[name] = value
    return values


def render(doc: Document, given: dict[str, str]) -> str:
    """The script with every placeholder replaced by its checked value, as Systems Manager runs it."""
    values = check_parameters(doc, given)

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise UserError(
                f"the document's script names {{{{ {name} }}}}, which is not one of its parameters"
            )
        return values[name]

    return _PLACEHOLDER.sub(value, doc.script())
