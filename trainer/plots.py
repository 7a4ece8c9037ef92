"""metrics.png: a run's curves drawn from its metrics.jsonl, one panel per quantity; several runs overlay (one colour each).

Drawn by both loops when a run ends, and on demand by `scripts/plot_metrics.py RUN_DIR [RUN_DIR ...]`. matplotlib's
Agg canvas only: no display is needed.
"""

import math
from pathlib import Path

from config import outputs

# (panel title, metrics.jsonl keys drawn in it). A panel appears when any run has any of its keys; the
# panels of a loop the runs did not use (GRPO's for an SFT run) are left out.
PANELS = (
    ("training loss", ("loss",)),
    ("learning rate", ("lr",)),
    ("grad norm", ("grad_norm",)),
    ("held-out loss", ("eval_loss",)),
    ("held-out accuracy", ("eval_accuracy", "eval_answer_accuracy", "eval_format_rate")),
    ("reward", ("reward_mean", "reward_model_score")),
    ("rollout accuracy", ("accuracy", "answer_accuracy", "format_rate")),
    ("KL to the reference", ("kl",)),
    ("distillation: reverse KL to the teacher per token", ("teacher_reverse_kl",)),
    ("reward model: pairs' scores", ("chosen_score", "rejected_score", "margin", "eval_margin")),
    ("entropy", ("entropy",)),
    ("response length (tokens)", ("response_len",)),
    ("tool use per episode", ("tool_call_rate", "turns_per_episode", "tool_calls_per_episode", "eval_tool_call_rate")),
    ("tool failures per step", ("tool_errors", "tool_parse_errors", "tool_timeouts", "tool_timeout_ends", "unknown_tools",
                                "max_turns_reached", "out_of_room", "prompts_too_long")),
    ("tool time (s)", ("tool_time_s",)),
    ("a GRPO step's time by phase (s)", ("rollout_time_s", "reward_time_s", "pi_old_time_s", "reference_time_s",
                                         "teacher_time_s", "update_time_s", "rank_wait_time_s", "rollout_wait_time_s",
                                         "weight_sync_time_s")),
    ("asynchronous GRPO: idle shares", ("trainer_idle_share", "rollout_idle_share")),
    ("asynchronous GRPO: staleness (updates)", ("staleness",)),
    ("rollout correction: pi_old / pi_sampler", ("rollout_is_ratio_mean", "rollout_is_ratio_max", "rollout_rejected_share")),
    ("an SFT step's time by phase (s)", ("data_time_s", "forward_backward_time_s", "optimizer_time_s")),
    ("time between steps (s)", ("eval_time_s", "checkpoint_time_s")),
    ("MoE load imbalance (busiest expert / mean)", ("moe_load_imbalance",)),
    ("MoE router losses", ("moe_aux_loss", "moe_z_loss")),
    ("rollout/training log-prob gap", ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl")),
    ("MoE routes differing from the rollout's", ("moe_route_mismatch",)),
)
# The panels of a reward model's runs (`trainer.rm`: their rows have `chosen_score`) whose keys mean pairs there.
REWARD_MODEL_TITLES = {"rollout accuracy": "pair accuracy (chosen scored higher)",
                       "held-out accuracy": "held-out pair accuracy"}
# How a key is named in a panel that holds several.
KEY_LABELS = {"reward_mean": "reward function", "reward_model_score": "reward model", "chosen_score": "chosen",
              "rejected_score": "rejected", "margin": "margin", "eval_margin": "held-out margin",
              "eval_accuracy": "full marks", "eval_answer_accuracy": "right answer", "eval_format_rate": "#### N form",
              "accuracy": "full marks", "answer_accuracy": "right answer", "format_rate": "#### N form",
              "tool_call_rate": "call rate", "turns_per_episode": "turns", "tool_calls_per_episode": "calls",
              "eval_tool_call_rate": "held-out call rate", "tool_errors": "tool errors", "tool_parse_errors": "parse errors",
              "tool_timeouts": "timeouts", "tool_timeout_ends": "episodes ended by a timeout",
              "unknown_tools": "unknown tools", "max_turns_reached": "max turns", "out_of_room": "out of room",
              "prompts_too_long": "prompts too long after reset", "moe_aux_loss": "load balancing", "moe_z_loss": "z-loss",
              "rollout_logprob_diff_mean": "mean |diff|", "rollout_logprob_diff_max": "max |diff|", "rollout_kl": "k3 KL",
              "rollout_time_s": "rollout", "reward_time_s": "reward", "pi_old_time_s": "pi_old log-probs",
              "reference_time_s": "reference log-probs", "teacher_time_s": "teacher log-probs", "update_time_s": "update",
              "rank_wait_time_s": "waiting for other ranks' rollouts", "rollout_wait_time_s": "waiting for batches",
              "weight_sync_time_s": "weights' push", "trainer_idle_share": "trainers", "rollout_idle_share": "rollout processes",
              "rollout_is_ratio_mean": "mean", "rollout_is_ratio_max": "max", "rollout_rejected_share": "rejected share",
              "data_time_s": "data",
              "forward_backward_time_s": "forward and backward", "optimizer_time_s": "optimizer",
              "eval_time_s": "evaluation", "checkpoint_time_s": "checkpoint (the loop's wait)"}
# A panel's keys: the line styles first, then each again with a marker (the colours are the runs'), so a panel of up
# to nine keys shows each its own way.
LINE_STYLES = ("-", "--", ":")
KEY_MARKERS = (None, "x", "^")
# Per-step series longer than this also get a smoothed line (centred moving average) over the raw one; the
# learning rate is a schedule, not a noisy measurement, and is drawn as it is.
SMOOTH_AFTER = 20
NOT_SMOOTHED = ("lr",)


def read_rows(run_dir: Path) -> list[dict]:
    """The rows of `<run_dir>/metrics.jsonl`."""
    return outputs.read_rows(Path(run_dir) / outputs.METRICS)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key, rows without it (or with null) left out."""
    points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
    return [step for step, _ in points], [float(value) for _, value in points]


def smoothed(values: list[float], window: int) -> list[float]:
    """Centred moving average over `window` points (fewer at the ends), so the trend does not lag the data."""
    half = window // 2
    return [sum(values[max(index - half, 0) : index + half + 1]) / len(values[max(index - half, 0) : index + half + 1])
            for index in range(len(values))]


def key_look(index: int) -> tuple[str, str | None]:
    """(line style, marker) of a panel's `index`-th key."""
    return LINE_STYLES[index % len(LINE_STYLES)], KEY_MARKERS[index // len(LINE_STYLES) % len(KEY_MARKERS)]


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, with its parent's where two names collide."""
    names = [Path(run_dir).resolve().name for run_dir in run_dirs]
    return [f"{Path(run_dir).resolve().parent.name}/{name}" if names.count(name) > 1 else name
            for run_dir, name in zip(run_dirs, names)]


def figure(run_dirs: list[Path], labels: list[str] | None = None):
    """The matplotlib Figure of the runs' panels (the axes' titles are the panel titles)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    runs = [read_rows(run_dir) for run_dir in run_dirs]
    labels = labels or run_labels(run_dirs)
    panels = [(title, keys) for title, keys in PANELS if any(series(rows, key)[0] for rows in runs for key in keys)]
    if all(series(rows, "chosen_score")[0] for rows in runs):
        panels = [(REWARD_MODEL_TITLES.get(title, title), keys) for title, keys in panels]
    columns = 3 if len(panels) > 4 else 2
    grid_rows = max(math.ceil(len(panels) / columns), 1)
    legend = 0.45 if len(runs) > 1 else 0.0  # inches below the panels for the runs' legend
    width, height = 5.2 * columns, 3.3 * grid_rows + 0.8 + legend
    fig = Figure(figsize=(width, height))
    # Fixed margins in inches (every panel is the same size, so one layout fits every figure): matplotlib's constrained
    # layout measured each tick label again and was half of the drawing time, which every run pays at its end.
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.25 / width, top=1 - 0.75 / height,
                        bottom=(0.6 + legend) / height, wspace=0.32, hspace=0.55)
    colors = [f"C{index % 10}" for index in range(len(runs))]
    for index, (title, keys) in enumerate(panels):
        axes = fig.add_subplot(grid_rows, columns, index + 1)
        _draw_panel(axes, runs, keys, colors)
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
        if index >= len(panels) - columns:
            axes.set_xlabel("step")
    last_steps = [max((row["step"] for row in rows), default=0) for rows in runs]
    fig.suptitle(" vs ".join(f"{label} ({steps} steps)" for label, steps in zip(labels, last_steps)), fontsize=12)
    if len(runs) > 1:
        handles = [Line2D([], [], color=color, linewidth=2) for color in colors]
        fig.legend(handles, labels, loc="lower center", ncols=min(len(runs), 4), frameon=False)
    return fig


def _draw_panel(axes, runs: list[list[dict]], keys: tuple[str, ...], colors: list[str]) -> None:
    """One panel: every run's series of `keys` (a line style and marker per key, a colour per run)."""
    from matplotlib.lines import Line2D

    drawn_values = []
    for rows, color in zip(runs, colors):
        for index, key in enumerate(keys):
            steps, values = series(rows, key)
            if not steps:
                continue
            drawn_values += values
            style, marker = key_look(index)
            label = KEY_LABELS.get(key, key) if len(keys) > 1 else None
            if len(steps) <= SMOOTH_AFTER and len(steps) < len(rows) / 2:  # sparse: held-out evaluations
                axes.plot(steps, values, style, color=color, marker=marker or "o", markersize=4, label=label)
            elif len(steps) > SMOOTH_AFTER and key not in NOT_SMOOTHED:  # noisy per-step figures: faint raw, smoothed on top
                axes.plot(steps, values, style, color=color, alpha=0.25, linewidth=0.8)
                axes.plot(steps, smoothed(values, max(len(steps) // 40, 5)), style, color=color, linewidth=1.8,
                          label=label, marker=marker, markevery=max(len(steps) // 10, 1))
            else:
                axes.plot(steps, values, style, color=color, linewidth=1.6, label=label,
                          marker=marker or ("." if len(steps) <= SMOOTH_AFTER else None))
    # Losses and gradient norms falling by orders of magnitude read better on a log scale.
    positive = [value for value in drawn_values if value > 0]
    if keys[0] in ("loss", "grad_norm") and positive and len(positive) == len(drawn_values) and max(positive) > 10 * min(positive):
        axes.set_yscale("log")
    else:
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    drawn = [index for index, key in enumerate(keys) if any(series(rows, key)[0] for rows in runs)]
    if len(drawn) > 1:
        # One legend entry per key drawn, in a neutral colour (the colours are the runs').
        handles = [Line2D([], [], linestyle=style, marker=marker, color="0.3") for style, marker in map(key_look, drawn)]
        axes.legend(handles, [KEY_LABELS.get(keys[index], keys[index]) for index in drawn], fontsize=8, loc="best")


def draw_runs(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> list[str]:
    """Write the runs' figure to `out` (PNG); returns the panel titles (also in the PNG's Description text)."""
    fig = figure(run_dirs, labels)
    titles = [axes.get_title() for axes in fig.axes]
    fig.savefig(out, dpi=100, metadata={"Title": fig.get_suptitle(), "Description": "panels: " + "; ".join(titles)})
    return titles
