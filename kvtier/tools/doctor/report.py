"""How `kvtier doctor` reports: a compact table, then the problems with their fixes; `--json` adds one
JSON object as the last line. `run_doctor` ties observe -> judge -> report together."""

from __future__ import annotations

import asyncio
import json

import msgspec

from kvtier.tools.settings import DoctorSettings

from .judge import diagnose, exit_code, shorten
from .observe import observe
from .views import Finding, Status


# --- report ------------------------------------------------------------------------------------
def counts(findings: list[Finding]) -> dict[str, int]:
    return {s.value: sum(1 for f in findings if f.status == s) for s in Status}


def render(findings: list[Finding], strict: bool = False, width: int = 120) -> str:
    subject_w = min(max((len(f.subject) for f in findings), default=7), 34)
    lines = [f"{'STATUS':<6} {'CHECK':<12} {'SUBJECT':<{subject_w}} FINDING"]
    room = max(30, width - 6 - 12 - subject_w - 3)
    for f in findings:
        label = f.status.value if f.status == Status.OK else f.status.value.upper()
        subject = f.subject if len(f.subject) <= subject_w else f.subject[: subject_w - 1] + "…"
        lines.append(f"{label:<6} {f.check:<12} {subject:<{subject_w}} {shorten(f.finding, room)}")
    problems = [f for f in findings if f.status != Status.OK]
    problems.sort(key=lambda f: f.status != Status.FAIL)
    if problems:
        lines.append("")
        lines.append(f"{len(problems)} problem{'s' if len(problems) != 1 else ''}:")
        for f in problems:
            lines.append(f"- {f.status.value.upper()} {f.check} {f.subject}: {f.finding}")
            if f.fix:
                lines.append(f"  fix: {f.fix}")
    c = counts(findings)
    code = exit_code(findings, strict)
    verdict = "FAIL" if c["fail"] else ("WARN" if c["warn"] else "OK")
    lines.append("")
    lines.append(f"kvtier doctor: {verdict} ({c['fail']} failed, {c['warn']} "
                 f"warning{'' if c['warn'] == 1 else 's'}, {c['ok']} ok; exit {code})")
    return "\n".join(lines)


def report_json(findings: list[Finding], strict: bool = False) -> str:
    code = exit_code(findings, strict)
    return json.dumps({
        "ok": code == 0, "exit_code": code, "strict": strict, "counts": counts(findings),
        "findings": msgspec.to_builtins(findings),
    })


def run_doctor(settings: DoctorSettings) -> int:
    import logging

    logging.getLogger("nats").setLevel(logging.CRITICAL)  # connection errors are findings here
    obs = asyncio.run(observe(settings.nats_url, settings.redis_url, list(settings.routers), settings.mooncake_master,
                              settings.model or None, settings.events_window_s, settings.timeout_s))
    findings = diagnose(obs)
    print(render(findings, settings.strict), flush=True)
    if settings.json:
        print(report_json(findings, settings.strict), flush=True)
    return exit_code(findings, settings.strict)
