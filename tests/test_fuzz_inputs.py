"""Fuzz: mutated profile JSON, plan YAML and MindFormers YAML never give a traceback.

Each example mutates a valid file (a value of another type, a sign, NaN/inf, a huge number, a key
deleted or added, a container retyped, a YAML alias, a duplicate key, bytes that are not UTF-8, an
empty, truncated or deeply nested file) and feeds it to its loader and to the CLI in-process. The
outcome is a clean run, or the project's ``ValueError`` family in Python and exit 2 with one line on
the CLI, no output file left behind; with ``--debug`` the refusal raises (the traceback is shown).
An accepted file must still mean something: an accepted profile simulates, an accepted plan keeps its
decisions. Examples are bounded and derandomized: the whole file runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaptive_mem
from adaptive_mem.cli import main
from adaptive_mem.config import ConfigError, load_config
from profiler import Profile, ProfileError
from search import Plan, PlanError, simulate

FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
EXAMPLES = {"profile": 80, "plan": 50, "config": 40}  # about 30 s together on two cores: CI keeps them all

CONFIG = r"""model:
  model_config:
    num_layers: 4
    offset: 0
    pp_interleave_num: 1
parallel_config:
  pipeline_stage: 1
recompute_config:
  recompute: [1]
  select_recompute: ['feed_forward\.mul']
  select_comm_recompute: true
  mp_comm_recompute: false
swap_config:
  swap: true
  layer_swap:
    - backward_prefetch: 2
      layers: [3]
  op_swap:
    - op_name: 'attention'
      backward_prefetch: 1
      layers: [1, 2]
