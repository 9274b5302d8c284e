"""From the ranks' raw JSON to rows, ratios, derived figures, a markdown section and a chart.

Every ratio is taken between two rows of the same run, size and world size ("pair by pair"), never against a
number from another run: the machine is shared and its speed drifts (DESIGN.md "Numbers").
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import DTYPE_BYTES, MODEL_STATE_BYTES_PER_PARAM, SYSTEMS

MiB = 2**20
OURS = [key for key, s in SYSTEMS.items() if s.family == "ours"]
PEERS = ["ddp", "fsdp2", "deepspeed"]


@dataclass
class Row:
    size: str
    world: int
    system: str
    label: str
    status: str  # "ok", "invalid" (loss off the reference) or "failed" (did not run)
    n_params: int = 0
    step_time_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    first_step_s: float | None = None  # the first (warm-up) step of the slowest rank: compile time included
    peak_rss: int | None = None  # max over ranks of the kernel's peak RSS during the measured steps
    peak_rss_per_rank: list[int] = field(default_factory=list)
    peak_rss_sampled: int | None = None
    peak_anon_sampled: int | None = None  # anonymous RSS (no library code pages), sampled; max over ranks
    rss_after_init: int | None = None  # libraries imported, process group up, no model yet: the floor (max rank)
    model_states: dict | None = None  # bytes on the rank holding the most (params, master_params, grads, ...)
    model_states_total: int | None = None
    gathered_peak: int | None = None  # ours: params_gathered_peak
    comm_buffers_peak: int | None = None  # ours: comm_buffers_peak
    comm_step: dict | None = None  # rank 0, one steady step, profiler count (see _measure.py)
    comm_step_total: int | None = None
    comm_matches_engine: bool | None = None  # ours: profiler count == engine counters (all-gather, reduce-scatter)
    final_loss: float | None = None
    loss_max_rel_dev: float | None = None  # over every step, against the single-process reference
    note: str = ""


def _median_step_time(ranks: list[dict]) -> tuple[float, float, float] | None:
    per_step = list(zip(*(r["step_times"] for r in ranks)))  # step i of every rank (and round, when pooled)
    if not per_step:
        return None
    slowest = [max(times) for times in per_step]  # a step lasts until its slowest rank is done
    return statistics.median(slowest), min(slowest), max(slowest)


def build_row(size: str, world: int, system: str, ranks: list[dict], reference: list[float] | None,
              loss_rtol: float, note: str = "") -> Row:
    label = SYSTEMS[system].label
    if len(ranks) != world:
        return Row(size, world, system, label, "failed", note=note or f"{len(ranks)} of {world} ranks reported")
    first = ranks[0]
    row = Row(size, world, system, label, "ok", n_params=first["n_params"], note=note)
    timing = _median_step_time([r for r in ranks if r.get("step_times")])
    if timing:
        row.step_time_s, row.step_time_min_s, row.step_time_max_s = timing
    with_memory = [r for r in ranks if r.get("train_peak_rss") is not None]
    if with_memory:
        row.peak_rss_per_rank = [r["train_peak_rss"] for r in sorted(with_memory, key=lambda r: r["rank"])]
        row.peak_rss = max(row.peak_rss_per_rank)
        row.peak_rss_sampled = max(r["train_peak_rss_sampled"] for r in with_memory)
        row.peak_anon_sampled = max(r.get("train_peak_anon_sampled") or 0 for r in with_memory) or None
        states = max((r["model_states"] for r in with_memory), key=lambda s: sum(s.values()))
        row.model_states, row.model_states_total = states, sum(states.values())
        stats = [r["memory_extras"].get("memory_stats") for r in with_memory]
        if all(stats):
            row.gathered_peak = max(s["params_gathered_peak"] for s in stats)
            row.comm_buffers_peak = max(s["comm_buffers_peak"] for s in stats)
    row.rss_after_init = max(r["rss_after_init"] for r in ranks)
    firsts = [r["first_step_s"] for r in ranks if r.get("first_step_s") is not None]
    row.first_step_s = max(firsts) if firsts else None
    profiled = next((r for r in ranks if r["rank"] == 0 and r.get("comm_profile_step") is not None), None)
    if profiled:
        row.comm_step = profiled["comm_profile_step"]
        row.comm_step_total = sum(v["bytes"] for v in row.comm_step.values())
        engine = profiled.get("engine_comm_step")
        if engine:
            row.comm_matches_engine = all(
                row.comm_step.get(k, {"bytes": 0})["bytes"] == engine[k]["bytes"]
                for k in ("all_gather", "reduce_scatter"))
    losses = max(ranks, key=lambda r: len(r["losses"]))["losses"]
    row.final_loss = losses[-1] if losses else None
    runs = [r[key] for r in ranks for key in ("losses", "losses_memory_pass") if r.get(key)]
    runs += [losses for r in ranks for losses in r.get("losses_other_rounds", [])]
    if reference is None:
        row.status, row.note = "invalid", (row.note + " no single-process reference to compare with").strip()
    elif runs:
        if any(len(run) > len(reference) for run in runs):
            raise ValueError(f"{size}/{world}/{system}: the reference has {len(reference)} steps, fewer than the run")
        row.loss_max_rel_dev = max(abs(a - b) / abs(b) for run in runs for a, b in zip(run, reference))
        if not row.loss_max_rel_dev <= loss_rtol:  # NaN is invalid too
            row.status = "invalid"
            row.note = (row.note + f" loss off the reference by {row.loss_max_rel_dev:.1e} (relative), "
                        f"tolerance {loss_rtol:.0e}").strip()
    return row


# ---- ratios and derived figures -----------------------------------------------------------------------------------
def _ratio(a, b):
    return a / b if a is not None and b else None


def ratios(rows: list[Row]) -> list[dict]:
    """ours ÷ each peer, for step time and peak RSS, pair by pair within one (size, world)."""
    out = []
    for r in rows:
        if r.system not in OURS or r.status != "ok":
            continue
        for peer in PEERS:
            p = next((x for x in rows if (x.size, x.world, x.system) == (r.size, r.world, peer)), None)
            if p is None or p.status != "ok":
                continue
            out.append({"size": r.size, "world": r.world, "ours": r.system, "peer": peer,
                        "step_time": _ratio(r.step_time_s, p.step_time_s),
                        "peak_rss": _ratio(r.peak_rss, p.peak_rss)})
    return out


def derived(rows: list[Row], dtype: str) -> list[dict]:
    """comm ÷ 3Ψ, model states ÷ 16Ψ/N, gathered peak sequential ÷ coalesced, per (size, world)."""
    element = DTYPE_BYTES[dtype]
    out = []
    for r in rows:
        if r.status == "failed" or not r.n_params:
            continue
        psi_bytes = r.n_params * element
        entry = {"size": r.size, "world": r.world, "system": r.system}
        if r.comm_step is not None:
            ag = r.comm_step.get("all_gather", {}).get("bytes", 0)
            rs = r.comm_step.get("reduce_scatter", {}).get("bytes", 0)
            ar = r.comm_step.get("all_reduce", {}).get("bytes", 0)
            entry.update(comm_over_3psi=r.comm_step_total / (3 * psi_bytes), all_gather_over_2psi=ag / (2 * psi_bytes),
                         reduce_scatter_over_psi=rs / psi_bytes, all_reduce_over_psi=ar / psi_bytes)
        if r.model_states_total is not None and SYSTEMS[r.system].fully_sharded:
            entry["model_states_over_16psi_n"] = r.model_states_total / (
                MODEL_STATE_BYTES_PER_PARAM * r.n_params / r.world)
        if r.system == "zero3-seq":
            coalesced = next((x for x in rows if (x.size, x.world, x.system) == (r.size, r.world, "zero3")), None)
            if coalesced and coalesced.gathered_peak and r.gathered_peak is not None:
                entry["gathered_peak_seq_over_coalesced"] = r.gathered_peak / coalesced.gathered_peak
                entry["gathered_plus_buffers_seq_over_coalesced"] = (
                    (r.gathered_peak + r.comm_buffers_peak) / (coalesced.gathered_peak + coalesced.comm_buffers_peak))
        out.append(entry)
    return out


def goals(rows: list[Row], ratio_list: list[dict], derived_list: list[dict]) -> list[dict]:
    """Issue 12's goals for zero_engine ZeRO-3, each the worst case over the sizes and world sizes measured.

    ``rows`` is not needed (everything comes from the ratios and derived figures), so an earlier run's JSON can be
    scored the same way for a before/after table.
    """
    def worst(values, pick=max):
        values = [v for v in values if v is not None]
        return pick(values) if values else None

    def of(ours, peer, metric, size=None):
        return worst(r[metric] for r in ratio_list if r["ours"] == ours and r["peer"] == peer
                     and (size is None or r["size"] == size))

    def derived_of(system):
        return [d for d in derived_list if d["system"] == system]

    z3 = derived_of("zero3")
    fsdp = {(d["size"], d["world"]): d.get("comm_over_3psi") for d in derived_of("fsdp2")}
    comm_excess = worst(d["comm_over_3psi"] - fsdp[(d["size"], d["world"])] for d in z3
                        if d.get("comm_over_3psi") is not None and fsdp.get((d["size"], d["world"])) is not None)
    checks = [
        ("step time ≤ 1.05 × DDP's (100m)", of("zero3", "ddp", "step_time", "100m"), lambda v: v <= 1.05),
        ("step time ≤ 1.15 × DDP's (demo)", of("zero3", "ddp", "step_time", "demo"), lambda v: v <= 1.15),
        ("sequential step time ≤ 1.3 × DDP's (demo)", of("zero3-seq", "ddp", "step_time", "demo"), lambda v: v <= 1.3),
        ("step time < FSDP2's", of("zero3", "fsdp2", "step_time"), lambda v: v < 1),
        ("step time < DeepSpeed's", of("zero3", "deepspeed", "step_time"), lambda v: v < 1),
        ("peak RSS per rank ≤ 0.95 × FSDP2's", of("zero3", "fsdp2", "peak_rss"), lambda v: v <= 0.95),
        ("communication ÷ 3Ψ minus FSDP2's ≤ 0", comm_excess, lambda v: v <= 0),
        ("model states ÷ 16Ψ/N ≤ 1.02 (padding)", worst(d.get("model_states_over_16psi_n") for d in z3),
         lambda v: v <= 1.02),
        ("sequential ÷ coalesced gathered + buffers ≤ 0.6 (100m)",
         worst(d.get("gathered_plus_buffers_seq_over_coalesced") for d in derived_of("zero3-seq")
               if d["size"] == "100m"), lambda v: v <= 0.6),
    ]
    return [{"goal": name, "worst": value, "met": None if value is None else bool(test(value))}
            for name, value, test in checks]


# ---- markdown ----------------------------------------------------------------------------------------------------
def _mib(n) -> str:
    return "—" if n is None else f"{n / MiB:,.1f}"


def _x(v, digits=2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown(report: dict) -> str:
    rows = [Row(**r) for r in report["rows"]]
    ratio_list, derived_list, goal_list = report["ratios"], report["derived"], report["goals"]
    meta = report["meta"]
    lines = [
        f"Run on {meta['date']} (git {meta['git']}), {meta['machine']}; torch {meta['torch']}"
        + (f", DeepSpeed {meta['deepspeed']}" if meta.get("deepspeed") else "")
        + f"; wall time {meta['wall_s'] / 60:.1f} min.",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"Load average (1 min) on this shared machine: {meta['load_before']:.1f} before, {meta['load_after']:.1f} "
        "after; per-launch values are in the JSON. " + meta["method"],
        "",
    ]
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    if meta.get("notes"):
        lines.append("")
    for size in dict.fromkeys(r.size for r in rows):
        for world in dict.fromkeys(r.world for r in rows if r.size == size):
            group = [r for r in rows if (r.size, r.world) == (size, world)]
            lines += _group_tables(size, world, group, ratio_list, derived_list)
    seq = [d for d in derived_list if d.get("gathered_peak_seq_over_coalesced") is not None]
    if seq:
        lines += ["#### Gathered parameters, sequential ÷ coalesced (ours, ZeRO-3)", "",
                  "| size | world | params_gathered_peak | + comm_buffers_peak |", "|---|---|---|---|"]
        lines += [f"| {d['size']} | {d['world']} | {d['gathered_peak_seq_over_coalesced']:.3f} | "
                  f"{d['gathered_plus_buffers_seq_over_coalesced']:.3f} |" for d in seq]
        lines.append("")
    before = report.get("goals_before")
    lines += ["#### Goals (issue 12), zero_engine ZeRO-3, worst case over the sizes and world sizes of this run", ""]
    if before:
        lines += [f"Before: the same goals scored on {before['source']} (run of {before['date']}, git {before['git']},"
                  f" `{before['command']}`).", "",
                  "| goal | before | now | met |", "|---|---|---|---|"]
        was = {g["goal"]: g["worst"] for g in before["goals"]}
    else:
        lines += ["| goal | worst measured | met |", "|---|---|---|"]
    for g in goal_list:
        met = "—" if g["met"] is None else ("yes" if g["met"] else "**no**")
        old = f" {_x(was.get(g['goal']), 3)} |" if before else ""
        lines.append(f"| {g['goal']} |{old} {_x(g['worst'], 3)} | {met} |")
    if report.get("chart"):
        lines += ["", f"![step time and peak RSS per rank]({report['chart']})"]
    elif report.get("chart_note"):
        lines += ["", report["chart_note"]]
    return "\n".join(lines) + "\n"


def _group_tables(size: str, world: int, group: list[Row], ratio_list: list[dict], derived_list: list[dict]):
    psi = next((r.n_params for r in group if r.n_params), 0)
    lines = [f"#### {size} ({psi / 1e6:.1f}M parameters), world size {world}", "",
             "| system | status | step s, median (range) | ×DDP | ×FSDP2 | ×DS | peak RSS / rank MiB | ×DDP "
             "| ×FSDP2 | ×DS | peak anon. RSS MiB | floor MiB | loss dev. |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in group:
        rat = {x["peer"]: x for x in ratio_list if (x["size"], x["world"], x["ours"]) == (size, world, r.system)}
        step = "—" if r.step_time_s is None else (
            f"{r.step_time_s:.3f} ({r.step_time_min_s:.3f}–{r.step_time_max_s:.3f})")
        cells = [r.label, r.status if r.status == "ok" else f"**{r.status}**", step]
        cells += [_x(rat.get(p, {}).get("step_time")) for p in PEERS]
        cells += [_mib(r.peak_rss)] + [_x(rat.get(p, {}).get("peak_rss")) for p in PEERS]
        cells += [_mib(r.peak_anon_sampled), _mib(r.rss_after_init),
                  "—" if r.loss_max_rel_dev is None else f"{r.loss_max_rel_dev:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| system | params MiB | fp32 masters | grads | optimizer states | model states | ÷16Ψ/N "
              "| all-gather MiB (calls) | reduce-scatter MiB (calls) | all-reduce MiB (calls) | comm ÷3Ψ |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in group:
        der = next((d for d in derived_list if (d["size"], d["world"], d["system"]) == (size, world, r.system)), {})
        states = r.model_states or {}
        comm = r.comm_step or {}

        def c(kind):
            v = comm.get(kind)
            return "—" if not v else f"{v['bytes'] / MiB:,.1f} ({v['calls']})"
        cells = [r.label] + [_mib(states.get(k)) for k in ("params", "master_params", "grads", "optimizer_states")]
        cells += [_mib(r.model_states_total), _x(der.get("model_states_over_16psi_n"), 3),
                  c("all_gather"), c("reduce_scatter"), c("all_reduce"), _x(der.get("comm_over_3psi"), 3)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [r for r in group if r.note]
    lines += [""] + [f"- {r.label}: {r.note}" for r in notes] + ([""] if notes else [])
    mismatched = [r.label for r in group if r.comm_matches_engine is False]
    if mismatched:
        lines += [f"- profiler and engine counters disagree for: {', '.join(mismatched)}", ""]
    return lines


# ---- chart -------------------------------------------------------------------------------------------------------
def chart(rows: list[Row], path: Path) -> str | None:
    """Bars of step time, peak RSS and model states per rank, one row of panels per model size; None if matplotlib
    is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = list(dict.fromkeys(r.size for r in rows))
    worlds = sorted({r.world for r in rows})
    systems = [k for k in SYSTEMS if any(r.system == k for r in rows)]
    panels = (("step_time_s", "median step time (s)", 1.0), ("peak_rss", "peak RSS per rank (MiB)", 1 / MiB),
              ("model_states_total", "model states per rank (MiB)", 1 / MiB))
    fig, axes = plt.subplots(len(sizes), len(panels), figsize=(15, 3.8 * len(sizes)), squeeze=False)
    width = 0.8 / len(worlds)
    for i, size in enumerate(sizes):
        for j, (metric, title, scale) in enumerate(panels):
            ax = axes[i][j]
            for k, world in enumerate(worlds):
                values, hatches = [], []
                for system in systems:
                    r = next((x for x in rows if (x.size, x.world, x.system) == (size, world, system)), None)
                    v = getattr(r, metric) if r else None
                    values.append(0 if v is None else v * scale)
                    hatches.append("//" if r is None or r.status != "ok" else "")
                positions = [n + (k - (len(worlds) - 1) / 2) * width for n in range(len(systems))]
                bars = ax.bar(positions, values, width, label=f"world {world}")
                for bar, hatch in zip(bars, hatches):
                    bar.set_hatch(hatch)
            ax.set_xticks(range(len(systems)))
            ax.set_xticklabels([SYSTEMS[s].short for s in systems], fontsize=7)
            ax.set_title(f"{size}: {title}", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle("zero_engine vs torch DDP / FSDP2 / DeepSpeed ZeRO-3, fp32, CPU gloo (hatched: invalid or failed)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def rows_as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
