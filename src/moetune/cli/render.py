"""Rich renderings of moetune's results for people; `--json` bypasses all of this."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from moetune.errors import clip
from moetune.units import count, gib, human_bytes

_VERDICT_STYLE = {"GO": "bold green", "NO-GO": "bold red", "INCONCLUSIVE": "bold yellow"}
SEVERITY_STYLE = {"error": "bold red", "warn": "yellow", "info": "cyan"}


def spec_table(spec: Any) -> Table:
    """Parameters by component, plus the MoE shape."""
    title = f"{spec.name} ({spec.model_type}) – {'MoE' if spec.is_moe else 'dense, not an MoE'}"
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("params", justify="right")
    table.add_column("share", justify="right")
    total = spec.total_params
    for name, n in spec.components.as_dict().items():
        if n:
            table.add_row(name, f"{n:,}", f"{100 * n / total:.1f} %")
    table.add_row("[bold]total[/]", f"[bold]{total:,}[/]", "100 %")
    table.add_row(
        "active (top-k)", f"{spec.active_params:,}", f"{100 * spec.active_params / total:.1f} %"
    )
    return table


def spec_summary(spec: Any) -> str:
    if not spec.is_moe:
        return (
            f"{spec.num_layers} layers; not an MoE (no routed experts) – planned as a dense model"
        )
    layers = spec.moe_layers
    span = f"{layers[0]}–{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return (
        f"{spec.num_layers} layers, {len(layers)} MoE (layers {span}); {spec.num_experts} experts, "
        f"top-{spec.top_k}; {count(spec.total_params)} total, {count(spec.active_params)} active"
        + _mixers(spec)
    )


def _mixers(spec: Any) -> str:
    """'; mixers: 36 linear_attention, 12 attention' when the layers mix kinds."""
    kinds = spec.mixer_counts
    if len(kinds) < 2:
        return ""
    return "; mixers: " + ", ".join(f"{n} {k}" for k, n in kinds.items())


def plan_components_table(plan: Any) -> Table:
    table = Table(title=f"peak memory by component ({plan.estimator})", title_justify="left")
    table.add_column("component")
    table.add_column("bytes", justify="right")
    for name, n in plan.components.items():
        table.add_row(name, gib(n))
    table.add_row("[bold]live tensors at peak[/]", f"[bold]{gib(plan.peak_bytes)}[/]")
    table.add_row("overhead (context, allocator, workspace)", gib(plan.overhead_bytes))
    table.add_row("[bold]required[/]", f"[bold]{gib(plan.required_bytes)}[/]")
    return table


def fits_table(plan: Any) -> Table:
    table = Table(title="fit per card", title_justify="left")
    for col in ("card", "usable", "headroom", "fits"):
        table.add_column(col, justify="left" if col == "card" else "right")
    for card_id, fit in plan.fits.items():
        mark = "[green]yes[/]" if fit.fits else "[red]no[/]"
        table.add_row(card_id, gib(fit.usable_bytes), gib(fit.headroom_bytes), mark)
    return table


def best_table(plan: Any) -> Table:
    """Per card, the best-quality config that fits: as is, the cheapest change, or none."""
    table = Table(title="best config per card (analytic re-plans)", title_justify="left")
    table.add_column("card")
    table.add_column("change", overflow="fold")
    for col in ("live", "required", "headroom", "cost"):
        table.add_column(col, justify="right")
    for card_id, rec in plan.best.items():
        if not rec.fits:
            change = "[red]nothing searched fits[/]"
        else:
            change = escape("; ".join(rec.changes)) if rec.changes else "[green]as is[/]"
        table.add_row(
            card_id, change, gib(rec.peak_bytes), gib(rec.required_bytes),
            gib(rec.headroom_bytes), f"{rec.cost:g}",
        )  # fmt: skip
    return table


def print_plan_notes(console: Console, plan: Any) -> None:
    """What the plan's figures assume or could not do (e.g. the analytic's trace fallback)."""
    for note in plan.notes:
        console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True)


def print_recommendations(console: Console, plan: Any) -> None:
    """The best table, each best change as `--set` flags, then the other fitting changes."""
    console.print(best_table(plan))
    for card_id, rec in plan.best.items():
        if rec.overrides and rec.fits:
            flags = " ".join(f"--set {o}" for o in rec.overrides)
            console.print(f"  {card_id}: {escape(flags)}", soft_wrap=True, highlight=False)
        elif not rec.fits:
            console.print(f"  {escape(rec.describe())}", highlight=False)
    best = {id(r) for r in plan.best.values()}
    others = [r for r in plan.recommendations if r.fits and id(r) not in best]
    if others:
        console.print("other changes that fit:")
    for rec in others:
        console.print(f"  • {escape(rec.describe())}", highlight=False)


def findings_table(findings: list[Any]) -> Table:
    table = Table(title="findings", title_justify="left")
    for col in ("rule", "severity", "what happens", "fix"):
        table.add_column(col, overflow="fold")
    for f in findings:
        style = SEVERITY_STYLE.get(f.severity, "")
        table.add_row(f.rule_id, f"[{style}]{f.severity}[/]", f.message, f.fix)
    return table


def print_findings(console: Console, findings: list[Any]) -> None:
    if findings:
        console.print(findings_table(findings))
    else:
        console.print("[green]no findings: no known trap in this configuration[/]")


def quickstart_table(summary: dict[str, Any]) -> Group:
    """Base vs candidate exact match per skill; the gate's verdicts and audit facts below."""
    table = Table(title="held-out exact match", title_justify="left")
    for col in ("skill", "base", "candidate", "Δ"):
        table.add_column(col, justify="left" if col == "skill" else "right")
    for name, s in summary["scores"].items():
        delta = s["candidate"] - s["base"]
        style = "green" if delta > 0.05 else "red" if delta < -0.05 else ""
        label = f"{name} (new)" if name == summary["new_skill"] else name
        delta_text = f"[{style}]{delta:+.2f}[/]" if style else f"{delta:+.2f}"
        table.add_row(label, f"{s['base']:.2f}", f"{s['candidate']:.2f}", delta_text)
    router = "changed" if summary["router_changed"] else "unchanged (frozen)"
    shift = summary.get("mean_routing_shift")
    shift_text = f" · routing shift {shift:.2%}" if shift is not None else ""
    lines = [
        f"{summary.get('method', 'sft')}{shift_text} · LoRA coverage {summary['coverage']:.0%} · "
        f"router {router} · {summary['steps']} steps · "
        f"peak {human_bytes(summary['peak_memory_bytes'])} · {summary['seconds']:.0f} s in all",
        f"gate: {_verdict_text(summary)} · adapter {escape(summary['adapter_dir'])}",
    ]
    if "overfit" in summary:
        lines.append(f"over-trained tiny pack: {_verdict_text(summary['overfit'])}")
    lines.append(f"report {escape(summary['report'])}")
    lines.append(f"ledger {escape(summary['ledger'])}")
    return Group(table, *lines)