"""


def _laughs(levels: int = 9) -> list:
    """10**levels leaves in a few kB of YAML: one list aliased ten times per level."""
    lol: list = ["lol"] * 10
    for _ in range(levels - 1):
        lol = [lol] * 10
    return lol


LAUGHS = object()
NASTY = [None, True, False, "", "x", "12", -1, 0, 1, 0.5, -0.0, -1e308, 1e308, math.nan, math.inf, -math.inf,
         2**63, 2**64 + 1, 10**40, 10**400, [], [1, -1], [[0, 1]], {}, {"k": None}, LAUGHS]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    profile, plan, config = root / "p.json", root / "plan.yaml", root / "train.yaml"
    with _quiet():
        assert main(["profile", "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "16", "--device", "meta",
                     "-o", str(profile)]) == 0
        assert main(["search", str(profile), "--activation-budget", "0.5", "-o", str(plan)]) == 0
    assert Plan.load(plan).decisions, "the fuzzed plan has decisions (so losing them is visible)"
    config.write_text(CONFIG)
    return {"profile": profile, "plan": plan, "config": config}


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _cli(argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` in-process: its exit code and what it printed to stderr (log lines left out)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    lines = [ln for ln in err.getvalue().splitlines() if not re.match(r"(DEBUG|INFO|WARNING) - ", ln)]
    return code, "\n".join(lines)


# ---------------------------------------------------------------- mutations
def _slots(tree, path=(), seen=None):
    """Paths to every node, each shared container (a YAML alias, a cycle, the laughs) entered once."""
    seen = set() if seen is None else seen
    if id(tree) in seen:
        return
    seen.add(id(tree))
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield path + (key,)
        yield from _slots(value, path + (key,), seen)


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@st.composite
def mutated_tree(draw, tree, *, yaml_form: bool):
    """``tree`` with one to three nodes replaced, negated, scaled, stringified, deleted, added or retyped."""
    data = copy.deepcopy(tree)
    for _ in range(draw(st.integers(1, 3))):
        slots = list(_slots(data))
        if not slots:
            break
        shallow = [s for s in slots if not any(isinstance(k, int) for k in s)]  # outside the long op/unit lists
        path = draw(st.sampled_from(shallow if shallow and draw(st.booleans()) else slots))
        parent, key = _at(data, path[:-1]), path[-1]
        value = parent[key]
        how = draw(st.sampled_from(["replace", "replace", "negate", "scale", "string", "delete", "add", "retype",
                                    "alias"]))
        if how == "replace":
            new = draw(st.sampled_from(NASTY if yaml_form else [v for v in NASTY if v is not LAUGHS]))
            parent[key] = _laughs() if new is LAUGHS else copy.deepcopy(new)
        elif how == "negate" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = -value if value else -1
        elif how == "scale" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = value * 10**30 if isinstance(value, int) else value * 1e300
        elif how == "string" and not isinstance(value, (dict, list)):
            parent[key] = str(value)
        elif how == "delete":
            del parent[key]
        elif how == "add":
            if isinstance(value, dict):
                value["unknown_key"] = draw(st.sampled_from([1, "x", None]))
            elif isinstance(value, list):
                value.append(copy.deepcopy(value[0]) if value else 1)
            elif isinstance(parent, dict):
                parent["unknown_key"] = value
        elif how == "retype" and isinstance(value, dict):
            parent[key] = list(value.values())
        elif how == "retype" and isinstance(value, list):
            parent[key] = {str(i): v for i, v in enumerate(value)}
        elif how == "alias":
            parent[key] = _at(data, draw(st.sampled_from(shallow or slots)))  # the same object twice: a YAML alias
    return data


def _dump(data, *, yaml_form: bool) -> str:
    if yaml_form:
        try:
            return yaml.safe_dump(data, sort_keys=False)
        except RecursionError:  # an alias made the tree contain itself where PyYAML cannot write that
            return "recursive: &r [*r]\n"
    try:
        return json.dumps(data, indent=1)
    except (ValueError, RecursionError):  # a cycle: JSON cannot say that
        return "{}"


@st.composite
def mutated_file(draw, tree, *, yaml_form: bool) -> bytes:
    """A mutated tree written out, sometimes damaged as text: truncated, not UTF-8, duplicate key, empty..."""
    text = _dump(draw(mutated_tree(tree, yaml_form=yaml_form)), yaml_form=yaml_form)
    first = next(iter(tree))
    how = draw(st.sampled_from(["as is"] * 6 + ["empty", "truncate", "bytes", "duplicate", "deep", "digits",
                                                 "tag", "bom"]))
    if how == "empty":
        return b""
    if how == "truncate":
        return text.encode()[: draw(st.integers(0, max(0, len(text) - 1)))]
    if how == "bytes":
        at = draw(st.integers(0, len(text)))
        return text.encode()[:at] + b"\xff\xfe\x80" + text.encode()[at:]
    if how == "duplicate":
        line = f"{first}: {json.dumps(tree[first])}\n" if yaml_form else f'{{"{first}": 0, '
        return (text + line).encode() if yaml_form else (line + text.lstrip()[1:]).encode()
    if how == "deep":
        return ("a: " + "[" * 1_000 if yaml_form else "[" * 100_000).encode()  # past Python's recursion limit
    if how == "digits":
        number = re.search(r"(?<![\w.])\d+(?![\w.])", text)
        return (text[: number.start()] + "9" * 5000 + text[number.end():]).encode() if number else text.encode()
    if how == "tag" and yaml_form:
        return (text + "evil: !!python/object/apply:os.getcwd []\n").encode()
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    return text.encode()


# ---------------------------------------------------------------- properties
def _refused(exc: Exception, family: type[ValueError]) -> None:
    assert isinstance(exc, family), f"{type(exc).__name__} is not a {family.__name__}: {exc}"
    message = str(exc)
    assert message and "\n" not in message and len(message) < 600, message


def _cli_refusal(argv: list[str], cmd: str, output: Path | None = None) -> int:
    """Run ``argv``: 0, or 2 with one error line, no ``output`` left, and a raise under ``--debug``."""
    code, err = _cli(argv)
    assert code in (0, 2), (code, err)
    if code == 2:
        assert len(err.splitlines()) == 1 and err.startswith(f"adaptive-mem {cmd}: error: "), err
        assert output is None or not output.exists(), f"{output} half-written on a refused input"
        with pytest.raises(ValueError), _quiet():
            main([argv[0], "--debug", *argv[1:]])
    else:
        assert not err, err
    return code


def _write(tmp: Path, name: str, content: bytes) -> Path:
    path = tmp / name
    path.write_bytes(content)
    return path


@pytest.fixture(scope="module")
def trees(files) -> dict:
    return {"profile": json.loads(files["profile"].read_text()), "plan": yaml.safe_load(files["plan"].read_text()),
            "config": yaml.safe_load(files["config"].read_text())}


def check_profile(files: dict[str, Path], tmp: Path, content: bytes) -> None:
    path = _write(tmp, "p.json", content)
    try:
        Profile.load(path)
    except Exception as exc:  # noqa: BLE001 - the property is about which exception
        _refused(exc, ProfileError)
        accepted = False
    else:
        accepted = True
    _cli_refusal(["simulate", str(path), str(files["plan"])], "simulate")
    out = tmp / "out.yaml"
    if _cli_refusal(["search", str(path), "--activation-budget", "0.5", "--solver", "greedy", "-o", str(out)],
                    "search", out) == 0:
        assert Plan.load(out).to_dict()["format"] == "adaptive-mem-plan"
    if accepted:
        sim = simulate(Profile.load(path), Plan())
        assert all(math.isfinite(x) for x in (sim.peak_bytes, sim.step_time)), "an accepted profile simulates"


def check_plan(files: dict[str, Path], tmp: Path, content: bytes) -> None:
    path = _write(tmp, "plan.yaml", content)
    try:
        plan = Plan.load(path)
    except Exception as exc:  # noqa: BLE001
        _refused(exc, PlanError)
        plan = None
    if plan is not None and not plan.decisions:
        assert re.search(r"^decisions: \{\}$", content.decode(), re.M), "decisions vanished, yet the plan loaded"
    _cli_refusal(["simulate", str(files["profile"]), str(path)], "simulate")


def check_config(files: dict[str, Path], tmp: Path, content: bytes) -> None:
    path = _write(tmp, "train.yaml", content)
    try:
        with _quiet():
            adaptive_mem.plan_from_config(load_config(path), model=None, num_layers=4)
    except Exception as exc:  # noqa: BLE001
        _refused(exc, ConfigError)
    _cli_refusal(["explain", "--model", "llama-tiny", "--config", str(path)], "explain")


@pytest.mark.parametrize("kind, check", [("profile", check_profile), ("plan", check_plan), ("config", check_config)])
def test_fuzz(kind, check, files, trees, tmp_path_factory):
    """A mutated {profile JSON, plan YAML, MindFormers YAML}: a clean run or a one-line refusal, never a traceback."""
    @settings(FUZZ, max_examples=EXAMPLES[kind])
    @given(content=mutated_file(trees[kind], yaml_form=kind != "profile"))
    def run(content: bytes) -> None:
        check(files, tmp_path_factory.mktemp(kind), content)

    run()


# ---------------------------------------------------------------- each class the fuzzer found, pinned
def _edit(tree, path, value):
    data = copy.deepcopy(tree)
    _at(data, path[:-1])[path[-1]] = value
    return data


HUGE_LITERAL = "9" * 5000
PROFILE_CASES = [  # (edit of the profile text, the one line it gives)
    (lambda t, d: "", "empty; expected a JSON profile"),
    (lambda t, d: "[" * 100_000, "nested too deeply; expected a JSON profile"),
    (lambda t, d: t.replace('"num_layers": 4', f'"num_layers": {HUGE_LITERAL}'), "a number of more than 4300 digits"),
    (lambda t, d: json.dumps(_edit(d, ("static", "parameters"), 2**64)),
     "profile.static.parameters=18446744073709551616: expected a number below 2**63"),
    (lambda t, d: json.dumps(_edit(d, ("ops", 0, "output_bytes"), 10**400)), "expected a number below 2**63"),
    (lambda t, d: json.dumps(_edit(d, ("model", "fingerprint"), 5)),
     "profile.model.fingerprint=5: expected a string or null"),
    (lambda t, d: json.dumps(_edit(d, ("ops", 0, "unit"), list(range(10_000)))),
     r"profile.ops[0].unit=[0, 1, 2, 3, 4, ...]: expected str"),
]


@pytest.mark.parametrize("edit, message", PROFILE_CASES)
def test_refused_profile_text_gives_one_short_line(edit, message, files, trees, tmp_path):
    path = _write(tmp_path, "p.json", edit(files["profile"].read_text(), trees["profile"]).encode())
    with pytest.raises(ProfileError) as info:
        Profile.load(path)
    _refused(info.value, ProfileError)
    assert message in str(info.value) and len(str(info.value)) < 300


def _plan_text(tree, path, value) -> str:
    return yaml.safe_dump(_edit(tree, path, value), sort_keys=False)


PLAN_CASES = [  # (plan text from the valid plan tree, the one line it gives)
    (lambda d: "", "empty; expected a mapping with format: adaptive-mem-plan"),
    (lambda d: "a: " + "[" * 1_000, "nested too deeply"),
    (lambda d: f"format: adaptive-mem-plan\nversion: {HUGE_LITERAL}\n", "a number of more than 4300 digits"),
    (lambda d: yaml.safe_dump({k: v for k, v in d.items() if k != "decisions"}), "plan.decisions: missing"),
    (lambda d: _plan_text(d, ("model", "dtype"), ["float32"]), "plan.model.dtype=['float32']: expected a string"),
    (lambda d: _plan_text(d, ("model", "num_layers"), -4), "plan.model.num_layers=-4: expected a positive integer"),
    (lambda d: _plan_text(d, ("decisions", "layers.0"), {"action": "swap", 1: 2, "b": 3}),
     "plan.decisions.layers.0.1: unknown key"),
    (lambda d: _plan_text(d, ("decisions", "layers.0"), {"action": "swap", "backward_prefetch": 2**31}),
     "plan.decisions.layers.0.backward_prefetch=2147483648: expected an integer >= 0 and <= 2147483647"),
    (lambda d: _plan_text(d, ("decisions", "layers.0"), {"action": ["swap"]}),
     "plan.decisions.layers.0.action=['swap']: expected one of keep, recompute, swap"),
    (lambda d: _plan_text(d, ("decisions", "layers.0"), {"action": _laughs(7)}),  # YAML aliases: 10**7 items
     "plan.decisions.layers.0.action=[[[...], [...], [...], [...], [...], ...], [[...], "),
    (lambda d: _plan_text(d, ("model", "dtype"), _laughs(7)),
     "plan.model.dtype=[[[...], [...], [...], [...], [...], ...], [[...], "),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, message", PLAN_CASES)
def test_refused_plan_text_gives_one_short_line(text, message, files, trees, tmp_path):
    content = text(trees["plan"])
    path = _write(tmp_path, "plan.yaml", content.encode())
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    _refused(info.value, PlanError)
    assert message in str(info.value) and len(str(info.value)) < 300
    assert _cli_refusal(["simulate", str(files["profile"]), str(path)], "simulate") == 2


def test_plan_bytes_that_are_not_utf8_are_a_plan_error(tmp_path):
    path = _write(tmp_path, "plan.yaml", b"format: adaptive-mem-plan\n\xff\xfe")
    with pytest.raises(PlanError, match="not UTF-8 text; expected a YAML or JSON plan"):
        Plan.load(path)


CONFIG_CASES = [  # (config text, the one line it gives)
    (b"recompute_config:\n  recompute: true\n\xff\xfe\n", "not UTF-8 text; expected a MindFormers YAML"),
    (b"a: " + b"[" * 1_000, "nested too deeply; expected a MindFormers YAML"),
    (f"model: {{model_config: {{num_layers: {HUGE_LITERAL}}}}}\n".encode(), "a number of more than 4300 digits"),
    (b"parallel_config: {pipeline_stage: 1000000000000}\nrecompute_config: {recompute: true}\n",
     "parallel_config.pipeline_stage=1000000000000 x model.model_config.pp_interleave_num=1: more chunks than the 4"),
    (b"model: {model_config: {pp_interleave_num: 1000000000000, offset: [0]}}\nrecompute_config: {recompute: true}\n",
     "model.model_config.pp_interleave_num=1000000000000: more interleaved chunks per stage than the 4 layers"),
    (b"swap_config: {swap: true, default_prefetch: 2147483648}\n",
     "swap_config.default_prefetch=2147483648: expected an integer >= 0 and <= 2147483647"),
    (yaml.safe_dump({"recompute_config": {"recompute": _laughs(8)}}).encode(), "recompute_config.recompute"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content, message", CONFIG_CASES)
def test_refused_config_text_gives_one_short_line(content, message, tmp_path):
    path = _write(tmp_path, "train.yaml", content)
    with pytest.raises(ConfigError) as info, _quiet():
        adaptive_mem.plan_from_config(load_config(path), model=None, num_layers=4)
    _refused(info.value, ConfigError)
    assert message in str(info.value) and len(str(info.value)) < 300
    assert _cli_refusal(["explain", "--model", "llama-tiny", "--config", str(path)], "explain") == 2


def test_cli_prints_a_refusal_of_several_lines_as_one(monkeypatch, capsys):
    from adaptive_mem.cli import _explain

    def refuse(args):
        raise ValueError("first line\n  second line")

    monkeypatch.setattr(_explain, "run", refuse)
    assert main(["explain", "--model", "llama-tiny", "--config", "x.yaml"]) == 2
    assert capsys.readouterr().err == "adaptive-mem explain: error: first line second line\n"
    with pytest.raises(ValueError, match="second line"):
        main(["explain", "--debug", "--model", "llama-tiny", "--config", "x.yaml"])
