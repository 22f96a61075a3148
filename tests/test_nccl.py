"""nccl-tests all_reduce_perf parser, verdict and report, run on real published output.

The logs under tests/fixtures/nccl/ are genuine nccl-tests output (sources in its README).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpuforge import cli as gpuforge_cli
from gpuforge import instance_types
from gpuforge.errors import UserError
from gpuforge.nccl import cli as nccl_cli
from gpuforge.nccl import report
from gpuforge.nccl.evaluate import LARGE_MESSAGE_BYTES, THRESHOLD, Verdict, evaluate, expected_peak
from gpuforge.nccl.parse import Run, parse

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
GCP = FIXTURES / "gcp-a3mega-h100-2node.log"
EFA = FIXTURES / "aws-eks-efa-g4dn-2node.log"
OLD = FIXTURES / "aws-p3dn-2node-old-layout.excerpt.log"
SBATCH = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "nccl-allreduce.sbatch"


def only(path: Path) -> Run:
    runs = parse(path.read_text(), path.name)
    assert len(runs) == 1
    return runs[0]


def table_lines(text: str) -> list[str]:
    """Data rows of a log by a second, independent rule: a line whose first field is a byte count."""
    stripped = (re.sub(r"^\[\d+,\d+\]<stdout>:", "", line) for line in text.splitlines())
    return [line for line in stripped if re.match(r"^\s+\d+\s+\d+\s+float\s", line)]


@pytest.mark.parametrize("path", [GCP, EFA, OLD], ids=lambda p: p.name)
def test_every_table_row_is_parsed(path: Path) -> None:
    text = path.read_text()
    run = only(path)
    lines = table_lines(text)
    assert len(run.rows) == len(lines) > 0
    for row, line in zip(run.rows, lines, strict=True):
        fields = line.split()
        assert row.size_bytes == int(fields[0])
        assert row.count == int(fields[1])
        assert row.in_place.busbw_gb_s == float(fields[-2])


def test_current_layout_h100_run() -> None:
    run = only(GCP)
    assert run.rows[0].size_bytes == 8
    assert run.max_bytes == run.rows[-1].size_bytes == 8589934592
    last = run.rows[-1]
    assert (last.out_of_place.busbw_gb_s, last.in_place.busbw_gb_s) == (338.82, 337.35)
    assert last.busbw_gb_s == 338.82
    assert last.root == -1
    assert last.redop == "sum"
    assert last.dtype == "float"
    assert run.avg_busbw_gb_s == 70.742
    assert run.out_of_bounds == 0
    assert run.wrong_rows == []
    assert len(run.devices) == 16
    assert run.hosts == ["ztan-mig-235z", "ztan-mig-gq73"]


def test_sizes_follow_the_logged_step_factor() -> None:
    run = only(GCP)
    sizes = [r.size_bytes for r in run.rows]
    assert sizes == [sizes[0] * 2**i for i in range(len(sizes))]


@pytest.mark.parametrize("path", [GCP, EFA], ids=lambda p: p.name)
def test_busbw_is_algbw_times_the_allreduce_factor(path: Path) -> None:
    """nccl-tests defines all-reduce busbw = algbw * 2(n-1)/n for n ranks; the parse must agree."""
    run = only(path)
    n = len(run.devices)
    factor = 2 * (n - 1) / n
    for row in run.rows:
        for half in (row.out_of_place, row.in_place):
            # Both figures are printed with two decimals, so allow the rounding of each.
            assert half.busbw_gb_s == pytest.approx(half.algbw_gb_s * factor, abs=0.01 * factor + 0.011)


def test_open_mpi_tags_and_nccl_info_lines_are_ignored() -> None:
    run = only(EFA)
    assert run.nccl_version == "2.12.7+cuda11.4"
    assert run.avg_busbw_gb_s == 1.15327
    assert [r.size_bytes for r in run.rows[:3]] == [0, 0, 4]
    assert run.hosts == ["test-nccl-efa-worker-0", "test-nccl-efa-worker-1"]


def test_old_layout_has_no_root_and_a_float_error_column() -> None:
    run = only(OLD)
    assert run.wrong_column == "error"
    assert all(r.root is None for r in run.rows)
    assert run.rows[0].out_of_place.wrong == 5e-07
    # A max-error float is not a count of wrong elements.
    assert run.wrong_rows == []


def test_srun_label_prefix_is_stripped() -> None:
    text = GCP.read_text()
    labelled = "\n".join(f"0: {line}" for line in text.splitlines())
    assert parse(labelled, "x")[0].rows == only(GCP).rows


def test_concatenated_logs_give_one_run_each() -> None:
    runs = parse(GCP.read_text() + "\n" + EFA.read_text(), "both")
    assert [r.source for r in runs] == ["both#1", "both#2"]
    assert [len(r.rows) for r in runs] == [len(only(GCP).rows), len(only(EFA).rows)]


def test_text_without_a_table_is_a_user_error() -> None:
    with pytest.raises(UserError, match="no all_reduce_perf result rows"):
        parse("srun: error: Unable to allocate resources\n", "job.out")


def test_every_gpu_type_has_an_expected_peak_and_others_are_rejected() -> None:
    for name, facts in instance_types.all_types().items():
        if facts.gpus:
            assert expected_peak(name) > 0
        else:
            with pytest.raises(UserError, match="nccl_allreduce_busbw_gb_s"):
                expected_peak(name)


def test_verdict_follows_the_threshold_on_real_output() -> None:
    run = only(GCP)
    best = max(r.busbw_gb_s for r in run.rows if r.size_bytes >= LARGE_MESSAGE_BYTES)
    ok = evaluate(run, "p5.48xlarge", peak_gb_s=best / (THRESHOLD + 0.05))
    assert ok.verdict is Verdict.PASS
    assert ok.large_busbw_gb_s == best
    low = evaluate(run, "p5.48xlarge", peak_gb_s=best / (THRESHOLD - 0.05))
    assert low.verdict is Verdict.FAIL
    assert "below 90%" in low.reasons[0]


def test_run_without_large_messages_fails() -> None:
    ev = evaluate(only(OLD), "p4d.24xlarge", expected_peak("p4d.24xlarge"))
    assert ev.verdict is Verdict.FAIL
    assert ev.large_busbw_gb_s is None
    assert "-e 1G" in " ".join(ev.reasons)


def test_wrong_elements_fail_even_when_fast() -> None:
    lines = GCP.read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("  8589934592"))
    fields = lines[last].rsplit(maxsplit=1)
    lines[last] = f"{fields[0]}      7"
    run = parse("\n".join(lines), "corrupt")[0]
    ev = evaluate(run, "p5.48xlarge", peak_gb_s=1.0)
    assert ev.verdict is Verdict.FAIL
    assert "8589934592" in ev.reasons[0]


def test_unfinished_run_fails_even_when_fast() -> None:
    text = GCP.read_text()
    cut = text[: text.index("  2147483648")]
    run = parse(cut, "cut")[0]
    assert run.rows[-1].size_bytes == 1 << 30
    ev = evaluate(run, "p5.48xlarge", peak_gb_s=1.0)
    assert ev.verdict is Verdict.FAIL
    assert "did not finish" in " ".join(ev.reasons)


def test_single_node_run_is_not_judged() -> None:
    text = GCP.read_text().replace("ztan-mig-gq73", "ztan-mig-235z")
    ev = evaluate(parse(text, "one-node")[0], "p5.48xlarge", expected_peak("p5.48xlarge"))
    assert ev.verdict is Verdict.SKIP
    assert "single-node" in ev.reasons[0]


def test_report_files(tmp_path: Path) -> None:
    evaluations = [
        evaluate(only(GCP), "p5.48xlarge", expected_peak("p5.48xlarge")),
        evaluate(only(EFA), "p5.48xlarge", expected_peak("p5.48xlarge")),
    ]
    entries = report.write(evaluations, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert [e["verdict"] for e in data["runs"]] == [ev.verdict.value for ev in evaluations]
    assert data["runs"][0]["large_message_busbw_gb_s"] == evaluations[0].large_busbw_gb_s
    assert len(data["runs"][1]["rows"]) == len(evaluations[1].run.rows)
    markdown = (tmp_path / "report.md").read_text()
    for entry in entries:
        png = tmp_path / entry["plot"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"| {entry['source']} |" in markdown
        assert f"]({entry['plot']})" in markdown


def cli(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuforge")
    nccl_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


def test_cli_exit_code_follows_the_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ratio = max(r.busbw_gb_s for r in only(GCP).rows) / expected_peak("p5.48xlarge")
    base = ["nccl-report", str(GCP), "--instance-type", "p5.48xlarge", "--out", str(tmp_path / "r")]
    assert cli([*base, "--threshold", f"{ratio - 0.01:.4f}"]) == 0
    assert cli([*base, "--threshold", f"{min(ratio + 0.01, 1):.4f}"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert (tmp_path / "r" / "report.md").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([str(GCP), "--instance-type", "p9.huge"], "unknown instance type"),
        ([str(GCP), "--instance-type", "c5n.large"], "no nccl_allreduce_busbw_gb_s"),
        (["/nonexistent/job.out", "--instance-type", "p5.48xlarge"], "cannot read"),
        ([str(GCP), "--instance-type", "p5.48xlarge", "--threshold", "1.5"], "threshold"),
    ],
)
def test_cli_bad_input_is_a_user_error(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        cli(["nccl-report", *argv, "--out", str(tmp_path)])


def test_registered_in_the_gpuforge_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = gpuforge_cli.main(
        ["nccl-report", str(EFA), "--instance-type", "g5.12xlarge", "--out", str(tmp_path)]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "aws-eks-efa-g4dn-2node.log" in captured.out
    assert (
        gpuforge_cli.main(["nccl-report", str(EFA), "--instance-type", "nope", "--out", str(tmp_path)]) == 2
    )
    assert "gpuforge: error: unknown instance type" in capsys.readouterr().err


def test_sbatch_script_is_valid_bash_and_launches_with_pmix() -> None:
    """The batch script needs GPUs to run; here it is only syntax-checked and inspected."""
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-s", "bash", str(SBATCH)], check=True)
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    directives = [line for line in lines if line.startswith("#SBATCH")]
    # Slurm reads #SBATCH lines only above the first command.
    assert directives
    assert all(lines.index(d) < first_command for d in directives)
    text = SBATCH.read_text()
    assert "srun --mpi=pmix" in text
    assert "export FI_PROVIDER=efa" in text
