"""Each setting of a bench is declared once, in its class of kvtier/bench/settings.py (the
evaluation's, `bench replay` and `bench synth-trace`, in kvtier/eval/settings.py): `kvtier bench
<name>`'s flags, their defaults and help come from there (the command module writes none of its
own), the settings read from a bare command line are the declared defaults, a soak's config takes
the flags' settings from their declarations, and a rule between flags is a usage error."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.settings import (
    FaultsBench,
    FuzzBench,
    IngestBench,
    OverloadBench,
    ProxyBench,
    RouteBench,
    SoakBench,
    SoakRun,
)
from kvtier.bench.soak import SoakConfig
from kvtier.cli import build_parser
from kvtier.commands.flags import EnvDefaults, add_common, env_name
from kvtier.eval.settings import ReplayBench, SynthTraceSettings
from kvtier.plumbing.settings import FlagGroup, SettingsError, declared, flags_of, read_settings

ROOT = Path(__file__).resolve().parents[2]
BENCHES = {"ingest": IngestBench, "route": RouteBench, "proxy": ProxyBench, "overload": OverloadBench,
           "soak": SoakBench, "faults": FaultsBench, "fuzz": FuzzBench, "replay": ReplayBench,
           "synth-trace": SynthTraceSettings}


@pytest.fixture(autouse=True)
def _no_kvtier_environment(monkeypatch):
    """The defaults as declared, not as this shell's KVTIER_* would make them."""
    import os

    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)


def _bench_parser(name: str):
    bench = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    return next(a for a in bench._actions if a.dest == "bench").choices[name]


def _long_flags(parser) -> dict[str, object]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _group_flags(settings: type) -> set[str]:
    """Flags another module declares for a class, nested classes included (weights, cost model)."""
    found: set[str] = set()
    for _, spec in declared(settings):
        if isinstance(spec, FlagGroup):
            if spec.settings is not None:
                found |= _group_flags(spec.settings)
                continue
            scratch = EnvDefaults(prog="scratch")
            spec.add(scratch)
            found |= _long_flags(scratch).keys()
    return found


@pytest.mark.parametrize("name", BENCHES)
def test_every_flag_of_a_bench_comes_from_its_declaration(name):
    settings = BENCHES[name]
    own = {spec.name: (f, spec) for f, spec in flags_of(settings)}
    common = EnvDefaults(prog="scratch")
    add_common(common)
    parsed = _long_flags(_bench_parser(name))
    assert parsed.keys() == own.keys() | _long_flags(common).keys() | _group_flags(settings)
    assert not own.keys() & _long_flags(common).keys()
    for flag, (f, spec) in own.items():
        action = parsed[flag]
        assert action.dest == (spec.dest or f.name), flag
        assert action.help == f"{spec.help} [env {env_name(flag)}]".strip(), flag  # --seed has no help
        assert action.default == spec.text_default, flag
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        assert spec.value(action.default) == default, f"{flag}: the parser's default is not the field's"


@pytest.mark.parametrize("name", BENCHES)
def test_a_bare_command_line_reads_as_the_declared_defaults(name):
    assert read_settings(BENCHES[name], build_parser().parse_args(["bench", name])) == BENCHES[name]()


def test_the_command_module_declares_no_flag_of_a_bench():
    """kvtier/commands/bench.py adds no flag itself: each comes from a settings class."""
    tree = ast.parse((ROOT / "kvtier" / "commands" / "bench.py").read_text())
    targets = {c.func.value.id for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
               and c.func.attr == "add_argument" and isinstance(c.func.value, ast.Name)}
    assert targets == set()


def test_a_soak_config_takes_the_flags_settings_from_their_declarations():
    flagged = {f.name for f in dataclasses.fields(SoakRun)}
    assert flagged <= {f.name for f in dataclasses.fields(SoakConfig)}
    tree = ast.parse((ROOT / "kvtier" / "bench" / "soak.py").read_text())
    config = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SoakConfig")
    again = {item.target.id for item in config.body if isinstance(item, ast.AnnAssign)} & flagged
    assert again == {"trace"}  # '' on the command line is the sample trace, which a config names
    assert SoakConfig.of(SoakBench(minutes=2, rate=5)) == SoakConfig(minutes=2, rate=5)
    with pytest.raises(SettingsError, match="survivor"):
        SoakConfig.of(SoakBench(sim_workers=3, die=3))


@pytest.mark.parametrize("argv, message", [
    (["soak", "--minutes", "20"], "kvtier bench: --minutes must be within 0.5..15, got 20"),
    (["soak", "--sim-workers", "2", "--die", "2"], "kvtier bench: --die must leave a survivor"),
])
def test_a_rule_broken_on_the_command_line_is_a_usage_error(argv, message):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", *argv], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
