"""GSD's sensitivity to the paper's knobs (k, tau, the probability and sibling thresholds), one at a time.

Runs one ``specdec bench`` with ``ar``, the best static ``sd`` (one draft token) and one ``gsd`` label per
knob value, every other knob at the paper's default (k 4, tau 2, 0.2, 0.3), for both schedules (``static``:
the paper's rules alone; ``cost``: ours), so every point is measured in the same run against the same
baselines; then plots speedup over ``sd`` and tokens per call per knob::

    python -m bench.studies.gsd_grid --shard 0/2 --json /tmp/grid_0.json & python -m bench.studies.gsd_grid --shard 1/2 --json /tmp/grid_1.json
    python -m bench.report /tmp/grid_0.json /tmp/grid_1.json --out bench/results/gsd_grid_bf16.json
    python -m bench.studies.gsd_grid --from-json bench/results/gsd_grid_bf16.json --png bench/studies/gsd_grid_bf16.png
"""
from __future__ import annotations

from bench.studies.grid_common import grid_parser, load_or_run, save_figure
from specdec.methods import parse_label

KNOBS = {"k": (1, 2, 4, 8), "tau": (0, 1, 2, 3), "prob_threshold": (0.0, 0.1, 0.2, 0.4),
         "sibling_threshold": (0.0, 0.1, 0.3, 0.5)}
DEFAULTS = {"k": 4, "tau": 2, "prob_threshold": 0.2, "sibling_threshold": 0.3}
SCHEDULES = ("static", "cost")
BASELINE = "sd:draft_length=1"
# Beside the grid: the drafting depth and merging, at the paper's defaults otherwise.
EXTRA = ("gsd:schedule=cost:max_depth=1", "gsd:schedule=cost:max_depth=2", "gsd:schedule=cost:merge=0",
         "gsd:schedule=static:merge=0")


def grid_labels() -> list[str]:
    labels = []
    for schedule in SCHEDULES:
        labels.append(f"gsd:schedule={schedule}")  # the paper's defaults
        for knob, values in KNOBS.items():
            labels += [f"gsd:schedule={schedule}:{knob}={v}" for v in values if v != DEFAULTS[knob]]
    return labels + list(EXTRA)


def points(result: dict) -> dict[tuple[str, str, float], dict]:
    """``(schedule, knob, value) -> summary`` for every grid label (the defaults' label under every knob)."""
    out = {}
    for label, s in result["summary"].items():
        name, opts = parse_label(label)
        if name != "gsd" or "schedule" not in opts or set(opts) - set(KNOBS) - {"schedule"}:
            continue
        knobs = [k for k in opts if k in KNOBS]
        for knob in KNOBS if not knobs else knobs:
            out[(opts["schedule"], knob, float(opts.get(knob, DEFAULTS[knob])))] = s
    return out


def plot(result: dict, png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = points(result)
    base = result["summary"][BASELINE]["tokens_per_second"]
    fig, axes = plt.subplots(2, len(KNOBS), figsize=(13, 6), sharey="row")
    for j, knob in enumerate(KNOBS):
        for schedule, style in zip(SCHEDULES, ("o--", "s-")):
            xs = [float(v) for v in KNOBS[knob] if (schedule, knob, float(v)) in grid]
            cell = [grid[(schedule, knob, x)] for x in xs]
            axes[0, j].plot(xs, [c["tokens_per_second"] / base for c in cell], style, label=f"schedule={schedule}")
            axes[1, j].plot(xs, [c["tokens_per_call"] for c in cell], style, label=f"schedule={schedule}")
        axes[0, j].axhline(1.0, color="grey", lw=0.8)
        axes[0, j].axhline(result["summary"]["ar"]["tokens_per_second"] / base, color="grey", lw=0.8, ls=":")
        axes[1, j].set_xlabel(f"{knob} (default {DEFAULTS[knob]})")
    axes[0, 0].set_ylabel("tok/s over sd (1 draft token)\n(dotted: ar)")
    axes[1, 0].set_ylabel("tokens per target call")
    axes[0, 0].legend(fontsize=8)
    save_figure(fig, title, png)


def main() -> None:
    ap = grid_parser(__doc__, 64)
    ap.add_argument("--draft", default="smollm2-draft")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    result = load_or_run(args, ["ar", BASELINE] + grid_labels(), args.draft, compile="off")
    if args.png:
        cfg = result.get("config", {})
        plot(result, args.png, f"GSD on SmolLM2-135M with {cfg.get('draft')} ({cfg.get('dtype')}, CPU, "
                               f"{cfg.get('max_new_tokens')} new tokens): one knob at a time")


if __name__ == "__main__":
    main()