def _verdict_text(run: dict[str, Any]) -> str:
    style = _VERDICT_STYLE[run["verdict"]]
    promoted = "promoted" if run["promoted"] else "not promoted"
    why = "" if run["verdict"] == "GO" else f" – {escape(run['verdict_reason'])}"
    return f"[{style}]{run['verdict']}[/] ({promoted}){why}"


def ladder_table(ladder: dict[str, Any]) -> Table:
    """Base vs candidate per rung, with the paired difference and its standard error."""
    table = Table(title=f"eval ladder · {escape(ladder['model'])}", title_justify="left")
    for col in ("rung", "kind", "role", "n", "base", "candidate", "Δ", "SE_Δ"):
        table.add_column(col, justify="left" if col in ("rung", "kind", "role") else "right")
    for r in ladder["rungs"]:
        table.add_row(
            r["name"], r["kind"], r["role"], str(r["n"]),
            f"{r['base']['score']:.3f} ± {r['base']['stderr']:.3f}",
            f"{r['candidate']['score']:.3f} ± {r['candidate']['stderr']:.3f}",
            f"{r['delta']:+.3f}", f"{r['se_delta']:.3f}",
        )  # fmt: skip
    table.caption = f"adapter {escape(ladder['adapter'])}"
    return table


_STATUS_STYLE = {"pass": "green", "fail": "red", "inconclusive": "yellow"}


