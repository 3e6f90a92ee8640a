"""The N-Grammys (k, w) grid (the paper's Figure 3): measured speedup over ``hf`` per cell.

Runs one ``specdec bench`` with ``hf`` and one ``ngrammys:k=K:w=W`` label per grid cell, so every
cell is measured in the same run, interleaved, against the same ``hf`` runs; then plots the
speedup and tokens-per-call heatmaps::

    python -m bench.studies.ngrammys_grid --dtype bf16 --per-category 1 --ks 1,2,4,6,10 --ws 2,4,6,8,10 \\
        --json bench/results/issue4_grid_bf16.json --png bench/studies/ngrammys_grid_bf16.png

``--from-json FILE`` re-plots an earlier run without measuring.
"""
from __future__ import annotations

from bench.studies.grid_common import grid_parser, load_or_run, save_figure
from specdec.methods import parse_label


def grid_labels(ks: list[int], ws: list[int], extra: str = "") -> list[str]:
    return [f"ngrammys:k={k}:w={w}{extra}" for k in ks for w in ws]


def cells(result: dict) -> dict[tuple[int, int], dict]:
    """``(k, w) -> summary`` for every grid label of a bench result."""
    out = {}
    for label, s in result["summary"].items():
        name, opts = parse_label(label)
        if name == "ngrammys" and "k" in opts and "w" in opts:
            out[(int(opts["k"]), int(opts["w"]))] = s
    return out


def plot(result: dict, png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = cells(result)
    ks = sorted({k for k, _ in grid})
    ws = sorted({w for _, w in grid})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "speedup", "speedup over hf"), (axes[1], "tokens_per_call", "tokens per call")):
        z = np.array([[grid[(k, w)][key] if (k, w) in grid else np.nan for w in ws] for k in ks])
        im = ax.imshow(z, origin="lower", cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(ws)), [str(w) for w in ws])
        ax.set_yticks(range(len(ks)), [str(k) for k in ks])
        ax.set_xlabel("w (tokens per draft)")
        ax.set_ylabel("k (drafts per step)")
        ax.set_title(name)
        for i in range(len(ks)):
            for j in range(len(ws)):
                if not np.isnan(z[i, j]):
                    ax.text(j, i, f"{z[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax)
    save_figure(fig, title, png)


def main() -> None:
    ap = grid_parser(__doc__, 128)
    ap.add_argument("--linear", default="auto", help="linear kernel of the target (see specdec bench --linear)")
    ap.add_argument("--ks", default="1,2,4,6,10")
    ap.add_argument("--ws", default="2,4,6,8,10")
    ap.add_argument("--extra", default="", help="options appended to every label, e.g. :verify=batch")
    ap.add_argument("--png", required=True)
    args = ap.parse_args()
    labels = grid_labels([int(x) for x in args.ks.split(",")], [int(x) for x in args.ws.split(",")], args.extra)
    result = load_or_run(args, ["hf"] + labels, linear=args.linear)
    cfg = result.get("config", {})
    plot(result, args.png, f"N-Grammys on SmolLM2-135M ({cfg.get('dtype')}, CPU, {cfg.get('max_new_tokens')} new tokens)")


if __name__ == "__main__":
    main()
