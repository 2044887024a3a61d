import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from research.cli import ConfigError, TrainConfig, build_parser, option, parse_config, positive

ROOT = Path(__file__).parent.parent


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """A test experiment."""

    width: int = option(8, "hidden width", check=positive)
    kind: Literal["a", "b"] = option("a", "which kind")
    sizes: tuple[int, ...] = option((4, 4), "layer sizes")


def test_defaults_and_overrides():
    config = parse_config(Config, [])
    assert config == Config()
    config = parse_config(Config, ["--width", "3", "--kind", "b", "--lr", "0.5", "--sizes", "1", "2", "3",
                                   "--resume", "--no-progress"])
    assert (config.width, config.kind, config.lr, config.sizes) == (3, "b", 0.5, (1, 2, 3))
    assert config.resume and not config.progress


def test_help_lists_every_option_with_its_default():
    text = build_parser(Config).format_help()
    for field in dataclasses.fields(Config):
        assert "--" + field.name.replace("_", "-") in text
    assert "(default: 128)" in text and "hidden width" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be positive (got 0)"),
        (["--lr", "-0.1"], "--lr must be positive (got -0.1)"),
        (["--width", "-2"], "--width must be positive (got -2)"),
        (["--ema-decay", "1"], "--ema-decay must be in [0, 1) (got 1.0)"),
        (["--ema-decay", "-0.5"], "--ema-decay must be in [0, 1) (got -0.5)"),
        (["--kind", "c"], "argument --kind: invalid choice: 'c'"),
        (["--batch-size", "many"], "argument --batch-size: invalid int value: 'many'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(Config, argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bad_values_raise_config_error_from_python():
    with pytest.raises(ConfigError, match="--batch-size must be positive"):
        Config(batch_size=0)


def test_experiment_script_refuses_bad_values_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "xor.py"), "--batch-size", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "xor.py: error: --batch-size must be positive (got 0)"
    assert not (tmp_path / "runs").exists()
