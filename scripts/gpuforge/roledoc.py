"""Generate each role README's variable table from its meta/argument_specs.yml.

The table sits between two markers in roles/<role>/README.md, so prose around it is kept and
the table never drifts from the argument specs Ansible enforces:

    <!-- BEGIN ARGUMENT SPECS -->
    ...generated...
    <!-- END ARGUMENT SPECS -->

`python -m gpuforge.roledoc` rewrites the tables; `--check` fails if any is out of date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from gpuforge import paths

BEGIN = "<!-- BEGIN ARGUMENT SPECS -->"
END = "<!-- END ARGUMENT SPECS -->"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        value = " ".join(str(v) for v in value)
    text = str(value).replace("|", "\\|").replace("\n", " ").strip()
    return text


def _defaults(role: Path) -> dict[str, Any]:
    path = role / "defaults" / "main.yml"
    loaded = yaml.safe_load(path.read_text()) if path.exists() else None
    return loaded if isinstance(loaded, dict) else {}


def render(role: Path) -> str:
    """The markdown table for one role: one row per option of each entry point."""
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    defaults = _defaults(role)
    lines = [BEGIN]
    for entry, spec in specs.items():
        lines += ["", f"Entry point `{entry}`: {_cell(spec.get('short_description'))}", ""]
        lines += ["| variable | type | default | description |", "| --- | --- | --- | --- |"]
        for name, option in sorted((spec.get("options") or {}).items()):
            kind = option.get("type", "str")
            if kind == "list" and option.get("elements"):
                kind = f"list of {option['elements']}"
            if option.get("choices"):
                kind += " (" + ", ".join(f"`{c}`" for c in option["choices"]) + ")"
            default = option.get("default", defaults.get(name))
            shown = (
                "required"
                if option.get("required")
                else (f"`{_cell(default)}`" if name in defaults or "default" in option else "")
            )
            lines.append(f"| `{name}` | {kind} | {shown} | {_cell(option.get('description'))} |")
    lines += ["", END]
    return "\n".join(lines)


def update(readme: Path, table: str) -> str | None:
    """The README with its table replaced, or None when it has no markers to replace between."""
    text = readme.read_text() if readme.exists() else ""
    if BEGIN not in text or END not in text:
        return None
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + table + tail


def roles(root: Path) -> list[Path]:
    return sorted(p.parent.parent for p in root.glob("roles/*/meta/argument_specs.yml"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a README table is out of date")
    args = parser.parse_args(argv)
    stale, unmarked = [], []
    for role in roles(paths.repo_root()):
        readme = role / "README.md"
        new = update(readme, render(role))
        if new is None:
            unmarked.append(str(readme))
        elif readme.read_text() != new:
            if args.check:
                stale.append(str(readme))
            else:
                readme.write_text(new)
                print(f"updated {readme}")
    if unmarked:
        print(f"no {BEGIN} ... {END} markers in: " + ", ".join(unmarked), file=sys.stderr)
    if stale:
        print("out of date (run python -m gpuforge.roledoc): " + ", ".join(stale), file=sys.stderr)
    return 1 if stale or unmarked else 0


if __name__ == "__main__":
    sys.exit(main())
