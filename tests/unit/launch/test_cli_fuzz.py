"""Every command line's arguments under hypothesis: argv built from the command's own flags (read from its --help)
and what people type after them. Parsing either succeeds or exits 2 with one line on stderr; the checks each
command runs before Ray starts (the config loader, serve's and export's own) raise nothing but one-line
UserInputErrors. The counts are printed (-s shows them)."""

from __future__ import annotations

import contextlib
import io
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.config.loading import load_config
from app.errors import UserInputError
from jobs import export, finetune, plan, serve, submit, sync, tune
from tests.helpers import EMBEDDED_CONFIG

COMMANDS = {"finetune": finetune, "export": export, "plan": plan, "serve": serve, "submit": submit, "sync": sync,
            "tune": tune}
OUTCOMES: dict[str, Counter] = {name: Counter() for name in COMMANDS}
WORDS = st.sampled_from(["", "-", "--", "=", "x=y", "demo=models:/demo/1", "0", "-1", "nan", "inf", "1e999", "0x1",
                         "65536", "127.0.0.1", "0.0.0.0", "::1", "jobs/configs/embedded.yaml", "/nonexistent",
                         "train.max_steps=5", "lora.r=-2", "'", "\t", "é", "a b"]) | st.text(max_size=12)


def flags_of(module) -> list[str]:
    """The command's flags and sub-commands, as its --help lists them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.parse_args(["--help"])
    text = out.getvalue()
    commands = re.findall(r"\{([a-z,-]+)\}", text)
    return sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text)) - {"--help"}
                  | {c for group in commands for c in group.split(",")})


# half the cases start with what the command needs, so the rest reaches its checks
REQUIRED = {"finetune": ["--config", str(EMBEDDED_CONFIG)], "export": ["--run", "r", "--out", "/nonexistent/out"],
            "plan": ["--config", str(EMBEDDED_CONFIG)], "serve": ["--adapter", "demo=run"], "submit": ["submit"],
            "sync": ["run"], "tune": ["--config", str(EMBEDDED_CONFIG), "--space", "lora.r=choice(8,16)"]}


def argv_for(name: str):
    flags = st.sampled_from(flags_of(COMMANDS[name]))
    tokens = st.lists(flags | WORDS, max_size=8)
    pairs = st.lists(st.tuples(flags, WORDS), max_size=4).map(lambda p: [token for pair in p for token in pair])
    return st.one_of(tokens, (tokens | pairs).map(lambda argv: REQUIRED[name] + argv))


def parsed(module, argv: list[str]):
    """The namespace, or None after argparse's exit 2, whose message must be one line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return module.parse_args(argv)
        except SystemExit as e:
            assert e.code == 2, (argv, e.code)
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err.getvalue())
    return None


def checks(name: str, args, tmp_path) -> None:
    """What the command checks before it starts Ray (or anything else)."""
    if name == "serve":
        args.output_dir = str(tmp_path)
        serve.checked_arguments(args)
    elif name == "export":
        export.check_arguments(args)
        load_config(args.config, args.overrides)
    elif name in ("finetune", "plan", "sync"):
        load_config(args.config, args.overrides)
    elif name == "tune":
        tune.sweep_config(args)
        tune.sweep_name(args)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\ncommand-line cases:", {name: (sum(c.values()), dict(c)) for name, c in OUTCOMES.items() if c})


@pytest.mark.parametrize("name", COMMANDS)
def test_any_argv_is_a_start_or_one_line(name, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SERVE_API_KEY", raising=False)

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
    @given(argv_for(name).filter(lambda argv: "-h" not in argv))
    def run(argv):
        args = parsed(COMMANDS[name], argv)
        if args is None:
            OUTCOMES[name]["exit 2 (argparse)"] += 1
            return
        try:
            checks(name, args, tmp_path)
            OUTCOMES[name]["would start"] += 1
        except UserInputError as e:
            assert str(e) and "\n" not in str(e)
            OUTCOMES[name]["exit 2 (checks)"] += 1

    run()
    assert OUTCOMES[name]["exit 2 (argparse)"] and sum(OUTCOMES[name].values()) >= 100
