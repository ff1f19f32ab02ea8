"""submit-training-simple.sh's own options, without SLURM: PYRECOVER_DRY_RUN=1 runs the real script up to the srun line
and prints it (shell-quoted) instead of running it. Valued options take `--opt=VALUE` and `--opt VALUE`; the setup hook
(--setup / PYRECOVER_SETUP) is checked before srun and wraps each task as `bash -c 'source SETUP && exec ...'`.
That the hook really runs on every node of a job is tests/slurm/test_setup_hook.py. The dry run also runs
`train.py --check` with the job's flags (off here, PYRECOVER_CHECK=0, except in the tests of that check: each costs a
torch import); PYRECOVER_SRUN_ARGS adds srun options (for real on the SLURM test cluster: tests/slurm/test_submit_dir.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import PY, ROOT  # noqa: E402

SCRIPT = ROOT / "submit-training-simple.sh"


def dry_run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, cwd=cwd or ROOT,
                          env={**base, "PYRECOVER_DRY_RUN": "1", "PYRECOVER_CHECK": "0", "PYTHON": "python3",
                               **(env or {})})


def command(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("dry run: ")]
    return shlex.split(line.removeprefix("dry run: "))


def after(argv: list[str], script: str = "train.py") -> list[str]:
    i = next(i for i, a in enumerate(argv) if a.endswith("/" + script))
    return argv[i + 1:]


@pytest.mark.parametrize("form", ["equals", "space"])
def test_valued_options_take_both_forms(form):
    def opt(name, value):
        return [f"{name}={value}"] if form == "equals" else [name, value]
    argv = command(dry_run(*opt("--exp_name", "run1"), "--continue", *opt("--sequence-length", "64"),
                           "--", "--training-steps", "3"))
    assert after(argv) == ["--experiment_name", "run1", "--sequence-length", "64", "--training-steps", "3",
                           "--resume-from-checkpoint", "latest", "--max-restarts", "100"], argv


@pytest.mark.parametrize("args", [["--exp_name"], ["--exp_name", "--continue"], ["--sequence-length="], ["--setup"]])
def test_a_valued_option_without_its_value_is_one_line_and_exit_2(args):
    proc = dry_run(*args)
    assert proc.returncode == 2, proc
    assert proc.stderr.count("\n") == 1 and "needs" in proc.stderr and args[0].split("=")[0] in proc.stderr, proc.stderr
    assert "dry run" not in proc.stdout


@pytest.mark.parametrize("how", ["option", "env"])
def test_setup_file_is_sourced_here_and_by_each_task_before_exec(tmp_path, how):
    setup = tmp_path / "setup.sh"
    setup.write_text('echo "setup sourced in $$"\nexport PYRECOVER_TEST_HOOK=1\n')
    args, env = (["--setup", "setup.sh"], {}) if how == "option" else ([], {"PYRECOVER_SETUP": "setup.sh"})
    proc = dry_run(*args, "--exp_name=x", env=env, cwd=tmp_path)  # relative path: made absolute for the tasks
    assert "setup sourced in" in proc.stdout  # the batch shell sourced it too
    argv = command(proc)
    i = argv.index("bash")
    assert argv[i + 1] == "-c" and "exec \"$@\"" in argv[i + 2] and argv[i + 3] == str(setup), argv
    assert argv[i + 4:i + 6] == ["python3", f"{ROOT}/train.py"], argv


def test_the_task_wrapper_sources_then_execs_python_itself(tmp_path):
    """The wrapper the script puts after srun, run here as the task would: the setup's export reaches python, and
    python is the same process (exec: SLURM's signals reach train.py, its exit code is the task's)."""
    setup = tmp_path / "setup.sh"
    setup.write_text("export PYRECOVER_TEST_HOOK=from-setup\n")
    argv = command(dry_run("--setup", str(setup)))
    i = argv.index("bash")
    probe = "import os, sys; print(os.environ['PYRECOVER_TEST_HOOK'], os.getpid()); sys.exit(4)"
    proc = subprocess.Popen([*argv[i:i + 4], sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    value, pid = out.split()
    assert value == "from-setup" and int(pid) == proc.pid and proc.returncode == 4, (out, proc.returncode)
    setup.write_text("false\n")  # a setup that fails: exit 2 (bad input), python never starts
    failed = subprocess.run([*argv[i:i + 4], sys.executable, "-c", "print('ran')"], capture_output=True, text=True)
    assert failed.returncode == 2 and "ran" not in failed.stdout and "setup file" in failed.stderr, failed


@pytest.mark.parametrize("how", ["option", "env"])
def test_missing_setup_file_is_one_line_and_exit_2_before_srun(tmp_path, how):
    missing = tmp_path / "nope.sh"
    args, env = ([f"--setup={missing}"], {}) if how == "option" else ([], {"PYRECOVER_SETUP": str(missing)})
    proc = dry_run(*args, env=env)
    assert proc.returncode == 2, proc
    assert proc.stderr.count("\n") == 1 and str(missing) in proc.stderr and "not readable" in proc.stderr, proc.stderr
    assert "srun" not in proc.stdout


def test_header_documents_python_and_the_setup_hook():
    header = SCRIPT.read_text().split("#SBATCH", 1)[0]
    for needle in ("PYTHON=", "PYRECOVER_SETUP=", "--setup=FILE", "module load", "conda activate", "/bin/activate",
                   "PYRECOVER_DRY_RUN"):
        assert needle in header, needle


def test_setup_file_that_reads_unset_variables_or_sets_e_is_fine_and_a_failing_one_is_exit_2(tmp_path):
    """conda's and module systems' scripts read unset variables: sourced without the script's `set -u`; options the file
    sets (`set -e`) do not leak into the script. A file that fails in the batch shell: one line, exit 2, no srun."""
    setup = tmp_path / "setup.sh"
    setup.write_text('echo "[$PYRECOVER_SURELY_UNSET_VAR]"\nset -e\n')
    proc = dry_run("--setup", str(setup))
    assert proc.returncode == 0 and "[]" in proc.stdout and proc.stderr == "", proc
    setup.write_text("return 3\n")
    proc = dry_run("--setup", str(setup))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "failed (exit 3)" in proc.stderr, proc
    assert "srun" not in proc.stdout


def test_help_is_the_header():
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "PYRECOVER_SETUP=FILE" in proc.stdout, proc
    assert "#SBATCH --job-name" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("value", ["two", "-1", ""])
def test_a_bad_inplace_restart_count_is_one_line_and_exit_2(value):
    proc = dry_run(env={"PYRECOVER_INPLACE_RESTARTS": value})
    if value == "":  # empty means unset: the default
        command(proc)
        return
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc
    assert f"PYRECOVER_INPLACE_RESTARTS='{value}'" in proc.stderr and "whole number" in proc.stderr, proc.stderr


def test_srun_args_go_on_the_srun_line_before_python_and_quotes_are_refused():
    argv = command(dry_run("--distributed", env={"PYRECOVER_SRUN_ARGS": " --label\n--cpu-bind=none  --container-image=a.sqsh "}))
    i = argv.index("srun")
    assert argv[i + 1:i + 5] == ["--kill-on-bad-exit=0", "--label", "--cpu-bind=none", "--container-image=a.sqsh"], argv
    assert argv[i + 5:i + 7] == ["python3", f"{ROOT}/train.py"], argv
    proc = dry_run(env={"PYRECOVER_SRUN_ARGS": "--container-mounts='/a b:/a b'"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "PYRECOVER_SRUN_ARGS" in proc.stderr, proc
    assert "srun" not in proc.stdout


def test_dry_run_checks_the_train_flags_here_first_and_a_bad_one_is_exit_2_before_srun(tmp_path, corpus):
    """The job's interpreter runs `train.py --check` with the job's flags on the login node: a typo costs seconds, not a
    queue wait. The dry run shows the #SBATCH resources and the srun line once."""
    bad = dry_run("--exp_name=x", "--", "--bogus-flag", "3", "--learning-rate", "abc",
                  env={"PYTHON": PY, "PYRECOVER_CHECK": "1"})
    assert bad.returncode == 2, bad
    assert "--learning-rate" in bad.stderr and "train.py --check` failed (exit 2" in bad.stderr, bad.stderr
    assert "dry run: srun" not in bad.stdout and "--ntasks-per-node=4" in bad.stdout, bad.stdout
    ck = tmp_path / "ck"
    good = dry_run("--distributed", "--exp_name=x", "--", "--model", "tiny", "--dataset", corpus, "--checkpoint-dir",
                   str(ck), env={"PYTHON": PY, "PYRECOVER_CHECK": "1"})
    argv = command(good)
    assert after(argv)[:3] == ["--distributed", "--experiment_name", "x"] and "--check" not in argv, argv
    out = good.stdout
    assert "  --ntasks-per-node=4" in out and "  --time=04:00:00" in out, out  # the script's own #SBATCH lines
    assert "4 rank(s) (ddp)" in out and "check: OK: would start fresh" in out, out  # nodes x ntasks-per-node ranks
    assert out.count("srun") == 1 and out.index("check: OK") < out.index("dry run: srun"), out
    assert not ck.exists()  # the check writes nothing


