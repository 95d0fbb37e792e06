"""Markdown tables and PNG figures from compare.py's JSON (no measuring here)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.comparison import peers

SHOWN_IN_PLOTS = ("standard", "group_by_length", "reference_default", "reference_buffer512", "deepspeed_seqlen",
                  "packing", "oracle_padded", "odb_padded_local", "odb_padded", "odb_tokens")
ODB_GLOBAL = ("odb_padded", "odb_tokens", "odb_attention")  # the default config: global planning at W > 1


def _cell(row: dict | None, key: str, fmt: str = "{:.3f}") -> str:
    if row is None:
        return ""
    if "unavailable" in row:
        return "n/a"
    value = row.get(key)
    return "" if value is None else fmt.format(value)


def _index(rows: list[dict]) -> dict[tuple[str, int, str], dict]:
    return {(r["workload"], r["world_size"], r["method"]): r for r in rows}


def _workload_names(result: dict) -> list[str]:
    return [w["name"] for w in result["workloads"]]


def workloads_table(result: dict) -> list[str]:
    lines = ["| workload | source | samples | mean | CV | p50 | p99 | max | Standard B |", "|---|---|---|---|---|---|---|---|---|"]
    for w in result["workloads"]:
        lines.append(f"| {w['name']} | {w['source']} | {w['samples']} | {w['mean']:.0f} | {w['cv']:.2f} | "
                     f"{w['p50']} | {w['p99']} | {w['max']} | {w['standard_batch']} |")
    return lines


def method_table(result: dict, world: int, key: str, fmt: str = "{:.3f}", methods=None,
                 bound_row: bool = False) -> list[str]:
    index, names = _index(result["quality"]), _workload_names(result)
    lines = ["| method | cost | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for method in peers.METHODS:
        if methods is not None and method.name not in methods:
            continue
        cells = [_cell(index.get((n, world, method.name)), key, fmt) for n in names]
        lines.append(f"| {method.label} | {method.cost} | " + " | ".join(cells) + " |")
    if bound_row:
        cells = [_cell(index.get((n, world, "odb_padded")), "rank_local_bound") for n in names]
        lines.append("| *rank-local bound (padded)* | padded | " + " | ".join(cells) + " |")
    return lines


def unavailable_notes(result: dict) -> list[str]:
    seen = {}
    for r in result["quality"]:
        if "unavailable" in r:
            seen.setdefault(r["method"], r["unavailable"])
    return [f"- {peers_label(m)}: {reason}" for m, reason in seen.items()] + [f"- {s}" for s in result["skipped"]]


def peers_label(name: str) -> str:
    return next(m.label for m in peers.METHODS if m.name == name)


def targets_table(result: dict) -> list[str]:
    """ODB (padded), global and rank-local, against the oracle, the rank-local bound and the reference release."""
    index, names = _index(result["quality"]), _workload_names(result)
    lines = ["| workload | W | global / oracle | rank-local / oracle | moved (global) | rank-local / rank-local bound "
             "| global / ref default | global / ref buffer 512 |", "|---|---|---|---|---|---|---|---|"]
    for name in names:
        for world in result["worlds"]:
            odb, local = index.get((name, world, "odb_padded")), index.get((name, world, "odb_padded_local"))
            if odb is None or local is None:
                continue
            refs = []
            for ref in ("reference_default", "reference_buffer512"):
                r = index.get((name, world, ref))
                refs.append("n/a" if r is None or "unavailable" in r
                            else f"{odb['budget_utilization'] / r['budget_utilization']:.2f}x")
            lines.append(f"| {name} | {world} | {odb['vs_oracle']:.3f} | {local['vs_oracle']:.3f} | "
                         f"{_cell(odb, 'moved_fraction', '{:.2f}') or '-'} | {local['vs_rank_bound']:.3f} | "
                         + " | ".join(refs) + " |")
    return lines


def alignment_table(result: dict) -> list[str]:
    lines = ["| W | source | rounds | ODB B sent/round | ODB B received/round | ODB ms/round | "
             "ODB B received/epoch | ref (buffer 8) B received/epoch | ref (buffer 512) B received/epoch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["alignment"]:
        ref = row["reference_release"]
        latency = "" if row["latency_ms_per_round"] is None else f"{row['latency_ms_per_round']:.2f}"
        epoch = row["bytes_received_per_round"] * row["rounds"]
        refs = [ref[k]["bytes_received_per_round"] * ref[k]["rounds_per_epoch"] for k in ("buffer8", "buffer512")]
        lines.append(f"| {row['world_size']} | {row['source']} | {row['rounds']} | {row['bytes_sent_per_round']:.0f} | "
                     f"{row['bytes_received_per_round']:.0f} | {latency} | {epoch:,.0f} | {refs[0]:,} | {refs[1]:,} |")
    return lines


def training_table(result: dict) -> list[str]:
    training = result["training"]
    setup = training["setup"]
    lines = [f"Setup: W={setup['world_size']} (torchrun, gloo, CPU), {setup['samples']} samples, lognormal CV 1.0 "
             f"(mean {setup['mean']:.0f}, <= {setup['hi']}), L_max {setup['token_budget']}, Standard B "
             f"{setup['standard_batch']}, tiny Llama (hidden {setup['hidden']}, {setup['layers']} layers, vocab "
             f"{setup['vocab']}, SDPA), {setup['repeats']} repeats.", "",
             "| method | samples/s | real tokens/s | optimizer steps | vs Standard (median, min-max) |",
             "|---|---|---|---|---|"]
    for method, e in training["summary"].items():
        ratio = (f"{e['vs_standard']:.2f}x ({e['vs_standard_range'][0]:.2f}-{e['vs_standard_range'][1]:.2f})"
                 if "vs_standard" in e else "1.00x")
        lines.append(f"| {method} | {e['samples_per_s']:.1f} | {e['tokens_per_s']:,.0f} | {e['optimizer_steps']} | "
                     f"{ratio} |")
    return lines


def markdown(result: dict) -> str:
    parts = [f"# odb comparison (`{result['command']}`)"]
    if result["quality"]:
        parts += quality_sections(result)
    if result.get("alignment"):
        parts += ["", "## Alignment cost per round", "", *alignment_table(result)]
    if result.get("training"):
        parts += ["", "## CPU training throughput", "", *training_table(result)]
    return "\n".join(parts) + "\n"


def quality_sections(result: dict) -> list[str]:
    parts = ["", "## Workloads", "", *workloads_table(result)]
    for world in result["worlds"]:
        parts += ["", f"## Budget utilization, W = {world}", "",
                  *method_table(result, world, "budget_utilization", bound_row=world > 1)]
    first = result["worlds"][0]
    parts += ["", f"## Padding ratio, W = {first}", "", *method_table(result, first, "padding_ratio", methods={
        m.name for m in peers.METHODS if m.cost != "tokens"})]
    parts += ["", f"## Steps per epoch, W = {first}", "", *method_table(result, first, "steps", "{:,}")]
    for world in result["worlds"][1:]:
        parts += ["", f"## Mean per-step rank imbalance (CV of rank costs), W = {world}", "",
                  *method_table(result, world, "mean_rank_imbalance")]
    for world in result["worlds"][1:]:
        parts += ["", f"## Samples moved to another rank (ODB global), fraction, W = {world}", "",
                  *method_table(result, world, "moved_fraction", methods=set(ODB_GLOBAL))]
    parts += ["", f"## Samples dropped, W = {result['worlds'][-1]}", "",
              *method_table(result, result["worlds"][-1], "dropped", "{:,}")]
    parts += ["", "## Targets: ODB (padded), global and rank-local, against the oracle, the rank-local bound and "
                  "the reference release", "",
              *targets_table(result)]
    notes = unavailable_notes(result)
    if notes:
        parts += ["", "## Not run", "", *notes]
    return parts


# -- figures ------------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_utilization(result: dict, world: int, path: Path) -> None:
    plt = _plt()
    index, names = _index(result["quality"]), _workload_names(result)
    shown = [m for m in SHOWN_IN_PLOTS if any((n, world, m) in index for n in names)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(shown)
    for k, method in enumerate(shown):
        values = [index.get((n, world, method), {}).get("budget_utilization", 0.0) for n in names]
        ax.bar([i + k * width for i in range(len(names))], values, width, label=peers_label(method))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], [n.replace(" (", "\n(") for n in names],
                  fontsize=8)
    ax.set_ylabel("budget utilization")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Budget utilization by method and workload, W = {world} (L_max {result['token_budget']})")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_vs_world(result: dict, workload: str, key: str, path: Path, ylabel: str) -> None:
    plt = _plt()
    index = _index(result["quality"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method in SHOWN_IN_PLOTS:
        points = [(w, index[(workload, w, method)][key]) for w in result["worlds"]
                  if (workload, w, method) in index and "unavailable" not in index[(workload, w, method)]]
        if points:
            ax.plot(*zip(*points), marker="o", label=peers_label(method))
    if key == "budget_utilization":
        bound = [(w, index[(workload, w, "odb_padded")]["rank_local_bound"]) for w in result["worlds"]
                 if (workload, w, "odb_padded") in index]
        ax.plot(*zip(*bound), "k--", label="rank-local bound (padded)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("W (simulated ranks)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} against W: {workload}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_alignment(result: dict, path: Path) -> None:
    plt = _plt()
    rows = sorted((r for r in result["alignment"] if r["source"] != "gloo"), key=lambda r: r["world_size"])
    gloo = [r for r in result["alignment"] if r["source"] == "gloo"]
    worlds = [r["world_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(worlds, [r["bytes_received_per_round"] * r["rounds"] for r in rows], "o-",
            label="ODB (virtual ranks W <= 16, simulated above)")
    ax.plot([r["world_size"] for r in gloo], [r["bytes_received_per_round"] * r["rounds"] for r in gloo], "k^",
            label="ODB over real Gloo")
    for key, label in (("buffer8", "reference, default buffer 8"), ("buffer512", "reference, buffer 512")):
        ax.plot(worlds, [r["reference_release"][key]["bytes_received_per_round"]
                         * r["reference_release"][key]["rounds_per_epoch"] for r in rows], "s--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("W")
    ax.set_ylabel("metadata bytes received per rank per epoch")
    ax.set_title("Alignment traffic per epoch (512 samples per rank)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(result: dict, path: Path) -> None:
    plt = _plt()
    summary = result["training"]["summary"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    methods = list(summary)
    ax.bar(methods, [summary[m]["samples_per_s"] for m in methods], color="tab:blue")
    for i, m in enumerate(methods):
        ratio = summary[m].get("vs_standard", 1.0)
        ax.text(i, summary[m]["samples_per_s"], f"{ratio:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("samples/s (median)")
    ax.set_title("CPU training throughput, W = 2, same L_max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(result: dict, out: Path) -> list[str]:
    made = []
    for world in result["worlds"] if result["quality"] else []:
        plot_utilization(result, world, out / f"utilization_w{world}.png")
        made.append(f"utilization_w{world}.png")
    names = _workload_names(result)
    focus = "lognormal CV 1.0" if "lognormal CV 1.0" in names else (names[0] if names else "")
    if result["quality"] and len(result["worlds"]) > 1:
        plot_vs_world(result, focus, "budget_utilization", out / "utilization_vs_w.png", "budget utilization")
        plot_vs_world(result, focus, "mean_rank_imbalance", out / "imbalance_vs_w.png", "mean rank imbalance")
        made += ["utilization_vs_w.png", "imbalance_vs_w.png"]
    if result.get("alignment"):
        plot_alignment(result, out / "alignment_bytes.png")
        made.append("alignment_bytes.png")
    if result.get("training"):
        plot_training(result, out / "training_cpu.png")
        made.append("training_cpu.png")
    return made
