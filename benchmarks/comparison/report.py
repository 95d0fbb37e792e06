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


MODES_COLUMNS = (("odb_padded", "budget_utilization"), ("odb_padded_local", "budget_utilization"),
                 ("oracle_padded", "budget_utilization"), ("odb_tokens", "budget_utilization"),
                 ("odb_tokens_local", "budget_utilization"), ("deepspeed_seqlen", "budget_utilization"),
                 ("deepspeed_dataloader", "budget_utilization"), ("packing", "budget_utilization"),
                 ("oracle_tokens", "budget_utilization"), ("odb_padded", "moved_fraction"))


def modes_table(result: dict) -> list[str]:
    """ODB global and rank-local beside DeepSpeed, packing and the oracles, per workload and W (utilization)."""
    index = _index(result["quality"])
    lines = ["| workload | W | ODB global (padded) | ODB rank-local (padded) | oracle (padded) | ODB global (tokens) "
             "| ODB rank-local (tokens) | DeepSpeed (seqlen) | DeepSpeed (default) | packing | oracle (tokens) "
             "| moved (ODB global, padded) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in _workload_names(result):
        for world in result["worlds"]:
            cells = [_cell(index.get((name, world, m)), key) or "-" for m, key in MODES_COLUMNS]
            lines.append(f"| {name} | {world} | " + " | ".join(cells) + " |")
    return lines


def alignment_table(result: dict) -> list[str]:
    """Per round and rank, both planning modes: metadata bytes, moved samples and bytes, latency."""
    lines = ["| W | source | planning | rounds | steps/round | meta B sent/round | meta B received/round | meta ms/round "
             "| moved fraction | moved samples/round | moved B received/round | move ms/round | meta B received/epoch "
             "| ref (buffer 8) B received/epoch | ref (buffer 512) B received/epoch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["alignment"]["rows"]:
        ref = row["reference_release"]
        refs = [ref[k]["bytes_received_per_round"] * ref[k]["rounds_per_epoch"] for k in ("buffer8", "buffer512")]
        local = row["planning"] == "local"
        moved = "-" if local else f"{row['moved_bytes_per_round']:,.0f}" + (" (est.)" if row.get("moved_bytes_estimated")
                                                                            else "")
        lines.append(
            f"| {row['world_size']} | {row['source']} | {row['planning']} | {row['rounds']} | "
            f"{row['steps'] / row['rounds']:.1f} | {row['bytes_sent_per_round']:,.0f} | "
            f"{row['bytes_received_per_round']:,.0f} | {_ms(row['latency_ms_per_round'])} | "
            f"{row['moved_fraction']:.2f} | {row['moved_samples_per_round']:.1f} | {moved} | "
            f"{'-' if local else _ms(row['move_ms_per_round'])} | {row['bytes_received_per_round'] * row['rounds']:,.0f} | "
            f"{refs[0]:,} | {refs[1]:,} |")
    return lines


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def exchange_tables(result: dict) -> list[str]:
    """The collective probe, the moved-bytes estimate check and the W = 256 extrapolation (alignment part)."""
    a = result["alignment"]
    lines = ["Measured Gloo cost on this machine (loopback, W processes on 2 shared cores; median of "
             "the probe's repeats), fitted to t = (W - 1)(alpha + S / B):", "",
             "| W | collective | alpha (us) | B (GB/s) |", "|---|---|---|---|"]
    for fit in a["probe_fits"]:
        bandwidth = "" if fit["bandwidth_GBps"] is None else f"{fit['bandwidth_GBps']:.2f}"
        lines.append(f"| {fit['world_size']} | {fit['collective']} | {fit['alpha_us']:.0f} | {bandwidth} |")
    pay = a["payload"]
    lines += ["", f"Moved-sample bytes (send): {pay['per_token']:.2f} B per token + {pay['per_sample']:.0f} B per "
              "sample (pickled `input_ids` + `labels`, int64); estimate against the gloo runs:", "",
              "| W | measured B/round | estimated B/round |", "|---|---|---|"]
    for c in a["payload_checks"]:
        lines.append(f"| {c['world_size']} | {c['measured_bytes_per_round']:,.0f} | {c['estimated_bytes_per_round']:,.0f} |")
    lines += ["", "The same model with this machine's fitted alpha and B against the measured gloo latency (the "
              "measured figures also include waiting for the slowest rank's planning):", "",
              "| W | planning | metadata ms/round: model / measured | moves ms/round: model / measured |", "|---|---|---|---|"]
    for c in a["model_checks"]:
        moves = "-" if c["planning"] == "local" else \
            f"{c['model_move_ms_per_round']:.1f} / {c['measured_move_ms_per_round']:.1f}"
        lines.append(f"| {c['world_size']} | {c['planning']} | {c['model_metadata_ms_per_round']:.1f} / "
                     f"{c['measured_metadata_ms_per_round']:.1f} | {moves} |")
    plan = [r for r in a["profiles_256"] if "plan_ms_first_round" in r]
    lines += ["", "Extrapolated to W = 256 (a model, not a measurement)"
              + "".join(f"; measured beside it: the pooled plan of {r['source']} takes {r['plan_ms_first_round']:.0f} ms "
                        "of CPU per round on every rank (this machine)" for r in plan) + ":", "",
              "| workload | planning | network model (assumed) | steps/round | metadata ms/round | moves ms/round "
              "| metadata ms/step | moves ms/step |", "|---|---|---|---|---|---|---|---|"]
    for e in a["extrapolated"]:
        lines.append(f"| {e['workload']} | {e['planning']} | {e['network']} | {e['steps_per_round']:.1f} | "
                     f"{e['metadata_ms_per_round']:.1f} | {e['move_ms_per_round']:.1f} | "
                     f"{e['metadata_ms_per_step']:.2f} | {e['move_ms_per_step']:.2f} |")
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
        parts += ["", "## Exchange cost per round", "", *alignment_table(result), "", *exchange_tables(result)]
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
    parts += ["", "## ODB global and rank-local against DeepSpeed, packing and the oracle (budget utilization; the "
                  "oracle dealt to W ranks)", "", *modes_table(result)]
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
    rows = result["alignment"]["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for planning, style in (("global", "o-"), ("local", "s-")):
        mine = sorted((r for r in rows if r["planning"] == planning and r["source"] != "gloo"),
                      key=lambda r: r["world_size"])
        gloo = [r for r in rows if r["planning"] == planning and r["source"] == "gloo"]
        ax.plot([r["world_size"] for r in mine], [r["bytes_received_per_round"] * r["rounds"] for r in mine], style,
                label=f"ODB {planning}: metadata (virtual W <= 16, simulated above)")
        ax.plot([r["world_size"] for r in gloo], [r["bytes_received_per_round"] * r["rounds"] for r in gloo], "k^")
        if planning == "global":
            ax.plot([r["world_size"] for r in mine], [r["moved_bytes_per_round"] * r["rounds"] for r in mine], "o:",
                    label="ODB global: moved samples (send; estimated above W = 16)")
    local = sorted((r for r in rows if r["planning"] == "local" and r["source"] != "gloo"), key=lambda r: r["world_size"])
    for key, label in (("buffer8", "reference, default buffer 8"), ("buffer512", "reference, buffer 512")):
        ax.plot([r["world_size"] for r in local], [r["reference_release"][key]["bytes_received_per_round"]
                                                   * r["reference_release"][key]["rounds_per_epoch"] for r in local],
                "x--", label=label)
    ax.plot([], [], "k^", label="measured over real Gloo")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("W")
    ax.set_ylabel("bytes received per rank per epoch")
    ax.set_title("Exchange per epoch (512 samples per rank)", fontsize=10)
    ax.legend(fontsize=7)
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
