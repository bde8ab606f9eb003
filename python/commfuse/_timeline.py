"""Draws a ``commfuse.trace`` written as JSON (a path ending in ``.json``) as
a timeline image: a row per device and lane (compute, comm), a bar per
slice, colored by kind. Needs matplotlib (the ``bench`` extra). The demo
draws one with ``--timeline``; ``python -m commfuse._timeline trace.json
out.png [title]`` draws any other."""

from __future__ import annotations

import json
import sys

_COLORS = {"matmul": "#4C72B0", "add": "#8172B2", "exchange": "#DD8452", "send": "#C44E52", "recv": "#55A868",
           "wait": "#CCCCCC"}
_LANES = ("compute", "comm")


def draw(trace_json: str, png: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(trace_json) as f:
        slices = [e for e in json.load(f)["traceEvents"] if e.get("cat") in _COLORS]
    devices = sorted({e["pid"] for e in slices})
    rows = {(d, lane): i for i, (d, lane) in enumerate((d, lane) for d in devices for lane in (0, 1))}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.2))
    # Sends and receives sit inside their exchange: drawn thinner, on top.
    for e in sorted(slices, key=lambda e: e["cat"] in ("send", "recv")):
        inner = e["cat"] in ("send", "recv")
        y = rows[(e["pid"], e["tid"])]
        # A white edge tells back-to-back slices apart (a ring's GEMM pieces).
        ax.barh(y, max(e["dur"], 0.5) / 1e3, left=e["ts"] / 1e3, height=0.35 if inner else 0.75,
                color=_COLORS[e["cat"]], edgecolor="white", linewidth=0.6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"device {d} {_LANES[lane]}" for (d, lane) in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or "commfuse.trace")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="upper right", ncol=6,
              fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m commfuse._timeline TRACE.json OUT.png [TITLE]")
    draw(*sys.argv[1:])
