"""The memory timeline picture: live tensor bytes through the counted step, with the
step's parts shaded (forward, backward, optimizer, transfers …)."""

from __future__ import annotations

from pathlib import Path

from hybridtrain.profiling.counting import StepCount

_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "interleaved": "#8172b3", "step": "#55a868",
            "host_optimizer": "#c44e52", "transfer": "#937860", "communication": "#da8bc3"}
_NAMES = {"step": "optimizer", "interleaved": "forward + backward (interleaved)", "host_optimizer": "host optimizer"}


def plot_memory(count: StepCount, device: str, path: str | Path) -> Path | None:
    """Draw ``count``'s live-bytes timeline to ``path`` (PNG); None when matplotlib is missing.

    The counted step runs under FLOP and byte counters, so its seconds are slower than a
    timed step's; the shape (what is alive when) is the step's.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    if count.timeline:
        times, sizes = zip(*count.timeline, strict=True)
        ax.step(times, [s / 2**20 for s in sizes], where="post", color="black", linewidth=1.0,
                label="live tensor bytes")
    shown: set[str] = set()
    marks = count.parts
    for (start, part), (end, _) in zip(marks, marks[1:], strict=False):
        if part is None:
            continue
        label = _NAMES.get(part, part) if part not in shown else None
        shown.add(part)
        ax.axvspan(start, end, color=_COLOURS.get(part, "#cccccc"), alpha=0.25, linewidth=0, label=label)
    ax.set_xlabel("seconds into the counted step (slowed by counting)")
    ax.set_ylabel("MiB")
    ax.set_title(f"live tensor memory on {device}: peak {count.peak_live_bytes / 2**20:.1f} MiB")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
