"""Small matplotlib charts for the app: TTFT of full vs POP, and layer importance per stage."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COLORS = {"full": "#4c72b0", "pop": "#dd8452", "static": "#8c8c8c"}


def ttft_chart(history: list[dict]):
    """Left: this request's TTFT per mode, stacked by stage. Right: TTFT of each request of the session."""
    fig, (now, past) = plt.subplots(1, 2, figsize=(8, 2.6), gridspec_kw={"width_ratios": [1, 1.6]})
    if history:
        last = history[-1]
        stages = [("vision", "vision_s"), ("prefill", "prefill_s"), ("first token", "first_token_s"), ("preprocess", "preprocess_s")]
        modes = [m for m in ("full", "pop", "static") if m in last]
        bottom = [0.0] * len(modes)
        for label, key in stages:
            values = [last[m][key] * 1e3 for m in modes]
            now.bar(modes, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        now.set_ylabel("TTFT (ms)")
        now.set_title("this request", fontsize=9)
        now.legend(fontsize=7)
        for mode in ("full", "pop", "static"):
            points = [(i + 1, h[mode]["ttft_s"] * 1e3) for i, h in enumerate(history) if mode in h]
            if points:
                past.plot(*zip(*points), marker="o", label=mode, color=COLORS[mode])
        past.set_xlabel("request")
        past.set_xticks(range(1, len(history) + 1))  # whole requests, also when there is only one
        past.set_xlim(0.5, len(history) + 0.5)
        past.set_title("this session", fontsize=9)
        past.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


def importance_chart(prefill: list[float], decode: list[float], pruned: list[int] | None = None):
    """Prefill vs decode importance per layer; the layers POP skips in the prefill shaded."""
    fig, ax = plt.subplots(figsize=(8, 2.8))
    layers = list(range(len(prefill)))
    for layer in pruned or []:
        ax.axvspan(layer - 0.5, layer + 0.5, color="#dddddd", zorder=0)
    width = 0.4
    ax.bar([i - width / 2 for i in layers], prefill, width, label="prefill", color="#dd8452")
    ax.bar([i + width / 2 for i in layers], decode, width, label="decode", color="#4c72b0")
    ax.set_xlabel("layer (shaded: skipped in POP's prefill)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    ax.set_ylabel("share of stage total")
    positive = [v for v in prefill + decode if v > 0]
    if positive:
        ax.set_yscale("log")
        ax.set_ylim(bottom=min(positive) / 2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig
