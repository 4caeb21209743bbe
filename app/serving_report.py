"""The serving benchmark's results: the table (text and markdown), batched over serial throughput, the plot, and
the files (JSON, markdown, PNG)."""
from __future__ import annotations

import math
from pathlib import Path

from pop_vlm import plots
from pop_vlm.report import Column, markdown_table, text_table, write_json


def _ms(key: str, bound: str | None = None):
    """A cell: seconds in `key` as milliseconds, '≥' before it when the figure is a lower bound."""
    def cell(row: dict) -> str:
        value = row[key]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return ("≥" if bound and row.get(bound) else "") + f"{value * 1e3:.0f}"
    return cell


def _answers(row: dict) -> str:
    if row["server"] == "serial":
        return "reference" if not row.get("mismatches") else f"{row['mismatches']} differ among serial"
    return f"{row['compared'] - row['mismatches']}/{row['compared']}"


def columns(markdown: bool = False) -> tuple[Column, ...]:
    return (
        Column("model", lambda r: r["model"], 17, left=True),
        Column("server", lambda r: r["server"] if r["server"] == "serial" else f"batched ({r['max_batch_size']})",
               12, left=True),
        Column("mode", lambda r: r["mode"], 4, left=True),
        Column("clients", lambda r: r["clients"], 7),
        Column("done/sent", lambda r: f"{r['completed']}/{r['sent']}", 9),
        Column("req/s", lambda r: f"{r['requests_per_s']:.2f}", 6),
        Column("tok/s", lambda r: f"{r['tokens_per_s']:.1f}", 6),
        Column("TTFT p50 ms" if markdown else "TTFT50", _ms("ttft_p50_s", "ttft_lower_bound"), 7),
        Column("TTFT p99 ms" if markdown else "TTFT99", _ms("ttft_p99_s", "ttft_lower_bound"), 7),
        Column("ITL p50 ms" if markdown else "ITL50", _ms("itl_p50_s"), 6),
        Column("ITL p99 ms" if markdown else "ITL99", _ms("itl_p99_s"), 6),
        Column("rows/step", lambda r: f"{r['rows_per_step']:.1f}", 9),
        Column("same as serial" if markdown else "= serial", _answers, 9),
    )


def ratios(rows: list[dict]) -> list[dict]:
    """Batched beside serial, per model, mode and client count: generated tokens/s and their ratio, TTFT p99, the
    batched server's rows per step and its answers that equal the serial ones."""
    serial = {(r["model"], r["mode"], r["clients"]): r for r in rows if r["server"] == "serial"}
    out = []
    for row in rows:
        base = serial.get((row["model"], row["mode"], row["clients"]))
        if row["server"] != "serial" and base and base["tokens_per_s"] > 0:
            out.append({"model": row["model"], "mode": row["mode"], "clients": row["clients"],
                        "serial_tokens_per_s": base["tokens_per_s"], "batched_tokens_per_s": row["tokens_per_s"],
                        "ratio": row["tokens_per_s"] / base["tokens_per_s"],
                        "serial_ttft_p99_s": base["ttft_p99_s"], "serial_ttft_lower_bound": base["ttft_lower_bound"],
                        "batched_ttft_p99_s": row["ttft_p99_s"], "batched_ttft_lower_bound": row["ttft_lower_bound"],
                        "rows_per_step": row["rows_per_step"], "compared": row.get("compared", 0),
                        "mismatches": row.get("mismatches", 0)})
    return out


def ratio_lines(report: dict, markdown: bool = False) -> list[str]:
    """The batched-over-serial table (text or markdown)."""
    cols = (Column("model", lambda r: r["model"], 17, left=True), Column("mode", lambda r: r["mode"], 4, left=True),
            Column("clients", lambda r: r["clients"], 7),
            Column("serial tok/s", lambda r: f"{r['serial_tokens_per_s']:.1f}", 12),
            Column("batched tok/s", lambda r: f"{r['batched_tokens_per_s']:.1f}", 13),
            Column("batched / serial", lambda r: f"{r['ratio']:.2f}×", 16),
            Column("serial TTFT p99 ms" if markdown else "TTFT99 ser", _ms("serial_ttft_p99_s", "serial_ttft_lower_bound"), 10),
            Column("batched TTFT p99 ms" if markdown else "TTFT99 bat",
                   _ms("batched_ttft_p99_s", "batched_ttft_lower_bound"), 10),
            Column("rows/step", lambda r: f"{r['rows_per_step']:.1f}", 9),
            Column("same as serial" if markdown else "= serial", lambda r: f"{r['compared'] - r['mismatches']}/{r['compared']}", 9))
    return (markdown_table if markdown else text_table)(cols, ratios(report["rows"]))


def describe(meta: dict) -> str:
    tokens = ", ".join(f"{name}: {n}" for name, n in meta["max_tokens"].items())
    threads = f"{meta['threads']} torch thread" if meta["threads"] else "torch's default threads"
    return (f"{meta['device']} ({meta['machine']}), {meta.get('dtype_resolved', meta['dtype'])}, server on {threads}; "
            f"each client sends up to {meta['per_client']} streaming requests back to back, none after "
            f"{meta['seconds']:.0f} s (requests not admitted by then are cancelled: TTFT marked ≥ is a lower bound); "
            f"answers of exactly max_tokens tokens (ignore_eos) — {tokens}; greedy")


def format_table(report: dict) -> str:
    return "\n".join([describe(report["meta"]), *text_table(columns(), report["rows"]), "",
                      "batched beside serial:", *ratio_lines(report)])


def markdown(report: dict, plot: str | None = None) -> str:
    meta = report["meta"]
    lines = [
        "# Serving many clients: serial vs continuous batching",
        "",
        f"- command: `{meta['command'] or 'scripts/bench_serving.py'}`",
        f"- machine: {meta['machine']}; python {meta['python']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}",
        f"- date: {meta['date']}",
        f"- setup: {describe(meta)}",
        f"- servers: `pop-vlm serve` in a process of its own on loopback, `--max-batch-size 1` (serial) or "
        f"`--max-batch-size {meta['batch_size'] or max(2, *meta['clients'])}` (batched), with "
        + ", ".join(f"{k}={v}" for k, v in meta["server_env"].items()),
        "- TTFT: request sent to first text chunk; ITL: gaps between text chunks where each chunk is one token, "
        "else the request's mean time per token; rows/step: decode rows per batched step (server's /healthz); "
        "same as serial: batched answers equal to the serial server's for the same prompt and mode / answers compared",
        "",
        *markdown_table(columns(markdown=True), report["rows"]),
        "",
        "Batched beside serial (generated tokens/s and their ratio, TTFT p99, rows per batched step, answers equal "
        "to the serial ones / compared):",
        "",
        *ratio_lines(report, markdown=True),
    ]
    if plot:
        lines += ["", f"![throughput and TTFT p99 against clients]({plot})"]
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out, notes: str = "") -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {**report, "ratios": ratios(report["rows"])}
    json_path = write_json(report, out / "serving.json")
    png = out / "serving.png"
    plots.serving_sweep(report, png)
    md = out / "serving.md"
    md.write_text(markdown(report, png.name) + (("\n" + notes.strip() + "\n") if notes.strip() else ""))
    return [json_path, md, png]
