"""Each setting of the services a deployment runs is declared once, as a field of its settings
class (kvtier/plumbing/settings.py): `kvtier <command>`'s flags, their defaults and help come from
those declarations, nothing else writes a default for them, docs/DEPLOY.md's flag tables (and
its prose where it quotes a default) say the same, and the rules between settings are their
class's validate()."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import build_parser
from kvtier.commands.flags import EnvDefaults, add_common, env_name
from kvtier.commands.sim_worker import SimWorkerSettings
from kvtier.consumers.analytics_config import AnalyticsConfig
from kvtier.consumers.hash_check import HashValidator
from kvtier.consumers.processor_config import ProcessorConfig
from kvtier.plumbing.settings import Flag, FlagGroup, SettingsError, declared, flags_of, read_settings
from kvtier.producers.bridge_config import BridgeConfig
from kvtier.producers.bridge_settings import BridgeSettings
from kvtier.router.booking import LoadBook
from kvtier.router.config import RouterConfig
from kvtier.router.fallback import Fallback
from kvtier.router.http_limits import HttpLimits
from kvtier.router.service_settings import ServiceSettings
from kvtier.router.settings import BOOKING_TTL_S, RouterMode, RouterSettings, SharedCacheType, StateSource
from kvtier.schemas.routing import AdmissionSettings
from kvtier.schemas.worker import AttentionKind

ROOT = Path(__file__).resolve().parents[2]

#: command -> its settings class, the module registering it, and the least it must be given.
SERVICES = {
    "bridge": (BridgeSettings, "bridge", ["--worker-id", "w0", "--nats", "nats://n:4222"]),
    "processor": (ProcessorConfig, "processor", ["--nats", "nats://n:4222", "--redis", "redis://r:6379/0"]),
    "router": (RouterConfig, "router", ["--redis", "redis://r:6379/0"]),
    "analytics": (AnalyticsConfig, "analytics", ["--nats", "nats://n:4222"]),
    "sim-worker": (SimWorkerSettings, "sim_worker", ["--port", "5557", "--replay-port", "5558"]),
}


@pytest.fixture(autouse=True)
def _no_kvtier_environment(monkeypatch):
    """The defaults as declared, not as this shell's KVTIER_* would make them."""
    import os

    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)


def _subparser(command: str):
    return next(a for a in build_parser()._actions if a.dest == "command").choices[command]


