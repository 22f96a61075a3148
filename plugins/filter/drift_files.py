"""Ansible filter gpuforge.gpu.drift_files: the managed files a check-mode run would change, per host.

playbooks/drift.yml runs the roles in check mode with --diff and the ansible.posix.json callback;
this filter reads that output and keeps, for every host, the files whose content or attributes the
roles would change (a diff with a file header or path), and how many other tasks would change.
Filter gpuforge.gpu.drift_files_report words one host's line of the drift report from that.
"""

from __future__ import annotations

import json
from typing import Any

from ansible.errors import AnsibleFilterError


def _paths(result: dict[str, Any]) -> list[str]:
    """The file paths named by one task result's diff(s)."""
    diffs = result.get("diff") or []
    if isinstance(diffs, dict):
        diffs = [diffs]
    found: list[str] = []
    for diff in diffs:
        if not isinstance(diff, dict):
            continue
        header = diff.get("before_header")
        before = diff.get("before")
        if isinstance(header, str) and header.startswith("/"):
            found.append(header)
        elif isinstance(before, dict) and isinstance(before.get("path"), str):
            found.append(before["path"])
    return found


def _documents(output: str) -> list[dict[str, Any]]:
    """Every JSON document in the output: the callback prints one per playbook (its
    v2_playbook_on_stats runs at the end of each playbook of an ansible-playbook run), and other
    lines (warnings) may come before or between them."""
    decoder = json.JSONDecoder()
    documents: list[dict[str, Any]] = []
    position = output.find("{") if isinstance(output, str) else -1
    while position >= 0:
        try:
            document, end = decoder.raw_decode(output, position)
        except ValueError as exc:
            if not documents:
                raise AnsibleFilterError(f"drift_files: not the json callback's output: {exc}") from exc
            # Text after the last document that happens to contain a brace.
            break
        if isinstance(document, dict):
            documents.append(document)
        position = output.find("{", end)
    if not documents:
        raise AnsibleFilterError("drift_files: not the json callback's output: no JSON document found")
    return documents


def _plays(output: str) -> list[dict[str, Any]]:
    """The plays of all documents, each once. ansible.posix.json keeps its play list across the
    playbooks of one run, so a later document repeats the earlier plays; a play is known by its id."""
    plays: dict[str, dict[str, Any]] = {}
    for document in _documents(output):
        for index, play in enumerate(document.get("plays", [])):
            ident = str((play.get("play") or {}).get("id") or f"#{index}")
            plays[ident] = play
    return list(plays.values())


def _playbook_name(play: dict[str, Any]) -> str:
    """The file name of the playbook a play comes from (the callback's play path is FILE:LINE)."""
    path = str((play.get("play") or {}).get("path") or "")
    return path.rsplit(":", 1)[0].rsplit("/", 1)[-1]


def drift_files(output: str, install_playbook: str = "bake.yml") -> dict[str, dict[str, Any]]:
    """{host: {"files": [...], "install_files": [...], "other_changes": N}} from ansible.posix.json output.

    install_files are the files among them that a play of `install_playbook` writes (the install phase,
    which a golden node's converge skips): only an install run puts those back.
    """
    report: dict[str, dict[str, Any]] = {}
    for play in _plays(output):
        install = _playbook_name(play) == install_playbook
        for task in play.get("tasks", []):
            for host, result in task.get("hosts", {}).items():
                entry = report.setdefault(host, {"files": [], "install_files": [], "other_changes": 0})
                items = result.get("results") if isinstance(result.get("results"), list) else [result]
                for item in items:
                    if not isinstance(item, dict) or not item.get("changed"):
                        continue
                    paths = _paths(item)
                    if paths:
                        entry["files"].extend(p for p in paths if p not in entry["files"])
                        if install:
                            entry["install_files"].extend(p for p in paths if p not in entry["install_files"])
                    else:
                        entry["other_changes"] += 1
    for entry in report.values():
        entry["files"].sort()
        entry["install_files"].sort()
    return report


# How to compare what the default drift check leaves out on a golden node.
DEEP_CHECK = "ansible-playbook playbooks/drift.yml -e gpuforge_drift_install=true"


def drift_files_report(
    found: dict[str, Any], host: str, remedy: str, golden: bool, install_checked: bool
) -> str:
    """One host's managed-files line of the drift report.

    found is drift_files' entry for the host; remedy the least command that puts its files back. On a
    golden node the default check is a converge in check mode, which takes the fast path and skips the
    install roles: their files were not compared, and the line says so and how to compare them.
    """
    files = list(found.get("files") or [])
    if files:
        line = (
            f"DRIFT: {len(files)} managed file(s) differ from what the roles would write: "
            f"{', '.join(files)}; to put them back: {remedy}"
        )
    else:
        line = "managed files as the roles would write them"
    line += f" ({int(found.get('other_changes') or 0)} other task(s) would change something)"
    if golden and not install_checked:
        line += (
            "; NOT COMPARED: the install phase's files (golden node: a converge skips the install roles, "
            "and the manifest comparison stands for them); to compare them too: "
            f"{DEEP_CHECK} --limit {host}"
        )
    return line


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"drift_files": drift_files, "drift_files_report": drift_files_report}
