"""Render the results tables of the README, bench/README.md and docs/results.md from the result JSONs.

    python bench/render.py            # rewrite the tables between their markers (docs/results.md whole) and
                                      # draw the learning-curve pictures the results folders lack
    python bench/render.py --check    # exit 1 if a file's tables differ from what the results give

Reads every ``bench/results/*/*.json`` of the harness's schema (``run.py``), leaving out CPU checks. Where
several folders hold the same experiment, shape and kind, the newest folder's result is the one shown: folders
are ordered by date, then by when their newest result was written (:func:`folder_order`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from experiments import EXPERIMENTS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
README = ROOT / "README.md"
BENCH_README = HERE / "README.md"
DOCS = ROOT / "docs" / "results.md"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"


def shape_size(shape: str) -> float:
    """Billions of parameters of a shape's name (``7B``, ``1.5B-sharp``), 0 for ``tiny``: the tables' order."""
    size = shape.split("-")[0].removesuffix("B")
    return float(size) if size.replace(".", "", 1).isdigit() else 0.0


def load_results(results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every result of the schema under ``results``, oldest folder first (:func:`folder_order`), each with its
    ``folder``'s name."""
    loaded = []
    for path in sorted(results.glob("*/*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and result.get("schema") and not result["config"].get("check"):
            loaded.append({**result, "folder": path.parent.name})
    order = folder_order(loaded)
    return sorted(loaded, key=lambda result: order[result["folder"]])  # stable: by file name within a folder


def folder_order(results: list[dict[str, Any]]) -> dict[str, tuple[str, str, str]]:
    """Each results folder's sort key: its date (the name's first 10 characters), the time its newest result was
    written (``written_utc``; results written before it was recorded have none, and sort first), its name. The
    name alone would order one day's folders by their commits' hashes."""
    written: dict[str, str] = {}
    for result in results:
        folder = result["folder"]
        written[folder] = max(written.get(folder, ""), result.get("written_utc") or "")
    return {folder: (folder[:10], time, folder) for folder, time in written.items()}


def newest(results: list[dict], **match: Any) -> dict | None:
    """The newest finished result whose fields equal ``match``."""
    found = [r for r in results if not r["failed"] and all(r.get(k) == v for k, v in match.items())]
    return found[-1] if found else None


def device_name(result: dict) -> str:
    """The result's GPU as a reader names it (``H200``), or ``CPU``."""
    gpus = result["machine"]["gpus"]
    return gpus[0].split(",")[0].removeprefix("NVIDIA ").split()[0] if gpus else "CPU"


def link(result: dict, prefix: str) -> str:
    return f"[`{result['folder']}`]({prefix}{result['folder']}/)"


def smallest_card(results: list[dict], shape: str, kind: str) -> dict | None:
    """The memory frontier's result of ``kind`` at ``shape`` on the smallest card it ran on, in the newest folder
    that searched it."""
    tried = [r for r in results if r["experiment"] == "memory-frontier" and r["shape"] == shape and r["kind"] == kind]
    if not tried:
        return None
    folder = tried[-1]["folder"]
    ran = [r for r in tried if r["folder"] == folder and not r["failed"]]
    return min(ran, key=lambda r: r["config"]["card_gib"]) if ran else None


def headline_table(results: list[dict], prefix: str) -> str:
    """The README's three rows: the 1.5B step and peak memory against stock TRL, the smallest card for 7B."""
    lines = ["| measured | colocate_grpo (the user's config) | stock TRL | results |", "|---|---|---|---|"]
    # The newest folder that ran both side by side: a folder of ours alone (a change measured against the library
    # before it) has no ratio to show.
    side_by_side = [
        (ours, stock)
        for ours in results
        if ours["experiment"] == "step-vs-trl"
        and ours["shape"] == "1.5B"
        and ours["kind"] == "user"
        and not ours["failed"]
        for stock in [newest(results, experiment="step-vs-trl", shape="1.5B", kind="stock", folder=ours["folder"])]
        if stock is not None
    ]
    if side_by_side:
        ours, stock = side_by_side[-1]
        step, stock_step = ours["summary"]["step_s"], stock["summary"]["step_s"]
        peak, stock_peak = ours["memory"]["peak_device_gib"], stock["memory"]["peak_device_gib"]
        where = f"1.5B, {device_name(ours)}"
        lines.append(
            f"| step time, {where} | {step:.2f} s ({step / stock_step:.2f}x) | {stock_step:.2f} s "
            f"| {link(ours, prefix)} |"
        )
        lines.append(
            f"| peak device memory, {where} | {peak:.1f} GiB ({peak / stock_peak:.2f}x) | {stock_peak:.1f} GiB "
            f"| {link(ours, prefix)} |"
        )
    ours_card, stock_card = smallest_card(results, "7B", "user"), smallest_card(results, "7B", "stock")
    if ours_card and stock_card:
        lines.append(
            f"| smallest card for a 7B model (simulated on an {device_name(ours_card)}) | "
            f"{ours_card['config']['card_gib']:g} GiB ({ours_card['memory']['card_used_gib']:.1f} used) | "
            f"{stock_card['config']['card_gib']:g} GiB ({stock_card['memory']['card_used_gib']:.1f} used) | "
            f"{link(ours_card, prefix)} |"
        )
    return "\n".join(lines)


def unsloth_table(results: list[dict], prefix: str) -> str:
    """Each Unsloth run against the user's config of the same shape and card in the same results folder."""
    lines = [
        "| measured | colocate_grpo (the user's config) | Unsloth | results |",
        "|---|---|---|---|",
    ]
    for theirs in results:
        if not (theirs["kind"] or "").startswith("unsloth") or theirs["failed"]:
            continue
        kind = theirs["kind"].replace("unsloth", "user")
        card = theirs["config"]["card_gib"]
        ours = next(
            (
                r
                for r in results
                if r["kind"] == kind
                and r["shape"] == theirs["shape"]
                and r["folder"] == theirs["folder"]
                and r["config"]["card_gib"] == card
                and not r["failed"]
            ),
            None,
        )
        if ours is None:
            continue
        where = f"{theirs['shape']}{', 4-bit base' if kind.endswith('4bit') else ''}, {device_name(ours)}"
        if card:
            where += f", a simulated {card:g} GiB card"
        step, their_step = ours["summary"]["step_s"], theirs["summary"]["step_s"]
        generate, their_generate = ours["summary"]["phase_s"]["generate"], theirs["summary"]["phase_s"]["generate"]
        lines.append(
            f"| step time, {where} | {step:.2f} s ({step / their_step:.2f}x; generation {generate:.2f} s) "
            f"| {their_step:.2f} s (generation {their_generate:.2f} s) | {link(ours, prefix)} |"
        )
    return "\n".join(lines) if len(lines) > 2 else "None measured."


def ratio(value: float | None, base: float | None) -> str:
    return f" ({value / base:.2f}x)" if value is not None and base else ""


def training_table(results: list[dict], prefix: str) -> str:
    """Every training result but the frontier's, by folder and experiment, each against stock TRL's beside it."""
    lines = [
        "| results | experiment | shape | kind | steps | step s | generate s | sync s | peak device GiB "
        "| mismatch | served == trained |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["kind"] is None or EXPERIMENTS[r["experiment"]].runner == "frontier" or r["failed"]:
            continue
        stock = newest(results, experiment=r["experiment"], shape=r["shape"], kind="stock", folder=r["folder"])
        stock = None if stock is r else stock
        summary, phases = r["summary"], r["summary"]["phase_s"]
        peak = r["memory"]["peak_device_gib"]
        mismatch = r["mismatch"]["mean"]
        lines.append(
            f"| {link(r, prefix)} | {r['experiment']} | {r['shape']} | {r['kind']} | {summary['steps_run']} "
            f"| {summary['step_s']:.2f}{ratio(summary['step_s'], stock and stock['summary']['step_s'])} "
            f"| {phases['generate']:.2f} | {1e3 * phases['sync']:.0f} ms "
            f"| {peak:.1f}{ratio(peak, stock and stock['memory']['peak_device_gib'])} "
            f"| {'' if mismatch is None else f'{mismatch:.5f}'}{ratio(mismatch, stock and stock['mismatch']['mean'])} "
            f"| {'' if r['served_equals_trained'] is None else r['served_equals_trained']} |"
        )
    return "\n".join(lines)


def long_run_table(results: list[dict], prefix: str) -> str:
    """The mismatch by pass over the prompts in the long runs: the last pass against the first."""
    lines = [
        "| results | shape | kind | steps | mismatch, first pass | last pass | last / first |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        passes = r["mismatch"].get("by_pass") or []
        if r["experiment"] != "mismatch-long" or r["failed"] or len(passes) < 2:
            continue
        lines.append(
            f"| {link(r, prefix)} | {r['shape']} | {r['kind']} | {r['summary']['steps_run']} | {passes[0]:.5f} "
            f"| {passes[-1]:.5f} | {passes[-1] / passes[0]:.3g}x |"
        )
    return "\n".join(lines)


# The curves a learning curve is read against: the user's config and its run-to-run spread.
BASELINE_CURVES = ("user", "user-seed1")


def learning_curves(results: list[dict], results_dir: Path = RESULTS) -> list[Path]:
    """Draw ``learning-curve.png`` in each folder holding learning-curve results that has none: the training
    reward per step of each kind, and its moving mean over 20 steps; a run stopped before its last step is drawn as
    far as it went, and labelled so. A folder without the user's config's curve (a kind run on its own) draws
    the ``BASELINE_CURVES`` of the newest other folder that has them, at the same shape, labelled with that
    folder. Returns the pictures drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    curves = [r for r in results if r["experiment"] == "learning-curve" and any("reward" in s for s in r["steps"])]
    for folder in sorted({r["folder"] for r in curves}):
        picture = results_dir / folder / "learning-curve.png"
        if picture.exists():
            continue
        figure, axes = plt.subplots(figsize=(8, 4.5))
        for r in [*baseline_curves(curves, folder), *(r for r in curves if r["folder"] == folder)]:
            rewards = [s["reward"] for s in r["steps"] if "reward" in s]
            window = 20
            recent = [rewards[max(0, i - window + 1) : i + 1] for i in range(len(rewards))]
            means = [sum(values) / len(values) for values in recent]
            stopped = f", stopped at step {len(rewards)}" if r["failed"] else ""
            elsewhere = f", {r['folder']}" if r["folder"] != folder else ""
            (line,) = axes.plot(means, label=f"{r['kind']} (mean of {window} steps{stopped}{elsewhere})")
            axes.plot(rewards, color=line.get_color(), alpha=0.2, linewidth=0.8)
        axes.set_xlabel("optimizer step")
        axes.set_ylabel("training reward")
        axes.set_title(f"Training reward, {folder}")
        axes.legend()
        figure.tight_layout()
        figure.savefig(picture, dpi=120)
        plt.close(figure)
        drawn.append(picture)
    return drawn


def baseline_curves(curves: list[dict], folder: str) -> list[dict]:
    """The ``BASELINE_CURVES`` runs to draw beside ``folder``'s curves: none where the folder has the user's
    config's; else those of the newest other folder with them at the folder's shape (the last in
    :func:`load_results`'s order)."""
    own = [r for r in curves if r["folder"] == folder]
    if any(r["kind"] == BASELINE_CURVES[0] for r in own):
        return []
    shapes = {r["shape"] for r in own}
    others = [r["folder"] for r in curves if r["kind"] == BASELINE_CURVES[0] and r["shape"] in shapes]
    if not others:
        return []
    return [r for r in curves if r["folder"] == others[-1] and r["kind"] in BASELINE_CURVES and r["shape"] in shapes]


def frontier_table(results: list[dict], prefix: str) -> str:
    """The smallest simulated card each kind ran on, by shape, from the newest folder that searched it."""
    lines = [
        "| shape | kind | smallest card that runs it (GiB) | used of it (GiB) | plan's peak (GiB) | step s | results |",
        "|---|---|---|---|---|---|---|",
    ]
    frontier = [r for r in results if r["experiment"] == "memory-frontier"]
    for shape in sorted(dict.fromkeys(r["shape"] for r in frontier), key=shape_size):
        for kind in dict.fromkeys(r["kind"] for r in frontier if r["shape"] == shape):
            best = smallest_card(results, shape, kind)
            if best is None:
                folder = [r for r in frontier if r["shape"] == shape and r["kind"] == kind][-1]["folder"]
                cards = sorted(
                    r["config"]["card_gib"]
                    for r in frontier
                    if r["shape"] == shape and r["kind"] == kind and r["folder"] == folder
                )
                lines.append(f"| {shape} | {kind} | none of {', '.join(f'{c:g}' for c in cards)} | | | | |")
                continue
            plan = best["metrics"].get("plan")
            planned = ""
            if plan:
                host = plan["merge_record_host_gib"]
                planned = f"{plan['generation_peak_gib']:.1f}" + (f" (+{host:.1f} in host memory)" if host else "")
            lines.append(
                f"| {shape} | {kind} | {best['config']['card_gib']:g} | {best['memory']['card_used_gib']:.1f} "
                f"| {planned} | {best['summary']['step_s']:.2f} | {link(best, prefix)} |"
            )
    return "\n".join(lines)


def kernel_tables(results: list[dict], prefix: str) -> str:
    """Each microbenchmark's rows, one table per result."""
    parts = []
    for r in results:
        rows = r["metrics"].get("rows") if r["kind"] is None and not r["failed"] else None
        if not rows:
            continue
        keys = list(dict.fromkeys(k for row in rows for k in row))
        lines = [f"`{r['experiment']}` at {r['shape']}, {device_name(r)}, {link(r, prefix)}:", ""]
        lines += ["| " + " | ".join(keys) + " |", "|---" * len(keys) + "|"]
        for row in rows:
            lines.append("| " + " | ".join(cell(row.get(k)) for k in keys) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else "None kept."


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def docs_page(results: list[dict]) -> str:
    prefix = "../bench/results/"
    return "\n".join(
        [
            "# Benchmark results",
            "",
            "Rendered by `python bench/render.py` from the result JSONs in `bench/results/` (do not edit by hand);",
            "`bench/README.md` says how each experiment runs, `bench/FINDINGS.md` what the earlier probes found.",
            "Ratios in brackets are against stock TRL's run of the same experiment, shape and results folder.",
            "",
            "## The headline",
            "",
            headline_table(results, prefix),
            "",
            "## Against Unsloth",
            "",
            "Unsloth as its GRPO notebooks run it (fast inference, standby, its gradient checkpointing) and the",
            "user's plain config, one after the other in the same results folder, same shape, batch and reward.",
            "",
            unsloth_table(results, prefix),
            "",
            "## Training runs",
            "",
            "Medians over the steps after the second; peak device memory is the whole device's used memory after",
            "any phase; mismatch is TRL's mean |logp_vLLM - logp_trainer| over the run; served == trained is the",
            "worst of colocate_grpo's bitwise checks of the engine's weights (blank: stock TRL, which does not check).",
            "",
            training_table(results, prefix),
            "",
            "## The mismatch over a long run",
            "",
            "A step's mismatch depends on the prompts it draws, so passes over the prompts compare like with like.",
            "",
            long_run_table(results, prefix),
            "",
            "## The memory frontier",
            "",
            "Simulated cards (the rest of the device taken by one allocation before the run), micro-batch 8.",
            "",
            frontier_table(results, prefix),
            "",
            "## Kernel microbenchmarks",
            "",
            kernel_tables(results, prefix),
            "",
        ]
    )


def latest_table(results: list[dict], prefix: str) -> str:
    """bench/README.md's index: each experiment's newest results folder and what it holds."""
    lines = ["| experiment | newest results | shapes | kinds |", "|---|---|---|---|"]
    for experiment in sorted(dict.fromkeys(r["experiment"] for r in results), key=list(EXPERIMENTS).index):
        mine = [r for r in results if r["experiment"] == experiment]
        folder = mine[-1]["folder"]
        mine = [r for r in mine if r["folder"] == folder]
        shapes = ", ".join(sorted(dict.fromkeys(r["shape"] for r in mine), key=shape_size))
        kinds = ", ".join(dict.fromkeys(r["kind"] for r in mine if r["kind"])) or "(microbenchmark)"
        lines.append(f"| `{experiment}` | [`{folder}`]({prefix}{folder}/) | {shapes} | {kinds} |")
    return "\n".join(lines)


def between_markers(text: str, table: str) -> str:
    """``text`` with what stands between the markers replaced by ``table``."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def rendered(results: list[dict]) -> dict[Path, str]:
    """Each file's text with its tables rendered from ``results``."""
    return {
        README: between_markers(
            README.read_text(),
            headline_table(results, "bench/results/") + "\n\n" + unsloth_table(results, "bench/results/"),
        ),
        BENCH_README: between_markers(BENCH_README.read_text(), latest_table(results, "results/")),
        DOCS: docs_page(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file's tables are not what the results give")
    args = parser.parse_args()
    stale = []
    results = load_results()
    for path, text in rendered(results).items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    if not args.check:
        stale += learning_curves(results)
    if args.check and stale:
        print("Tables out of date (run python bench/render.py): " + ", ".join(str(p) for p in stale), file=sys.stderr)
        sys.exit(1)
    print("Up to date." if not stale else "Rendered: " + ", ".join(str(p.relative_to(ROOT)) for p in stale))


if __name__ == "__main__":
    main()
