"""Fuzzers over everything a user can hand the commands: argument lists, ``config.json``,
``--batch`` JSON and spec YAML. Whatever the input, the answer is exit 0, 1 or 2, never a
traceback or an internal error, and a refusal (2) is exactly one stderr line.

In-process through ``v41plan.cli.main.main`` (subprocess startup would cost seconds per
example); ``run`` executes on the fake runner so an accepted argument list finishes quickly.
Example counts are bounded so the module stays within a few tens of seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from v41plan.cli.bench import BENCHMARKS
from v41plan.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "specs" / "tiny.yaml"
FUZZ = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def call(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr captured; argparse's exits become codes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # --help, --version (0) and usage errors (2)
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def check(argv: list[str], rc: int, err: str) -> None:
    """The contract every input must meet."""
    where = f"argv={argv!r}\nstderr={err!r}"
    assert rc in (0, 1, 2), where
    assert "Traceback" not in err and "internal error" not in err, where
    if rc == 2:
        assert len(err.splitlines()) == 1, where


# --- argument lists -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Files the fuzzed arguments may name: good, broken, missing."""
    d = tmp_path_factory.mktemp("fuzz")
    broken = d / "specs" / "tiny.yaml"
    broken.parent.mkdir()
    broken.write_text(TINY.read_text().replace("  hidden_size:", "  hiden_size:"))
    (d / "batch.json").write_text(
        json.dumps({"requests": [{"prompt_len": 40, "start": 0, "chunk_len": 40}]})
    )
    (d / "bad.json").write_text("{not json")
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00spec")
    return {
        "tiny_yaml": str(TINY),
        "broken": str(broken),
        "missing": str(d / "missing.yaml"),
        "dir": str(d),
        "batch": str(d / "batch.json"),
        "bad_json": str(d / "bad.json"),
        "binary": str(d / "binary.yaml"),
        "out": str(d / "out"),
    }


def _subparser(command: str):
    return build_parser([command])._subparsers._group_actions[0].choices[command]


WORDS = ["tiny", "tiny40", "nope", "bf16", "fp4", "fp8", "FULL", "none", "cpu", "cuda", "-", ""]


def _value(paths: dict[str, str]):
    return st.one_of(
        st.integers(-3, 300).map(str),
        st.floats(-2, 2).map(str),
        st.sampled_from(["nan", "inf", "1e400", "0x10"]),
        st.sampled_from(WORDS),
        st.sampled_from(sorted(paths.values())),
        st.text(string.printable + "\x00é", max_size=6),
    )


SPECS = ["tiny", "tiny40", "nope", ""]
INTS = [-1, 0, 1, 2, 3, 8, 16, 40, 64, 128, 512]


def _typed(action, paths: dict[str, str]):
    """Mostly values of the option's own kind (so parsing succeeds and the command runs),
    sometimes anything."""
    spec_paths = [paths["tiny_yaml"], paths["broken"], paths["missing"], paths["binary"]]
    if action.dest in ("spec", "specs"):
        own = st.sampled_from(SPECS + spec_paths + [paths["dir"]])
    elif action.dest == "batch":
        own = st.sampled_from([paths["batch"], paths["bad_json"], paths["missing"], "-"])
    elif action.dest == "out":
        own = st.sampled_from([paths["out"], paths["batch"], paths["dir"]])
    elif action.choices:
        own = st.sampled_from([str(c) for c in action.choices])
    elif action.type is int:
        own = st.sampled_from(INTS).map(str)
    elif action.type is float:
        own = st.sampled_from(["0", "0.5", "1", "-1", "2", "nan", "inf"])
    else:
        own = st.one_of(
            st.sampled_from(sorted(paths.values()) + ["1,2,3", "1,,2", "999", "300,1", ""]),
            st.text(string.printable + "\x00é\u2028", max_size=8),
        )
    anything = _value(paths)
    return st.sampled_from([True] * 9 + [False]).flatmap(lambda keep: own if keep else anything)


def _argv(command: str, paths: dict[str, str]):
    sub = _subparser(command)
    opts = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    positionals = [a for a in sub._actions if not a.option_strings and a.dest != "args"]

    @st.composite
    def build(draw):
        argv = [command] + [draw(_typed(a, paths)) for a in positionals]
        chosen = [a for a in opts if a.required and draw(st.integers(0, 9))]
        chosen += draw(st.lists(st.sampled_from(opts), max_size=4)) if opts else []
        for action in chosen:
            argv.append(draw(st.sampled_from(action.option_strings)))
            if action.nargs != 0:
                argv.append(draw(_typed(action, paths)))
        return argv

    return build()


@pytest.mark.parametrize(
    ("command", "examples"),
    [
        ("compile", 25),
        ("explain", 30),
        ("plan", 30),
        ("init-checkpoint", 30),
        ("run", 50),
        ("bench", 10),
    ],
)
def test_fuzzed_arguments(command, examples, paths, fake_engine, tmp_path):
    @settings(FUZZ, max_examples=examples)
    @given(data=st.data())
    def inner(data):
        argv = data.draw(_argv(command, paths))
        if command == "compile" and "--check" not in argv:
            argv += ["--out", str(tmp_path / "generated")]  # never write into the package
        if command == "bench":  # a script's own run is a benchmark, not an input: ask its help
            argv = ["bench", data.draw(st.sampled_from([*sorted(BENCHMARKS), "nope"])), "--help"]
        rc, _, err = call(argv)
        check(argv, rc, err)

    inner()


