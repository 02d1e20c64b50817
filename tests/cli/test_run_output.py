"""What ``v41plan run`` prints, and the help every command gives.

``run`` executes on the fake runner here (its tokens are pseudo-random bytes, like a random
checkpoint's), so these tests look only at the output's shape.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

from v41plan.cli.main import COMMANDS, build_parser, main
from v41plan.cli.run import shown


def test_shown_quotes_and_escapes_what_a_terminal_cannot_show():
    assert shown('a b\n\t"q"\\') == '"a b\\n\\t\\"q\\"\\\\"'
    assert shown("\x07\x1b[31m\x7f") == '"\\x07\\x1b[31m\\x7f"'
    assert shown("é\u2028\U000e0001") == '"é\\u2028\\U000e0001"'
    raw = b"ok\xb4\xff".decode("utf-8", errors="surrogateescape")  # undecodable bytes
    assert shown(raw) == '"ok\\xb4\\xff"'


def test_text_output_separates_prompt_completion_and_summary(fake_engine, capsys):
    assert main(["run", "--prompt", "The sky\tis", "--max-tokens", "6", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == '[0] prompt:     "The sky\\tis"'
    assert re.fullmatch(r'\[0\] completion: ".*"', lines[1])
    assert re.fullmatch(
        r"\[0\] 10 prompt tokens, 6 generated \(finish: length\); TTFT [\d.]+ m?s, decode "
        r"[\d.]+ tokens/s; prefix-cache hit 0 tokens",
        lines[2],
    )
    assert len(lines) == 3
    assert all(ch.isprintable() for ch in out.replace("\n", ""))  # nothing raw reaches a tty
    assert err == (
        "v41plan run: note: no --checkpoint: spec tiny runs on random weights (seed 0), so the "
        "completion is noise, not language\n"
    )


def test_several_prompts_get_a_total_line(fake_engine, capsys):
    argv = ["run", "--prompt", "ab", "--prompt-token-ids", "1,2,3", "--max-tokens", "2"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3] == "[1] prompt:     token ids [1, 2, 3]"
    assert lines[5].startswith("[1] token ids:  [")
    assert re.fullmatch(r"2 requests in [\d.]+ m?s: 5 prompt tokens, \d+ generated .*", lines[-1])


def test_json_keeps_its_shape_and_adds_timing(fake_engine, capsys):
    assert main(["run", "--prompt-token-ids", "72,105", "--json", "--max-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert list(d) == [
        "prompt", "prompt_token_ids", "text", "token_ids", "finish_reason", "error",
        "ttft_s", "e2e_s", "decode_tokens_per_s",
    ]  # fmt: skip
    assert d["prompt_token_ids"] == [72, 105] and d["ttft_s"] <= d["e2e_s"]
    assert "random weights" in err  # notices stay off stdout


def test_version(capsys):
    from v41plan import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"v41plan {__version__}\n"


def _parsers():
    from v41plan.validation.validate_runtime import _parser

    yield "validate_runtime", _parser()
    for name in COMMANDS:
        yield name, build_parser([name])._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize(("name", "parser"), list(_parsers()), ids=lambda x: str(x)[:20])
def test_every_option_has_help_with_its_default_and_choices(name, parser):
    usage = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, (name, action.dest)
        rendered = parser._get_formatter()._expand_help(action)
        if action.option_strings and not action.required and action.nargs != 0:
            assert "default" in rendered.lower(), (name, action.dest, rendered)
            assert "default: None" not in rendered, (name, action.dest, rendered)
        for choice in action.choices or ():
            assert str(choice) in usage, (name, action.dest, choice)


def test_run_and_serve_show_the_start_progress_once(capsys):
    """``v41plan run`` / ``serve`` print the graph warm-up and capture progress (level 3
    compiles there, minutes on a cold cache) on stderr, once however often ``main`` runs."""
    import logging

    from v41plan.cli import main as cli_main

    cli_main._show_start_progress("run")
    cli_main._show_start_progress("run")
    logging.getLogger("v41plan.runtime.graphs").info("warm-up 1/2: bucket (1, 1) in 0.1 s")
    logging.getLogger("v41plan.serving.runner").info("start: 3.0 s")
    err = capsys.readouterr().err.splitlines()
    assert err == ["v41plan run: warm-up 1/2: bucket (1, 1) in 0.1 s", "v41plan run: start: 3.0 s"]
