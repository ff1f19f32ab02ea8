"""benchmarks/goodput.py's rounds (--repeats R), on made-up runs: the harness's bookkeeping around train.py, which the
end-to-end smoke (tests/test_goodput.py, one round) does not repeat. ``calibrate`` and ``run_job`` are replaced by
fakes that return what a run of each kind would have measured; everything else is the harness's own code: the
failure-free run before, between and after the rounds, each round's t0 the mean of the two around it, each round in
a folder of its own and one configuration later than the last, and the report's median round with the min-max."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.goodput as goodput
from benchmarks.goodput import Calibration, Incarnation, Job

# t0 of the failure-free runs in the order they run: base (calibration length), before round 1, between 1 and 2,
# between 2 and 3, after round 3
T0 = [0.10, 0.20, 0.30, 0.40, 0.50]
# wall of each configuration's kill run, by round: goodput = t0 x 20 steps / wall
WALL = {"vanilla": [20.0, 10.0, 40.0], "tiered": [6.0, 16.0, 12.0]}


class Fakes:
    def __init__(self):
        self.t0 = iter(T0)
        self.order: list[tuple[str, str]] = []  # (kind, csv folder name), in the order the harness ran them
        self.dirs: list[str] = []  # --checkpoint-dir of each kill run
        self.first_resumed_from = 0

    def calibrate(self, cmd, csv_path, steps, every, skip, t0, limit_s, stretch=0):
        tag = Path(csv_path).parent.parent.name
        self.order.append(("calibrate", tag))
        step_s = next(self.t0) if every == 0 else 0.2
        cal = Calibration(steps=steps, every=every, skip=skip, step_s=step_s, blocked_s=0.01, persist_s=0.02,
                          startup_s=3.0, finish_s=1.0, saves=4 if every else 0, save_cost_s=0.05 if every else 0.0,
                          stretch=stretch)
        return cal, Job(0.0, 10.0, "finished", [])

    def run_job(self, cmd, csv_path, kill_at, limit_s, kill_steps=(), env=None, after_kill=None):
        tag = Path(csv_path).parent.parent.name  # <config>-round<r>
        self.order.append(("kill run", tag))
        self.dirs.append(cmd[cmd.index("--checkpoint-dir") + 1])
        name, rnd = tag.rsplit("-round", 1)
        wall = WALL[name][int(rnd) - 1]
        assert list(kill_steps) == [12]
        incs = [Incarnation(start=0.0, end=5.0, killed=True, rc=-9, resumed_from=self.first_resumed_from, reached=12,
                            first_step=4.0, recovery_line=None),
                Incarnation(start=5.0, end=wall, killed=False, rc=0, resumed_from=10, reached=20, first_step=7.0,
                            recovery_line="recovery: first step after resume 2.00s")]
        return Job(0.0, wall, "finished", incs)


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    f = Fakes()
    monkeypatch.setattr(goodput, "calibrate", f.calibrate)
    monkeypatch.setattr(goodput, "run_job", f.run_job)
    # main() clears KEEP_DIR (a --keep run's folders): a name no run uses, inside the checkout as its help requires
    monkeypatch.setattr(goodput, "KEEP_DIR", goodput.ROOT / "checkpoints" / f"goodput-unit-test-{tmp_path.name}")
    monkeypatch.setattr(goodput, "plot", lambda res, path: path.write_bytes(b"png"))
    return f


def _main(tmp_path: Path, *extra: str) -> int:
    dataset = tmp_path / "data.parquet"
    dataset.write_bytes(b"")  # main() only checks that it exists: the fakes run nothing
    return goodput.main(["--quick", "--configs", "vanilla,tiered", "--kill-steps", "12", "--repeats", "3",
                         "--dataset", str(dataset), "--out", str(tmp_path / "out"), *extra])


def test_rounds_share_the_failure_free_runs_between_them_and_report_the_median_round(fakes, tmp_path):
    assert _main(tmp_path) == 0
    # the base run and the calibrations, then a failure-free run before, between and after the rounds; each round
    # starts one configuration later than the round before
    assert fakes.order == [
        ("calibrate", "base"), ("calibrate", "vanilla-calibration"), ("calibrate", "tiered-calibration"),
        ("calibrate", "base-round1"), ("kill run", "vanilla-round1"), ("kill run", "tiered-round1"),
        ("calibrate", "base-round2"), ("kill run", "tiered-round2"), ("kill run", "vanilla-round2"),
        ("calibrate", "base-round3"), ("kill run", "vanilla-round3"), ("kill run", "tiered-round3"),
        ("calibrate", "base-round4")]
    assert len(set(fakes.dirs)) == len(fakes.dirs) == 6  # every kill run starts in a folder of its own
    report = json.loads((tmp_path / "out" / "goodput.json").read_text())
    assert report["t0_s"] == T0[0]
    assert [(r["t0_before_s"], r["t0_after_s"]) for r in report["rounds"]] == [(0.2, 0.3), (0.3, 0.4), (0.4, 0.5)]
    assert [r["t0_s"] for r in report["rounds"]] == pytest.approx([0.25, 0.35, 0.45], abs=1e-12)
    configs = {c["name"]: c for c in report["configs"]}
    for name, c in configs.items():
        assert [r["round"] for r in c["rounds"]] == [1, 2, 3]
        goodputs = [r["t0_s"] * 20 / WALL[name][i] for i, r in enumerate(report["rounds"])]
        assert c["goodput_rounds"] == pytest.approx(goodputs, abs=1e-12)
        assert [r["run"]["goodput"] for r in c["rounds"]] == pytest.approx(goodputs, abs=1e-12)
        median = sorted(goodputs)[1]
        assert c["run"]["goodput"] == pytest.approx(median, abs=1e-12)  # the median round is the one reported
        row = next(line for line in (tmp_path / "out" / "goodput.md").read_text().splitlines()
                   if line.startswith(f"| {name} |"))
        assert row.split("|")[3].strip() == f"**{median:.3f}** ({min(goodputs):.3f}–{max(goodputs):.3f})", row
    # vanilla: 0.25, 0.70, 0.225 -> the median is round 1's; tiered: 0.833, 0.4375, 0.75 -> round 3's
    assert configs["vanilla"]["run"] == configs["vanilla"]["rounds"][0]["run"]
    assert configs["tiered"]["run"] == configs["tiered"]["rounds"][2]["run"]
    assert configs["tiered"]["incarnations"] == configs["tiered"]["rounds"][2]["incarnations"]
    md = (tmp_path / "out" / "goodput.md").read_text()
    assert "3 rounds, each with its own t0 = the mean of failure-free runs of 20 steps right before and right after" in md
    assert "| 2 | 0.350 (0.300, 0.400) |" in md  # the table of every round, with each round's t0 bracket


def test_a_kill_run_that_resumes_from_an_earlier_runs_checkpoint_stops_the_harness(fakes, tmp_path):
    fakes.first_resumed_from = 6  # its first start found a checkpoint: the round did not start afresh
    with pytest.raises(SystemExit, match="vanilla-round1: the kill run's first start resumed from step 6"):
        _main(tmp_path)


def test_one_round_uses_the_base_runs_t0_and_runs_no_bracket(fakes, tmp_path):
    assert _main(tmp_path, "--repeats", "1") == 0
    assert [kind for kind, _ in fakes.order].count("calibrate") == 3  # base and the two calibrations only
    report = json.loads((tmp_path / "out" / "goodput.json").read_text())
    assert report["rounds"] == [{"t0_s": T0[0]}]
    md = (tmp_path / "out" / "goodput.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| tiered |"))
    assert row.split("|")[3].strip() == f"**{T0[0] * 20 / WALL['tiered'][0]:.3f}**", row  # no spread of one round
    assert "Every round" not in md and "rounds, each with its own t0" not in md