def test_spares_run_launcher_py_as_one_task_per_node_and_are_refused_without_distributed():
    """--spares K: one srun task per node, launcher.py, with the node's ranks and K spares; on several nodes node 0's
    hosts the store on the first node and SLURM must not end the job for a lost node (tests/slurm/test_recovery.py
    runs both on the SLURM test cluster). Without --distributed, uneven nodes, or not a number: one line, exit 2."""
    argv = command(dry_run("--distributed", "--spares", "2", "--", "--training-steps", "3",
                           env={"SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "1"}))
    i = argv.index("srun")
    assert argv[i + 1:i + 5] == ["--kill-on-bad-exit=0", "--ntasks=1", "--nodes=1", "--overcommit"], argv
    assert argv[i + 5:i + 11] == ["python3", f"{ROOT}/launcher.py", "--nproc", "4", "--spares", "2"], argv
    assert after(argv)[:3] == ["--distributed", "--training-steps", "3"], argv
    argv = command(dry_run("--distributed", "--spares", "1", "--", "--training-steps", "3",
                           env={"SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77",
                                "SLURM_JOB_NODELIST": "gpu7,gpu8", "TMPDIR": "/scratch"}))
    i = argv.index("srun")
    assert argv[i + 1:i + 7] == ["--kill-on-bad-exit=0", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                                 "--overcommit", "--no-kill"], argv
    host = argv[argv.index("--store") + 1].rsplit(":", 1)[0]  # scontrol's first host where it runs, else localhost
    assert host in ("gpu7", "localhost"), argv
    assert argv[i + 7:i + 20] == ["python3", f"{ROOT}/launcher.py", "--nproc", "2", "--spares", "1", "--nnodes", "2",
                                  "--store", f"{host}:20077", "--rc-file", "/scratch/pyrecover-launcher-77-0.rc",
                                  f"{ROOT}/train.py"], argv
    for args, env, says in [(["--spares=1"], {}, "needs --distributed"),
                            (["--distributed", "--spares=1"], {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "3"},
                             "do not split evenly"),
                            (["--distributed", "--spares=x"], {}, "whole number")]:
        proc = dry_run(*args, env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc
        assert "dry run" not in proc.stdout
