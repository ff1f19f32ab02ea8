"""--config FILE (TOML / YAML / JSON) end to end, and --help listing each flag once.

The round trips drive the real CLI (train.py in a subprocess, 2 tiny steps on the session corpus) and read what a user
would read afterwards: <run>/config.resolved.json and the checkpoint's card (`python -m checkpoint inspect`) plus its
run_info (every flag's value, as the resume checks see it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import PY, ROOT, TINY, env_for_tests, run_train

sys.path.insert(0, str(ROOT))
import flags  # noqa: E402


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _card(step_dir) -> dict:
    """The card as `python -m checkpoint inspect` prints it ("  key.path: value" lines)."""
    out = subprocess.run([PY, "-m", "checkpoint", "inspect", str(step_dir)], capture_output=True, text=True,
                         cwd=ROOT, env=env_for_tests(), timeout=120)
    assert out.returncode == 0, out.stderr
    card, inside = {}, False
    for line in out.stdout.splitlines():
        if line == "card:":
            inside = True
        elif inside and line.startswith("  ") and ": " in line:
            key, _, value = line.strip().partition(": ")
            card[key] = value
        elif inside:
            break
    return card


def _saved_flags(step_dir) -> dict:
    """run_info: every flag as the checkpoint recorded it (what resume compares against)."""
    import torch

    return json.loads(torch.load(step_dir / "run_info.pt", weights_only=True)["config_json"])


TOML = """
# keys in all three spellings; values as on the command line
learning_rate = 0.002
"--seed" = 7
grad-max-norm = 0.5
log_loss_to_csv = true          # an optional-value flag given alone: the default path
validate-on-resume = true       # a switch
checkpoint_note = "from toml"
batch_size = 2                  # the command line's --batch-size 3 wins
walltime = "1:00:00"            # a flag with its own parser: stored as given, so the resolved file re-parses
"""

YAML = """
learning-rate: 0.003
seed: 11
requeue: false                  # --no-requeue (a BooleanOptionalAction)
checkpoint_note: from yaml
mirror_keep: null               # null: the default, as if absent
"""


@pytest.mark.parametrize("kind", ["toml", "yaml"])
def test_config_file_round_trip(tmp_path, corpus, kind):
    cfg = tmp_path / f"run.{kind}"
    cfg.write_text(TOML if kind == "toml" else YAML)
    ck = tmp_path / "ck"
    run_train(TINY + ["--dataset", corpus, "--config", str(cfg), "--training-steps", "2", "--batch-size", "3",
                      "--checkpoint-dir", str(ck)], check=True)
    expected = ({"learning_rate": 0.002, "seed": 7, "grad_max_norm": 0.5, "log_loss_to_csv": "auto",
                 "validate_on_resume": True, "checkpoint_note": "from toml", "batch_size": 3, "walltime": "1:00:00"}
                if kind == "toml" else
                {"learning_rate": 0.003, "seed": 11, "requeue": False, "checkpoint_note": "from yaml",
                 "mirror_keep": None, "batch_size": 3, "lr_warmup_steps": 5})  # 5: TINY's command-line value
    run = ck / "default"
    resolved = json.loads((run / flags.RESOLVED_CONFIG).read_text())
    assert {k: resolved[k] for k in expected} == expected
    assert resolved["training_steps"] == 2 and resolved["model"] == "tiny"
    assert "config" not in resolved
    # every flag has its final value there, a flag added to build_parser later included
    assert set(resolved) == {a.dest for a in flags.build_parser()._actions
                             if a.dest not in ("help", "version", "config")}

    step = run / "step-00000002"
    card = _card(step)
    assert float(card["hyperparameters.learning_rate"]) == expected["learning_rate"]
    assert int(card["hyperparameters.seed"]) == expected["seed"]
    assert int(card["hyperparameters.batch_size_per_rank"]) == 3
    assert card["note"] == expected["checkpoint_note"]
    # the card carries the whole resolved configuration too, the same values as the run folder's file
    assert {k[len("flags."):]: v for k, v in card.items() if k.startswith("flags.")} == \
        {k: str(v) for k, v in resolved.items()}
    assert json.loads((step / "manifest.json").read_text())["meta"]["card"]["flags"] == resolved
    saved = _saved_flags(step)  # a value from the file is recorded exactly like one from the command line
    assert saved["config"] == str(cfg)
    assert saved["learning_rate"] == expected["learning_rate"] and saved["batch_size"] == 3
    if kind == "toml":
        assert saved["walltime"] == 3600.0 and (run / "loss.csv").is_file()
        # The resolved file is itself a config: resuming from it continues the run (the refused-on-resume flags
        # match the checkpoint's), PyRecover rewrites it, and the checkpoint tools do not mind it in the run folder.
        run_train(["--config", str(run / flags.RESOLVED_CONFIG), "--resume-from-checkpoint", "latest",
                   "--training-steps", "3"], check=True)
        again = json.loads((run / flags.RESOLVED_CONFIG).read_text())
        assert again["training_steps"] == 3 and again["resume_from_checkpoint"] == "latest"
        assert (run / "step-00000003").is_dir()
        listing = subprocess.run([PY, "-m", "checkpoint", "list", str(run)], capture_output=True, text=True,
                                 cwd=ROOT, env=env_for_tests(), timeout=120)
        assert listing.returncode == 0 and "latest" in listing.stdout, listing.stderr


@pytest.mark.parametrize("content, suffix, wanted", [
    ("learnin_rate = 0.1\n", ".toml", ["'learnin_rate'", "is not a flag"]),
    ("version = true\n", ".toml", ["'version'", "is not a flag"]),  # not an exit with the version
    ("learning_rate = 'fast'\n", ".toml", ["'learning_rate'", "invalid float value: 'fast'"]),
    ("learning_rate = -1\n", ".toml", ["--learning-rate -1", "out of range"]),
    ("model = 'huge'\n", ".toml", ["'model'", "invalid choice: 'huge'"]),
    ("compile = 'yes'\n", ".toml", ["'compile'", "true or false"]),
    ("batch_size = [1, 2]\n", ".toml", ["'batch_size'", "one value"]),
    ("seed = 1\n'--seed' = 2\n", ".toml", ["'--seed'", "second time"]),
    ("config = 'other.toml'\n", ".toml", ["'config'", "another config file"]),
    ("seed = \n", ".toml", ["not valid TOML"]),
    ("- seed\n", ".yaml", ["expected keys with values"]),
    ("seed: 1\n", ".ini", ["unknown file type .ini"]),
    # a key written twice is refused in every format (JSON and YAML parsers alone keep the last, silently)
    ("seed = 1\nseed = 2\n", ".toml", ["not valid TOML"]),
    ("seed: 1\nlearning_rate: 0.1\nseed: 2\n", ".yaml", ["key 'seed' is repeated", "keep one"]),
    ('{"seed": 1, "learning_rate": 0.1, "seed": null}', ".json", ["key 'seed' is repeated", "keep one"]),
    # a value is a scalar, or a flat list of scalars for a flag that takes several
    ('{"seed": {"a": 1}}', ".json", ["'seed'", "expected a value, got a table"]),
    ("seed: [[1, 2]]\n", ".yaml", ["'seed'", "expected one value, got a list of 1"]),
    ("seed: !!set {1, 2}\n", ".yaml", ["'seed'", "expected a value, got a set"]),
])
def test_bad_config_is_one_line_naming_file_and_key(tmp_path, content, suffix, wanted):
    cfg = tmp_path / f"bad{suffix}"
    cfg.write_text(content)
    line = _one_error_line(run_train(["--config", str(cfg)], timeout=120))
    assert str(cfg) in line
    for part in wanted:
        assert part in line, line


# Billion laughs: each level lists the one before nine times, by alias; nine levels are 9**9 strings, gigabytes once
# expanded or formatted, from a file of a few hundred bytes.
ALIAS_BOMB = "checkpoint_note:\n  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"  - &{level} [{', '.join([f'*{before}'] * 9)}]\n" for before, level in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("content, line_no", [
    (ALIAS_BOMB, 3),
    ("checkpoint_note: &note shared\nexperiment_name: *note\n", 2),  # refused even when harmless: no alias is read
])
def test_yaml_aliases_are_refused_before_anything_is_expanded(tmp_path, content, line_no):
    cfg = tmp_path / "aliases.yaml"
    cfg.write_text(content)
    proc = run_train(["--config", str(cfg)], timeout=60)  # expanded, the bomb took 40 s and 3 GB to a MemoryError
    line = _one_error_line(proc)
    assert line.startswith(f"error: --config {cfg}, line {line_no}: YAML aliases (*") and "write the value out" in line
    assert len(proc.stderr) < 400, proc.stderr


def test_a_long_bad_value_is_quoted_short(tmp_path):
    cfg = tmp_path / "long.json"
    cfg.write_text(json.dumps({"learning_rate": "9" * 50 + "x" * 100_000}))
    line = _one_error_line(run_train(["--config", str(cfg)], timeout=120))
    assert "'learning_rate': invalid float value: '99999" in line and "...xxx" in line, line[:400]
    assert len(line) < len(str(cfg)) + 200, line[:400]


def test_missing_config_file(tmp_path):
    line = _one_error_line(run_train(["--config", str(tmp_path / "nope.toml")], timeout=120))
    assert "nope.toml" in line and "cannot read" in line


def test_precedence_and_generic_over_flags_added_later(tmp_path):
    """In process (no training): the command line beats the file, the file beats the default, and a flag someone adds
    to the parser later -- here a two-value one, like --adam-betas, under a name no real flag has -- is settable from a file with no other change."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("learning-rate = 0.5\nbatch_size = 2\nrequeue = true\nasync_checkpoint = 'process'\n"
                   "checkpoint_backend = 'dcp'\n")
    args = flags.parse_args(["--config", str(cfg), "--batch_size", "9"])
    assert (args.learning_rate, args.batch_size, args.requeue, args.async_checkpoint) == (0.5, 9, True, "process")
    assert args.checkpoint_backend == "dcp" and args.seed == flags.build_parser().get_default("seed")
    # the alias check still sees a backend that came from the file
    with pytest.raises(SystemExit):
        flags.parse_args(["--config", str(cfg), "--use-torch-distributed-ckpt", "--checkpoint-backend", "vanilla"])

    parser = flags.build_parser()
    parser.add_argument("--future-pair", "--future_pair", type=float, nargs=2, default=[0.9, 0.95])
    parser.add_argument("--future-choice", "--future_choice", choices=["none", "csv"], default="none")
    cfg.write_text("future_pair = [0.8, 0.99]\nfuture_choice = 'csv'\n")
    assert flags.load_config(parser, str(cfg)) == {"future_pair": [0.8, 0.99], "future_choice": "csv"}
    cfg.write_text("future_pair = 0.8\n")
    with pytest.raises(flags.BadInput, match="future_pair"):
        flags.load_config(parser, str(cfg))
    cfg.write_text("future_pair = [[0.8], 0.99]\n")  # a list flag takes a flat list
    with pytest.raises(flags.BadInput, match="future_pair': expected a list of values, got a list in the list"):
        flags.load_config(parser, str(cfg))