def verdict_table(doc: dict[str, Any]) -> Table:
    """The gate's decision per rung and the verdict (title)."""
    style = _VERDICT_STYLE[doc["verdict"]]
    table = Table(title=f"gate: [{style}]{doc['verdict']}[/]", title_justify="left")
    for col in ("rung", "role", "status", "bound", "threshold", "reason"):
        table.add_column(col)
    for r in doc["rungs"]:
        bound = r["lower"] if r["status"] != "fail" else r["upper"]
        status = f"[{_STATUS_STYLE[r['status']]}]{r['status']}[/]"
        table.add_row(
            r["name"], r["role"], status, f"{bound:+.3f}", f"{r['threshold']:+.3f}",
            escape(r["reason"]),
        )  # fmt: skip
    table.caption = f"α {doc['alpha']} (Holm across {len(doc['rungs'])} rungs) · {doc['hash'][:12]}"
    return table


def examples_table(doc: dict[str, Any]) -> Table | None:
    """A few items of each failing rung as the models answered them (None: no rung failed)."""
    shown = [(r["name"], ex) for r in doc["rungs"] for ex in r.get("examples") or []]
    if not shown:
        return None
    table = Table(title="failing rungs, worst items", title_justify="left")
    for col in ("rung", "item", "prompt", "expected", "base output", "candidate output"):
        table.add_column(col, overflow="fold")
    for name, ex in shown:
        cells = (ex.get(k) for k in ("prompt", "expected", "base_output", "candidate_output"))
        table.add_row(name, str(ex.get("i")), *(escape(clip(c, 60)) for c in cells))
    return table


def device_components_table(report: Any) -> Table:
    """One rank's peak by component."""
    title = f"per-device peak on {report.placement}, {report.strategy} (analytic)"
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("bytes per device", justify="right")
    for name, n in report.components.items():
        table.add_row(name, gib(n))
    table.add_row(
        "[bold]live tensors per device[/]", f"[bold]{gib(sum(report.components.values()))}[/]"
    )
    return table


def _no_fewest(limit: int) -> str:
    """No count fits: none up to the limit tried, or – a stored base, not ep – not on one
    and not on several processes (the notes say why)."""
    return f"[red]none ≤ {limit}[/]" if limit > 1 else "[red]not on 1; several: ep only[/]"


def device_fits_table(report: Any) -> Table:
    """Per card: the rank's required bytes on N GPUs, its fit, and the fewest GPUs that fit."""
    table = Table(title=f"fit per card on {report.placement}", title_justify="left")
    for col in ("card", "usable", "required", "headroom", "fits", "fewest GPUs"):
        table.add_column(col, justify="left" if col == "card" else "right")
    for card_id, plan in report.plans.items():
        fit = plan.fit
        mark = "[green]yes[/]" if fit.fits else "[red]no[/]"
        if not report.launches:  # a stored base on several ranks outside ep: the notes say
            mark = "[red]refused[/]"
        fewest = report.fewest[card_id]
        table.add_row(
            card_id, gib(fit.usable_bytes), gib(fit.required_bytes), gib(fit.headroom_bytes),
            mark, str(fewest) if fewest else _no_fewest(report.fewest_limit),
        )  # fmt: skip
    return table
