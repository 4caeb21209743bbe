"""Plots of the library's results, as PNG files: importance profiles, benchmark speedups, quality against k, the
training curve of a demo model.
Results stay plain data; matplotlib is imported here only, and only when a plot is drawn."""
from __future__ import annotations


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on servers and in tests)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path, dpi: int = 120) -> None:
    """Write the figure to `path` and free it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def importance_profile(profile, path, budget: float | None = None) -> None:
    """A PNG of a `LayerImportance`: prefill and decode importance (shares of each stage's total) and Block Influence per layer."""
    from .importance import DEFAULT_BUDGET

    plt = pyplot()
    budget = profile.settings.get("budget", DEFAULT_BUDGET) if budget is None else budget
    layers = list(range(profile.num_layers))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    width = 0.4
    top.bar([i - width / 2 for i in layers], profile.share("prefill"), width, label="prefill positions", color="#4C72B0")
    top.bar([i + width / 2 for i in layers], profile.share("decode"), width, label="decode positions", color="#DD8452")
    k = profile.auto_k(budget)
    if k:
        top.axvline(profile.num_layers - k - 0.5, color="k", ls="--", lw=1)
        top.text(profile.num_layers - k - 0.4, top.get_ylim()[1] * 0.92, f"auto: prefill skips last {k}\n(≤{budget:.0%} of prefill importance)",
                 fontsize=8, va="top")
    top.set_ylabel("share of stage's Fisher importance")
    top.set_yscale("log")
    top.legend(loc="upper left", fontsize=8)
    title = f"{profile.model}: " if profile.model else ""
    top.set_title(f"{title}virtual-gate importance per layer ({profile.n_samples} samples, {profile.n_prompts} prompts)")
    bottom.bar(layers, profile.block_influence, color="#55A868")
    bottom.set_ylabel("Block Influence\n1 − cos(in, out)")
    bottom.set_xlabel("layer")
    bottom.set_xticks(layers)
    save(fig, path)


def bench_speedups(report: dict, path) -> None:
    """The benchmark's speedups over full against prompt length, with the FLOP limits (PNG)."""
    plt = pyplot()
    meta = report["meta"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"pop": "tab:blue", "static": "tab:orange", "full": "tab:gray"}
    for mode in ("pop", "static"):
        text = sorted((r for r in report["points"] if r["mode"] == mode and not r["image_size"]), key=lambda r: r["tokens"])
        image = sorted((r for r in report["points"] if r["mode"] == mode and r["image_size"]), key=lambda r: r["tokens"])
        if not text and not image:
            continue
        if text:
            ax.plot([r["tokens"] for r in text], [r["speedup"] for r in text], "o-", color=colors[mode], label=f"{mode}: measured (text)")
            ax.plot([r["tokens"] for r in text], [r["flop_limit"] for r in text], "--", color=colors[mode], label=f"{mode}: FLOP limit")
        if image:
            ax.plot([r["tokens"] for r in image], [r["speedup"] for r in image], "s:", color=colors[mode],
                    label=f"{mode}: measured (image + {image[0]['text_tokens']} text)")
    ax.axhline(1.0, color=colors["full"], lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("LM prefill speedup over full")
    ax.set_title(f"{meta['arch']} (scale {meta['scale']}, k={meta['prune_layers']}/{meta['num_layers']}, "
                 f"{meta['dtype']}, {meta['device']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def quality_against_k(results: dict, path) -> None:
    """Against k, for pop, static and the ablations: agreement and mean KL on text (when measured), passkey
    accuracy per length (when measured) and image-QA accuracy (when measured) (PNG)."""
    plt = pyplot()
    fid = results.get("fidelity") or {}
    ks = results["ks"]
    panels = (2 if fid else 0) + ("passkey" in results) + ("image_qa" in results)
    if not panels:
        raise ValueError("nothing to plot: the results hold no fidelity, passkey or image QA")
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels + 0.4, 3.8), squeeze=False)
    axes = list(axes[0])
    styles = {"pop": ("#4C72B0", "o-"), "static": ("#C44E52", "s-"), "pop-no-kv": ("#8172B2", "^--"),
              "pop-no-boundary": ("#937860", "v--")}

    def against_k(ax, values: dict, key=None):
        """One line per variant family over the ks it ran at, the auto k as a star."""
        for name, (color, style) in styles.items():
            points = [(k, values[f"{name}@{k}"]) for k in ks if f"{name}@{k}" in values]
            if points:
                ax.plot([k for k, _ in points], [v if key is None else v[key] for _, v in points], style,
                        color=color, label=name)
        for label in (label for label in values if label.startswith("pop-auto@")):
            value = values[label] if key is None else values[label][key]
            ax.plot([int(label.split("@")[1])], [value], "*", color="k", ms=12, label="pop auto")
        ax.set_xlabel("k (layers skipped)")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)

    if fid:
        ax_agree, ax_kl = axes.pop(0), axes.pop(0)
        against_k(ax_agree, fid, "agreement")
        against_k(ax_kl, fid, "kl_mean")
        ax_agree.set_ylabel("next-token agreement with full")
        ax_kl.set_ylabel("KL(full ‖ variant), nats")
        ax_kl.set_yscale("symlog", linthresh=1e-3)
        ax_agree.legend(fontsize=8)
    if "passkey" in results:
        ax = axes.pop(0)
        pk = results["passkey"]
        lengths = pk["lengths"]
        for label, acc in pk["accuracy"].items():
            style = "-" if label == "full" else ("o-" if label.startswith("pop") else "s--")
            ax.plot(lengths, [acc[str(n)] for n in lengths], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"passkey accuracy ({pk['trials']} trials per length)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if "image_qa" in results:
        ax = axes.pop(0)
        qa = results["image_qa"]
        against_k(ax, qa)
        if "full" in qa:
            ax.axhline(qa["full"], color="#55A868", lw=1.5, label="full")
        tails = [label for label in qa if "+tail" in label]
        for label in tails:
            ax.plot([int(label.split("@")[1].split("+")[0])], [qa[label]], "D", ms=7, mfc="none",
                    label=label.replace("+tail", ", full_tail="))
        n = results.get("settings", {}).get("qa_n")
        ax.set_ylabel("image QA accuracy" + (f" ({n} questions)" if n else ""))
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
    fig.suptitle(f"{results['model']} ({results['num_layers']} layers): POP vs static removal")
    save(fig, path)


def training_curve(curve: list[dict], path) -> None:
    """A demo model's training: answer and vision-aux loss, and held-out accuracy by question type, against the
    number of training images (`curve` as `pop_vlm.train` records it)."""
    from .shapes import QTYPES

    plt = pyplot()
    evals = [c for c in curve if "val_accuracy" in c]
    losses = [c for c in curve if "loss" in c]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([c["images"] for c in losses], [c["loss"] for c in losses], label="answer loss")
    ax[0].plot([c["images"] for c in losses], [c["aux_loss"] for c in losses], label="vision aux loss")
    ax[0].set_xlabel("training images")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[1].plot([c["images"] for c in evals], [c["val_accuracy"] for c in evals], label="all", lw=2)
    for q in QTYPES:
        ax[1].plot([c["images"] for c in evals], [c["val_by_qtype"].get(q, float("nan")) for c in evals], label=q)
    ax[1].set_xlabel("training images")
    ax[1].set_ylabel("held-out accuracy")
    ax[1].legend(fontsize=7)
    save(fig, path, dpi=90)


def serving_sweep(report: dict, path) -> None:
    """The serving benchmark (PNG): generated tokens/s and TTFT p99 against the number of clients, per model,
    serial vs batched server, full vs POP. A TTFT that is a lower bound (requests still waiting at the time bound)
    is drawn as an upward triangle."""
    plt = pyplot()
    rows = report["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 6.4), squeeze=False)
    colors = {"full": "tab:gray", "pop": "tab:blue", "static": "tab:orange"}
    for column, model in enumerate(models):
        top, bottom = axes[0][column], axes[1][column]
        for server, style in (("serial", "--"), ("batched", "-")):
            for mode in dict.fromkeys(r["mode"] for r in rows):
                line = sorted((r for r in rows if (r["model"], r["server"], r["mode"]) == (model, server, mode)),
                              key=lambda r: r["clients"])
                if not line:
                    continue
                clients = [r["clients"] for r in line]
                top.plot(clients, [r["tokens_per_s"] for r in line], style + "o", color=colors.get(mode, "k"),
                         mfc="none" if server == "serial" else None, label=f"{server} {mode}")
                ttft = [float("nan") if r["ttft_p99_s"] is None else r["ttft_p99_s"] for r in line]
                bottom.plot(clients, ttft, style, color=colors.get(mode, "k"))
                for r, value in zip(line, ttft):
                    bottom.plot([r["clients"]], [value], "^" if r.get("ttft_lower_bound") else "o",
                                color=colors.get(mode, "k"), mfc="none" if server == "serial" else None)
        top.set_title(model, fontsize=10)
        top.set_ylabel("generated tokens/s")
        bottom.set_ylabel("TTFT p99 (s)")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    meta = report["meta"]
    fig.suptitle(f"serial vs continuous batching ({meta['device']}, {meta.get('dtype_resolved', meta['dtype'])}; "
                 "▲ TTFT at least this: requests still queued at the time bound)", fontsize=9)
    save(fig, path)