def test_help_lists_each_flag_once_and_both_spellings_parse(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # the same width for both renderings
    out = subprocess.run([PY, str(ROOT / "train.py"), "--help"], capture_output=True, text=True,
                         env=env_for_tests({"COLUMNS": "80"}), timeout=120)
    assert out.returncode == 0
    parser = flags.build_parser()
    shown = [re.findall(r"--[\w-]+", line.split("  ")[1] if line.startswith("  -") else "")
             for line in out.stdout.splitlines()]
    names = [n for line in shown for n in line]
    assert len(names) == len(set(names))  # no name twice
    spellings = [n.replace("_", "-") for n in names]
    assert len(spellings) == len(set(spellings)), "a flag is listed in both spellings"
    for action in parser._actions:  # every flag is listed, by one of its names
        if action.option_strings and action.dest != "help":
            assert set(action.option_strings) & set(names), action.dest
    assert "--learning-rate" in names and "--learning_rate" not in names
    assert "--experiment_name" in names  # declared with the reference scripts' spelling: listed by it
    # much shorter than argparse's stock rendering of the same flags (which lists both spellings of each)
    import argparse

    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.usage = None
    stock = parser.format_help().count("\n")
    assert out.stdout.count("\n") < 0.85 * stock, (out.stdout.count("\n"), stock)
    # the hidden spelling still works
    assert flags.parse_args(["--learning_rate", "0.1"]).learning_rate == 0.1
    assert flags.parse_args(["--learning-rate", "0.1", "--exp_name", "x"]).experiment_name == "x"


def test_checkpoint_cli_help_unaffected():
    out = subprocess.run([PY, "-m", "checkpoint", "--help"], capture_output=True, text=True, cwd=ROOT,
                         env=env_for_tests(), timeout=120)
    assert out.returncode == 0 and "inspect" in out.stdout and "convert" in out.stdout
