"""Draw docs/images/cuda-timeline.svg: the CUDA stream/event timeline of two slots.

Regenerate with ``python docs/images/make_timeline.py`` (needs matplotlib).
The times are illustrative, not measured: sampling 1 unit, a gather 1 unit,
a training step 2 units, two slots (A and B).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch

OUT = Path(__file__).with_name("cuda-timeline.svg")

LANES = {  # name -> y
    "producer thread\n(host)": 3.0,
    "copy stream\n(high priority)": 2.0,
    "consumer stream\n(training)": 1.0,
}
Y_PROD, Y_COPY, Y_CONS = LANES.values()
H = 0.55
COLORS = {"A": "#7fb3d5", "B": "#f5b97f", "host": "#d5d8dc", "wait": "#ffffff"}

# (lane y, start, end, label, colour key)
BOXES = [
    (Y_PROD, 0.0, 1.0, "sample b0", "host"),
    (Y_PROD, 1.1, 2.1, "sample b1", "host"),
    (Y_PROD, 2.2, 3.2, "sample b2", "host"),
    (Y_PROD, 3.3, 4.3, "sample b3", "host"),
    (Y_COPY, 1.0, 2.0, "gather b0 -> A", "A"),
    (Y_COPY, 2.1, 3.1, "gather b1 -> B", "B"),
    (Y_COPY, 4.0, 5.0, "gather b2 -> A", "A"),
    (Y_COPY, 6.0, 7.0, "gather b3 -> B", "B"),
    (Y_CONS, 2.0, 4.0, "step b0 (reads A)", "A"),
    (Y_CONS, 4.0, 6.0, "step b1 (reads B)", "B"),
    (Y_CONS, 6.0, 8.0, "step b2 (reads A)", "A"),
    (Y_CONS, 8.0, 10.0, "step b3 (reads B)", "B"),
]
# ready_event[k]: recorded after gather k on the copy stream, waited on by the consumer.
READY = [(2.0, 2.0), (3.1, 4.0), (5.0, 6.0), (7.0, 8.0)]
# release_event: recorded on the consumer stream after the step that read the slot;
# the copy stream waits on it before overwriting the slot.
RELEASE = [(4.0, 4.0), (6.0, 6.0)]
# The copy stream idles (on the GPU, not the host) until a release event completes.
COPY_WAITS = [(3.2, 4.0, "wait release A"), (5.0, 6.0, "wait release B")]


def main() -> None:
    plt.rcParams["svg.fonttype"] = "none"
    plt.rcParams["svg.hashsalt"] = "pingpong"
    fig, ax = plt.subplots(figsize=(10.5, 3.9))
    for y, x0, x1, label, colour in BOXES:
        ax.add_patch(
            plt.Rectangle(
                (x0, y - H / 2),
                x1 - x0,
                H,
                facecolor=COLORS[colour],
                edgecolor="#34495e",
                linewidth=0.8,
            )
        )
        ax.text((x0 + x1) / 2, y, label, ha="center", va="center", fontsize=8)
    for x0, x1, label in COPY_WAITS:
        ax.add_patch(
            plt.Rectangle(
                (x0, Y_COPY - H / 2),
                x1 - x0,
                H,
                facecolor="none",
                edgecolor="#7f8c8d",
                linestyle=":",
                linewidth=0.8,
            )
        )
        ax.text((x0 + x1) / 2, Y_COPY + 0.4, label, ha="center", fontsize=7, color="#566573")
    ax.text(
        4.4,
        Y_PROD,
        "each sample ends with the gather enqueued;\nhost threads block only on the slot queues",
        ha="left",
        va="center",
        fontsize=7,
        color="#566573",
    )
    for x0, x1 in READY:
        ax.add_patch(
            FancyArrowPatch(
                (x0, Y_COPY - H / 2),
                (x1, Y_CONS + H / 2),
                arrowstyle="-|>",
                mutation_scale=9,
                color="#1e8449",
                linewidth=1.1,
            )
        )
    for x0, x1 in RELEASE:
        ax.add_patch(
            FancyArrowPatch(
                (x0 + 0.06, Y_CONS + H / 2),
                (x1 + 0.06, Y_COPY - H / 2),
                arrowstyle="-|>",
                mutation_scale=9,
                color="#c0392b",
                linewidth=1.1,
                linestyle="--",
            )
        )
    ax.plot(
        [], [], color="#1e8449", label="ready_event[slot]: consumer stream waits before reading"
    )
    ax.plot(
        [],
        [],
        color="#c0392b",
        linestyle="--",
        label="release_event[slot]: copy stream waits before overwriting",
    )
    ax.set_yticks(list(LANES.values()), list(LANES.keys()), fontsize=8)
    ax.set_xticks([])
    ax.set_xlabel("time (illustrative) ->", fontsize=8)
    ax.set_xlim(-0.2, 10.3)
    ax.set_ylim(0.45, 3.65)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="upper right", fontsize=7, frameon=False, bbox_to_anchor=(1.0, 1.12))
    ax.set_title(
        "Two slots (A, B) on CUDA: the host never waits for the GPU", fontsize=9, loc="left"
    )
    fig.tight_layout()
    fig.savefig(OUT, metadata={"Date": None} if OUT.suffix == ".svg" else None)
    plt.close(fig)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")  # noqa: T201


if __name__ == "__main__":
    main()