def _long_flag(action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs and longs[0] != "--help" else None


def _group_flags(settings: type) -> dict[str, FlagGroup]:
    """The flags that another module declares for a settings class (scoring weights, cost model)."""
    found = {}
    for _, spec in declared(settings):
        if isinstance(spec, FlagGroup) and spec.settings is None:
            scratch = EnvDefaults(prog="scratch")
            spec.add(scratch)
            found.update({_long_flag(a): spec for a in scratch._actions if _long_flag(a)})
    return found


def _common_flags(settings: type) -> set[str]:
    """What add_common puts on a parser holding this class's flags (--nats-* only beside --nats)."""
    scratch = EnvDefaults(prog="scratch")
    names = {spec.name for _, spec in flags_of(settings)}
    for name in ("--nats", "--redis"):
        if name in names:
            scratch.add_argument(name)
    before = {_long_flag(a) for a in scratch._actions}
    add_common(scratch)
    return {_long_flag(a) for a in scratch._actions} - before - {None}


@pytest.mark.parametrize("command", SERVICES)
def test_every_flag_of_the_command_comes_from_one_declaration(command):
    settings, _, _ = SERVICES[command]
    own = {spec.name: (f, spec) for f, spec in flags_of(settings)}
    groups, common = _group_flags(settings), _common_flags(settings)
    assert not (own.keys() & groups.keys()) and not (own.keys() & common) and not (groups.keys() & common)
    parsed = [a for a in _subparser(command)._actions if _long_flag(a)]
    assert len({_long_flag(a) for a in parsed}) == len(parsed)
    assert {_long_flag(a) for a in parsed} == own.keys() | groups.keys() | common
    for action in parsed:
        flag = _long_flag(action)
        if flag not in own:
            continue
        f, spec = own[flag]
        assert action.dest == (spec.dest or f.name), flag
        assert action.help == f"{spec.help} [env {env_name(flag)}]", flag
        assert action.required == spec.required, flag
        if not spec.required:
            assert action.default == spec.text_default, flag
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            assert spec.value(action.default) == default, f"{flag}: the parser's default is not the field's"


@pytest.mark.parametrize("command", SERVICES)
def test_settings_read_from_a_bare_command_line_are_the_declared_defaults(command):
    settings, _, least = SERVICES[command]
    args = build_parser().parse_args([command, *least])
    given = {f.name: getattr(args, spec.dest or f.name) for f, spec in declared(settings)
             if isinstance(spec, Flag) and spec.required}
    assert read_settings(settings, args) == settings(**given)


@pytest.mark.parametrize("command", SERVICES)
def test_the_command_module_writes_no_flag_of_its_own(command):
    """A flag (and its default) is declared in the settings class, never in the command module."""
    _, module, _ = SERVICES[command]
    tree = ast.parse((ROOT / "kvtier" / "commands" / f"{module}.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    assert not [c.lineno for c in calls if c.func.attr == "add_argument"]
    defaults = [kw.arg for c in calls if c.func.attr == "set_defaults" for kw in c.keywords]
    assert defaults == ["run"]


def _literal(node: ast.expr) -> bool:
    """A default written out (600.0, 1 << 18, -1, "kv"), not a name of one written elsewhere."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    return False


def _declared_defaults(path: Path, class_name: str) -> dict[str, ast.expr]:
    """field -> the default expression its declaration (setting/choice/on_off) gives."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = {}
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Call):
            name = getattr(item.value.func, "id", "")
            args = item.value.args
            if name in ("setting", "on_off") and args:
                found[item.target.id] = args[0]
            elif name == "choice" and len(args) > 1:
                found[item.target.id] = args[1]
    return found


def test_a_router_setting_used_by_the_core_or_the_edge_has_its_default_there_only():
    """RouterSettings, HttpLimits and AdmissionSettings are built on their own too (tests,
    benches), so they keep their defaults and RouterConfig names them; ServiceSettings is built
    only from RouterConfig, so it has none for what a flag sets."""
    homes = {name: home for home in (RouterSettings(), HttpLimits()) for name in
             (f.name for f in dataclasses.fields(home))}
    homes |= {name: AdmissionSettings() for name in AdmissionSettings.__struct_fields__}
    declarations = _declared_defaults(ROOT / "router" / "config.py", "RouterConfig")
    assert len(declarations) > 40
    shared = homes.keys() & declarations.keys()
    assert len(shared) >= 10
    written_twice = sorted(name for name in shared | {"page_size"} if _literal(declarations[name]))
    assert not written_twice, f"write these defaults once, in the class that uses them: {written_twice}"
    config = RouterConfig(redis_url="redis://r")
    assert [name for name in shared if getattr(config, name) != getattr(homes[name], name)] == []
    defaulted = {f.name for f in dataclasses.fields(ServiceSettings)
                 if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    assert defaulted == {"process", "housekeeping_s", "stored_page_check_s"}  # no flag sets these


def test_the_bridge_config_has_no_default_for_what_the_settings_say():
    names = {f.name for f, _ in flags_of(BridgeSettings)}
    defaulted = [f.name for f in dataclasses.fields(BridgeConfig) if f.name in names
                 and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)]
    assert not defaulted


def _default_of(function, parameter: str):
    return inspect.signature(function).parameters[parameter].default


def test_a_default_shared_with_a_library_class_is_the_same_constant():
    """The booking TTL was written in five places; now each of them is BOOKING_TTL_S itself."""
    assert BOOKING_TTL_S == 600.0
    for default in (RouterConfig(redis_url="r").booking_ttl_s, RouterSettings().booking_ttl_s,
                    _default_of(LoadBook, "booking_ttl_s"), _default_of(Fallback, "ttl_s")):
        assert default is BOOKING_TTL_S
    assert ProcessorConfig(nats_url="n", redis_url="r").hash_check_budget is _default_of(HashValidator,
                                                                                         "budget_pages_per_s")


def _doc_rows() -> dict[str, dict[str, str]]:
    """command -> flag -> its row, from docs/DEPLOY.md's generated tables."""
    tables = runpy.run_path(str(ROOT / "deploy" / "flag_table.py"))
    rows: dict[str, dict[str, str]] = {}
    command = None
    for line in tables["section"]((ROOT / "docs" / "DEPLOY.md").read_text()).splitlines():
        if line.startswith("#### `kvtier "):
            command = line.split("`kvtier ", 1)[1].rstrip("`")
            rows[command] = {}
        elif line.startswith("| `--") and command:
            rows[command][line.split("`")[1]] = line
    return rows


@pytest.mark.parametrize("command", SERVICES)
def test_deploy_flag_tables_say_what_the_declarations_say(command):
    tables = runpy.run_path(str(ROOT / "deploy" / "flag_table.py"))
    settings, _, _ = SERVICES[command]
    rows = _doc_rows()[command]
    for _, spec in flags_of(settings):
        default = tables["default_cell"](spec.text_default, required=spec.required, switch=spec.action == "store_true")
        assert rows.get(spec.name) == tables["row"](spec.name, default, spec.help, spec.choices), spec.name


#: Numbers DEPLOY.md's prose puts beside a flag that are not its default.
NOT_DEFAULTS = {("--max-request-tokens", 413.0)}  # the status of a refusal


def test_deploy_prose_quotes_the_declared_defaults():
    doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    tables = runpy.run_path(str(ROOT / "deploy" / "flag_table.py"))
    start, end = doc.index(tables["BEGIN"]), doc.index(tables["END"])
    prose = doc[:start] + doc[end:]
    defaults = {spec.name: spec.text_default for settings, _, _ in SERVICES.values() for _, spec in flags_of(settings)
                if isinstance(spec.text_default, (int, float)) and not isinstance(spec.text_default, bool)}
    quoted = [(m.group(1), float(m.group(2))) for m in
              re.finditer(r"`(--[a-z0-9-]+)`,?\s*\(?(?:default\s+)?(-?\d[\d_]*(?:\.\d+)?)\b", prose)]
    checked = [(flag, value) for flag, value in quoted if flag in defaults and (flag, value) not in NOT_DEFAULTS]
    assert len(checked) >= 10, "the check finds no quoted default: its pattern no longer matches the prose"
    wrong = [f"{flag} quoted as {value:g}, declared {defaults[flag]}" for flag, value in checked
             if value != defaults[flag]]
    assert not wrong


def test_modes_are_enums_with_the_names_the_flags_take():
    args = build_parser().parse_args(["router", "--redis", "r", "--router-mode", "round-robin", "--state-source",
                                      "redis", "--shared-cache-type", "hicache", "--mooncake-master", "http://m:1"])
    config = read_settings(RouterConfig, args)
    assert (config.router_mode, config.state_source, config.shared_cache_type) == (
        RouterMode.ROUND_ROBIN, StateSource.REDIS, SharedCacheType.HICACHE)
    assert f"{config.router_mode}" == "round-robin" and config.state_source == "redis"
    assert config.router_settings(shared_cache=True).selection == "round-robin"
    assert read_settings(RouterConfig, build_parser().parse_args(["router", "--redis", "r"])).router_settings(
        shared_cache=False).selection == "score"
    assert RouterSettings(state_source="redis").state_source is StateSource.REDIS  # benches give it by name
    # the index's former name still reads as it, on the command line and given by name
    former = read_settings(RouterConfig, build_parser().parse_args(["router", "--redis", "r", "--state-source",
                                                                    "mirror"]))
    assert former.state_source is StateSource.INDEX is RouterSettings(state_source="mirror").state_source
    bridge = read_settings(BridgeSettings, build_parser().parse_args(
        ["bridge", "--worker-id", "w", "--nats", "n", "--mooncake-attention", "mla"]))
    assert bridge.mooncake_attention is AttentionKind.MLA


def test_load_mode_zeroes_the_cache_weights_only():
    config = read_settings(RouterConfig, build_parser().parse_args(["router", "--redis", "r", "--router-mode", "load",
                                                                    "--prefill-load-scale", "3"]))
    weights = config.scoring_weights()
    assert (weights.overlap_score_credit, weights.host_cache_hit_weight, weights.disk_cache_hit_weight,
            weights.shared_cache_multiplier, weights.prefill_load_scale) == (0.0, 0.0, 0.0, 0.0, 3.0)


# The rules between settings, each in its class's validate().

def _bridge(**values) -> BridgeSettings:
    return BridgeSettings(worker_id="w", nats_url="n", **values)


def test_bridge_refuses_a_health_path_without_its_slash():
    with pytest.raises(SettingsError, match="must start with '/'"):
        _bridge(engine_health_path="health").validate()
    _bridge(engine_health_path=" /health ").validate()


def test_bridge_refuses_a_health_timeout_as_long_as_the_lease():
    with pytest.raises(SettingsError, match=r"--engine-health-timeout \(10s\) must be shorter than --lease-ttl"):
        _bridge(engine_health_timeout_s=10.0, lease_ttl_s=10.0).validate()
    _bridge(engine_health_timeout_s=10.0, lease_ttl_s=10.0, engine_health_path="").validate()  # no check: no rule
    short_lease = _bridge(lease_ttl_s=4.0)
    short_lease.validate()
    assert (short_lease.health_timeout_s, _bridge().health_timeout_s) == (2.0, 5.0)  # half the lease, at most 5 s


def _router(**values) -> RouterConfig:
    return RouterConfig(redis_url="redis://r", **values)


def test_router_refuses_the_shared_pool_without_its_master():
    with pytest.raises(SettingsError, match="--shared-cache-type hicache needs --mooncake-master"):
        _router(shared_cache_type=SharedCacheType.HICACHE).validate()
    _router(shared_cache_type=SharedCacheType.HICACHE, mooncake_master="http://m:9003").validate()


def test_router_takes_its_token_from_one_place(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    assert _router(auth_token_file=str(token_file)).bearer_token() == "s3cret"
    assert _router(auth_token=" t ").bearer_token() == "t"
    (tmp_path / "empty").write_text("\n")
    for values, message in [
        ({"auth_token": "a", "auth_token_file": str(token_file)}, "not both"),
        ({"auth_token_file": str(tmp_path / "empty")}, "is empty"),
        ({"auth_token_file": str(tmp_path / "missing")}, "cannot read"),
        ({"protect_metrics": True}, "--protect-metrics needs --auth-token or --auth-token-file"),
    ]:
        with pytest.raises(SettingsError, match=message):
            _router(**values).validate()
    _router(protect_metrics=True, auth_token="t").validate()


def test_sim_worker_refuses_a_mooncake_master_it_cannot_use():
    with pytest.raises(SettingsError, match="--mooncake-rpc needs --l3 and --mooncake-metadata"):
        SimWorkerSettings(port=1, replay_port=2, mooncake_rpc="m:50051", l3=True).validate()
    SimWorkerSettings(port=1, replay_port=2, mooncake_rpc="m:50051", l3=True, mooncake_metadata="http://m/").validate()


@pytest.mark.parametrize("argv, message", [
    (["router", "--redis", "redis://127.0.0.1:1/0", "--shared-cache-type", "hicache"],
     "kvtier router: --shared-cache-type hicache needs --mooncake-master"),
    (["sim-worker", "--port", "1", "--replay-port", "2", "--mooncake-rpc", "m:1"],
     "kvtier sim-worker: --mooncake-rpc needs --l3 and --mooncake-metadata"),
])
def test_a_rule_broken_on_the_command_line_is_a_usage_error(argv, message):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_secrets_stay_out_of_the_settings_repr():
    config = _router(auth_token="tok-123", engine_api_key="key-456")
    assert "tok-123" not in repr(config) and "key-456" not in repr(config)
    assert "k-789" not in repr(BridgeSettings(worker_id="w", nats_url="n", sglang_api_key="k-789"))