def test_version_and_help_exit_zero():
    rc, out, _ = call(["--version"])
    assert rc == 0 and out.startswith("v41plan ")
    rc, out, _ = call(["run", "--help"])
    assert rc == 0 and "--max-tokens" in out


# --- config.json ----------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def tiny_config() -> dict:
    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.config import config_from_cache_spec

    return config_from_cache_spec(load_cache_spec("tiny")).to_hf()


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_fuzzed_config_json(data, tiny_config):
    """A mutated ``config.json`` is accepted or refused with a ``ValueError``/``TypeError``
    (what ``read_config`` turns into a one-line ``CheckpointError``)."""
    from v41plan.model.config import ModelConfig

    cfg = json.loads(json.dumps(tiny_config))
    text = cfg["text_config"]
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(text)))
        kind = data.draw(st.sampled_from(["set", "drop", "typo", "add", "top"]))
        if kind == "set":
            text[key] = data.draw(JSON)
        elif kind == "drop":
            text.pop(key)
        elif kind == "typo" and len(key) > 3:
            i = data.draw(st.integers(0, len(key) - 1))
            text[key[:i] + key[i + 1 :]] = text.pop(key)
        elif kind == "add":
            text[data.draw(st.text(string.ascii_lowercase + "_", min_size=1, max_size=12))] = 1
        else:
            cfg = data.draw(st.sampled_from([cfg, [cfg], "x", {"text_config": data.draw(JSON)}]))
            break
    try:
        ModelConfig.from_hf(cfg)
    except (ValueError, TypeError) as exc:
        assert str(exc) and "\n" not in str(exc)


@settings(FUZZ, max_examples=40)
@given(raw=st.one_of(st.binary(max_size=40), JSON.map(json.dumps)))
def test_fuzzed_config_file(raw, tmp_path_factory):
    from v41plan.model.checkpoint import CheckpointError, read_config

    d = tmp_path_factory.mktemp("cfg")
    p = d / "config.json"
    p.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    with pytest.raises(CheckpointError, match=r"config\.json: ") as exc:
        read_config(d)
    assert "\n" not in str(exc.value)


# --- --batch JSON -----------------------------------------------------------------------------

REQUEST = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(-2, 300),
        "start": st.integers(-2, 300),
        "chunk_len": st.integers(-2, 300),
    },
    optional={
        "prefix_hit": st.sampled_from([0, 32, 64, 5, -1, "x"]),
        "phase": st.sampled_from(["prefill", "decode", "verify", 3]),
        "full_rows": st.sampled_from([True, False, 1, None]),
        "fresh_slot": st.sampled_from([True, False, "yes"]),
    },
)
BATCH = st.fixed_dictionaries(
    {"requests": st.lists(REQUEST, max_size=4)},
    optional={
        "phase": st.sampled_from(["prefill", "decode", None]),
        "running_bs": st.integers(-1, 6),
        "running_tokens": st.integers(-1, 600),
    },
)


@settings(FUZZ, max_examples=80)
@given(doc=st.one_of(BATCH, JSON, BATCH.map(lambda b: [b])))
def test_fuzzed_batch_json(doc, tmp_path_factory):
    p = tmp_path_factory.mktemp("batch") / "batch.json"
    p.write_text(json.dumps(doc))
    argv = ["plan", "tiny", "--batch", str(p)]
    rc, _, err = call(argv)
    check(argv + [json.dumps(doc)], rc, err)
    assert rc in (0, 2)


# --- spec YAML --------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    st.sampled_from(["0", "-1", "1.5", "null", "true", "''", "[]", "{}", "[1, 2]", "x", "{a: 1}"]),
    st.text(string.ascii_letters + string.digits + " :-[]{},'\"#", max_size=8),
)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_fuzzed_spec_yaml(data, tmp_path_factory):
    """A mutated spec file: explained, or refused at a located line; never a traceback."""
    lines = TINY.read_text().splitlines()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        kind = data.draw(st.sampled_from(["value", "drop", "dup", "indent", "cut"]))
        if kind == "value" and ":" in lines[i]:
            lines[i] = lines[i].split(":", 1)[0] + ": " + data.draw(SCALARS)
        elif kind == "drop":
            lines.pop(i)
        elif kind == "dup":
            lines.insert(i, lines[i])
        elif kind == "indent":
            lines[i] = "  " + lines[i]
        elif kind == "cut":
            lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
    d = tmp_path_factory.mktemp("spec") / "specs"
    d.mkdir()
    p = d / "tiny.yaml"
    p.write_text("\n".join(lines) + "\n")
    argv = ["explain", str(p), "--json"]
    rc, _, err = call(argv)
    check(argv, rc, err)
    assert rc in (0, 2)
