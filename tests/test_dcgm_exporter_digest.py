"""The dcgm-exporter image held to one digest (roles/dcgm/tasks/exporter_image.yml).

Docker is a test double here: a small script keeping its images in a JSON file, with a "registry"
whose tag currently points at REGISTRY_DIGEST. One play on the control host (not in check mode: the
tasks only run that script) runs the role's tasks file once per case.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from localplay import REPO as CHECKOUT
from localplay import record, run_cases

ROLE_TASKS = CHECKOUT / "roles/dcgm/tasks"

REPO = "nvcr.io/nvidia/k8s/dcgm-exporter"
TAG = "4.5.3-4.8.2-distroless"
IMAGE = f"{REPO}:{TAG}"
VERSION = "4.5.3-4.8.2"
D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
D3 = "sha256:" + "3" * 64
REGISTRY_DIGEST = D1

FAKE_DOCKER = """#!{python}
# TEST DOUBLE of the docker CLI: 'image inspect --format ... REF' and 'pull REF' only.
import json, os, sys
state_file = os.environ.get("FAKE_DOCKER_STATE") or os.path.join(os.path.dirname(__file__), "state.json")
state = json.load(open(state_file))
args = sys.argv[1:]
if args[:2] == ["image", "inspect"]:
    ref = args[-1]
    digest = state["images"].get(ref)
    if digest is None:
        print("Error: No such image: " + ref, file=sys.stderr)
        sys.exit(1)
    print(json.dumps([state["repo"] + "@" + digest]))
elif args[0] == "pull":
    ref = args[1]
    digest = ref.split("@", 1)[1] if "@" in ref else state["registry"]
    state["images"][ref] = digest
    state["images"].setdefault(state["repo"] + "@" + digest, digest)
    state["pulls"].append(ref)
    json.dump(state, open(state_file, "w"))
else:
    sys.exit("fake docker: unexpected " + " ".join(args))
"""

# case -> (images Docker holds: ref -> digest, recorded digest in the node manifest, published digest,
#          allow change)
CASES: dict[str, tuple[dict[str, str], str, str, bool]] = {
    "first-pull-records-the-digest": ({}, "", "", False),
    "recorded-and-present": ({IMAGE: D1, f"{REPO}@{D1}": D1}, D1, "", False),
    "recorded-but-absent-pulls-by-digest": ({}, D1, "", False),
    "tag-moved-locally-is-refused": ({IMAGE: D2, f"{REPO}@{D1}": D1}, D1, "", False),
    "tag-moved-locally-accepted-when-told": ({IMAGE: D2, f"{REPO}@{D1}": D1}, D1, "", True),
    "published-digest-pulls-by-digest": ({}, "", D3, False),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("exporter-digest")
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (images, recorded, published, allow) in CASES.items():
        directory = root / case
        directory.mkdir()
        docker = directory / "docker"
        docker.write_text(FAKE_DOCKER.replace("{python}", sys.executable))
        docker.chmod(0o755)
        # Where the tag moved, the registry's tag moved first (NVIDIA republished the tag).
        registry = D2 if case.startswith("tag-moved") else REGISTRY_DIGEST
        state = {"repo": REPO, "registry": registry, "images": images, "pulls": []}
        (directory / "state.json").write_text(json.dumps(state))
        previous = (
            {"installed": {"dcgm_exporter": {"version": VERSION, "source": "gpuforge", "digest": recorded}}}
            if recorded
            else {}
        )
        cases[case] = [
            {
                # The tasks file alone: the role's dependencies (the driver) must not run on the control host.
                "ansible.builtin.include_tasks": str(ROLE_TASKS / "exporter_image.yml"),
                "vars": {
                    "_dcgm_docker": str(docker),
                    "dcgm_exporter_image": IMAGE,
                    "dcgm_exporter_version": VERSION,
                    "dcgm_exporter_image_digest": published,
                    "dcgm_exporter_allow_digest_change": allow,
                    "gpuforge_previous_manifest": previous,
                },
            },
            record(
                case,
                {"entry": "{{ gpuforge_reality.dcgm_exporter }}", "run_ref": "{{ _dcgm_exporter_run_ref }}"},
            ),
        ]
    play_vars = {"gpuforge_versions": {}, "gpuforge_common_imds_enabled": False}
    results = run_cases(root, cases, play_vars, check=False)
    pulls = {case: json.loads((root / case / "state.json").read_text())["pulls"] for case in CASES}
    return {"results": results, "pulls": pulls}


# case -> (digest recorded afterwards, pulls made, or the refusal's words)
EXPECTED: dict[str, tuple[str, list[str]] | str] = {
    "first-pull-records-the-digest": (D1, [IMAGE]),
    "recorded-and-present": (D1, []),
    "recorded-but-absent-pulls-by-digest": (D1, [f"{REPO}@{D1}"]),
    "tag-moved-locally-is-refused": f"{IMAGE} is {D2} on this host, but this node is held to {D1}",
    "tag-moved-locally-accepted-when-told": (D2, [IMAGE]),
    "published-digest-pulls-by-digest": (D3, [f"{REPO}@{D3}"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_exporter_digest_is_recorded_and_held(outcomes: dict[str, Any], case: str) -> None:
    got = outcomes["results"][case]
    expected = EXPECTED[case]
    if isinstance(expected, str):
        assert isinstance(got, str), f"{case} was not refused: {got}"
        assert expected in " ".join(got.split())
        assert "dcgm_exporter_allow_digest_change" in got
        assert outcomes["pulls"][case] == []
        return
    digest, pulls = expected
    assert got["entry"]["digest"] == digest
    assert (got["entry"]["version"], got["entry"]["source"]) == (VERSION, "gpuforge")
    # The unit runs the image by that digest, so a boot never fetches other content under the tag.
    assert got["run_ref"] == f"{REPO}@{digest}"
    assert outcomes["pulls"][case] == pulls
