"""Benchmark outputs: Markdown tables (terminal and report.md), results.json, results.csv, PNG plots."""

from __future__ import annotations

import csv
import json
import math
import textwrap
from pathlib import Path

from .metrics import SPREAD_FLAG

MIB = 1 << 20
PLOTS = {
    "prefill": "prefill_tokens_per_s.png",
    "decode": "decode_tokens_per_s.png",
    "mbu": "mbu.png",
    "ppl": "perplexity_vs_bpw.png",
}


def _num(x, fmt: str = "{:.1f}", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return fmt.format(x)


def _si(x, unit: str = "") -> str:
    if x is None or not math.isfinite(x):
        return "–"
    for p, s in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= p:
            return f"{x / p:.2f} {s}{unit}"
    return f"{x:.2f} {unit}".strip()


def _multi_model(results: dict) -> bool:
    return len({c["model"] for c in results["configurations"]}) > 1


def _label(c: dict, multi: bool) -> list[str]:
    quant = c["quant"] + ("" if c["quantized"] else " (file)")
    return ([c["model"]] if multi else []) + [quant, c["engine"], c["backend"]]


def speed_table(results: dict) -> str:
    multi = _multi_model(results)
    head = (["model"] if multi else []) + ["quant", "engine", "backend", "test", "t/s (median)", "± sd", "min – max",
                                           "TTFT / TPOT ms", "FLOP/s", "MBU"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i < len(head) - 6 else "---:" for i in range(len(head))) + "|"]
    any_row = False
    for c in results["configurations"]:
        for t in c["tests"]:
            tps = t.get("tokens_per_s")
            if not tps:
                continue
            any_row = True
            flag = " ⚠" if tps.get("flagged") else ""
            lat = t.get("ttft_s") if t["kind"] == "pp" else t.get("tpot_s")
            fl = (t.get("flop_per_s") or {}).get("median")
            mbu = t.get("mbu")
            row = _label(c, multi) + [t["name"], f"{tps['median']:,.2f}{flag}", f"{tps['stddev']:,.2f}",
                                      f"{tps['min']:,.2f} – {tps['max']:,.2f}",
                                      _num(lat["median"] * 1e3 if lat else None, "{:,.2f}"), _si(fl, "FLOP/s"),
                                      _num(mbu * 100 if mbu is not None else None, "{:.2f}%")]
            lines.append("| " + " | ".join(row) + " |")
    if not any_row:
        lines.append("| " + " | ".join(["(no measurements)"] + [""] * (len(head) - 1)) + " |")
    return "\n".join(lines)


def config_table(results: dict) -> str:
    multi = _multi_model(results)
    head = (["model"] if multi else []) + ["quant", "engine", "backend", "status", "size MiB", "bits/weight",
                                           "TTLM s", "perplexity", "peak RSS MiB", "device peak MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for c in results["configurations"]:
        ttlm = c.get("ttlm_s")
        ppl = c.get("perplexity") or {}
        status = c["status"] if c["status"] in ("ok",) else f"**{c['status']}**"
        row = _label(c, multi) + [
            status, _num(c["size_bytes"] / MIB if c.get("size_bytes") else None, "{:.1f}"),
            _num(c.get("bits_per_weight"), "{:.2f}"),
            (f"{ttlm['median']:.2f}" + (" ⚠" if ttlm.get("flagged") else "")) if ttlm else "–",
            _num(ppl.get("ppl"), "{:.4f}") if "ppl" in ppl else
            ("error" if ppl.get("error") else "n/a" if ppl.get("skipped") else "–"),
            _num(c["peak_rss_bytes"] / MIB if c.get("peak_rss_bytes") else None, "{:.0f}"),
            _num(c["device_peak_bytes"] / MIB if c.get("device_peak_bytes") else None, "{:.0f}"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def comparison_table(results: dict) -> str | None:
    """Each engine's tokens/s beside the first engine's, per model, quant, backend and test."""
    engines = list(dict.fromkeys(c["engine"] for c in results["configurations"] if c["tests"]))
    if len(engines) < 2:
        return None
    base = engines[0]
    table: dict[tuple, dict[str, float]] = {}
    for c in results["configurations"]:
        for t in c["tests"]:
            if t.get("tokens_per_s"):
                table.setdefault((c["model"], c["quant"], c["backend"], t["name"]), {})[c["engine"]] = \
                    t["tokens_per_s"]["median"]
    multi = _multi_model(results)
    head = (["model"] if multi else []) + ["quant", "backend", "test"] + [f"{e} t/s" for e in engines] + \
        [f"{e} / {base}" for e in engines[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for (model, quant, backend, test), by in table.items():
        ratios = [_num(by[e] / by[base], "{:.2f}×") if e in by and by.get(base) else "–" for e in engines[1:]]
        row = ([model] if multi else []) + [quant, backend, test] + [_num(by.get(e), "{:,.2f}") for e in engines] + ratios
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


REFERENCES = ("llama.cpp", "transformers")  # perplexity references, preferred first


def perplexity_agreement(results: dict) -> list[dict]:
    """Relative perplexity difference of every engine from a reference engine (llama.cpp, else
    transformers) on the same file and the same tokens."""
    refs: dict[str, tuple[str, float]] = {}
    for ref in reversed(REFERENCES):
        for c in results["configurations"]:
            if c["engine"] == ref and (c.get("perplexity") or {}).get("ppl"):
                refs[c["path"]] = (ref, c["perplexity"]["ppl"])
    out = []
    for c in results["configurations"]:
        p = (c.get("perplexity") or {}).get("ppl")
        if not p or c["path"] not in refs:
            continue
        ref, ref_ppl = refs[c["path"]]
        if c["engine"] != ref:
            out.append({"id": c["id"], "engine": c["engine"], "backend": c["backend"], "quant": c["quant"],
                        "model": c["model"], "ppl": p, "reference": ref, "reference_ppl": ref_ppl,
                        "relative_difference": p / ref_ppl - 1})
    return out


def markdown(results: dict, plots: dict[str, str] | None = None) -> str:
    env = results["environment"]
    v = env["versions"]
    parts = ["# edgellm bench", ""]
    parts.append(f"Started {results.get('started', '')}, {results.get('elapsed_s', 0):.0f} s. "
                 f"Command: `{' '.join(results['command']) if results.get('command') else 'edgellm bench (API)'}`")
    parts.append("")
    for b, d in results["devices"].items():
        bw = d.get("bytes_per_s")
        parts.append(f"- device `{b}`: {d.get('device', '?')}; peak bandwidth "
                     f"{_si(bw, 'B/s') if bw else 'unknown (' + str(d.get('error')) + ')'}"
                     f"{' (' + d['source'] + ')' if d.get('source') else ''}"
                     f"{'; driver ' + d['driver'] if d.get('driver') else ''}")
    parts.append("- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) +
                 (f"; git {env['git_commit'][:12]}" if env.get("git_commit") else "")
                 + (" with uncommitted changes" if env.get("git_dirty") else ""))
    parts.append(f"- host: {env['host']['cpu']}, {env['host']['cpu_count']} cores, {env['host']['platform']}")
    plan = results["plan"]
    parts.append(f"- plan: -p {','.join(map(str, plan['prompt_lengths']))} -n {','.join(map(str, plan['gen_lengths']))}"
                 f" -r {plan['repetitions']}, timeout {plan['timeout_s']:g} s")
    parts += ["", "## Speed", "", speed_table(results), ""]
    parts.append(f"Medians of {plan['repetitions']} repetitions (each a fresh process after a warm-up). "
                 f"⚠: spread (max − min) / median above {SPREAD_FLAG:.0%}. "
                 "MBU = (weight bytes + KV bytes read per token) / TPOT / peak bandwidth, weight bytes as stored in "
                 "the file (an engine that keeps dequantized copies reads more than that).")
    cmp = comparison_table(results)
    if cmp:
        parts += ["", "## Side by side", "", cmp]
    parts += ["", "## Configurations", "", config_table(results)]
    agree = perplexity_agreement(results)
    if agree:
        parts += ["", "## Perplexity against the reference engine (same file, same tokens)", "",
                  "| engine | backend | quant | perplexity | reference | reference perplexity | difference |",
                  "|---|---|---|---:|---|---:|---:|"]
        for a in agree:
            parts.append(f"| {a['engine']} | {a['backend']} | {a['quant']} | {a['ppl']:.4f} | {a['reference']} "
                         f"| {a['reference_ppl']:.4f} | {a['relative_difference'] * 100:+.3f}% |")
    ppl_facts = next((c["perplexity"] for c in results["configurations"] if (c.get("perplexity") or {}).get("ppl")), None)
    if ppl_facts:
        parts += ["", f"Perplexity: {plan.get('ppl_file') or 'the shipped text (edgellm/data/perplexity_text.txt)'}, "
                      f"{ppl_facts['n_tokens']} tokens, {ppl_facts['n_chunks']} chunks of {ppl_facts['n_ctx']}, "
                      f"{ppl_facts['n_scored']} tokens scored (llama.cpp's method)."]
        note = requantized_note(results)
        if note:
            parts += ["", f"Note: {note} (the difference to the source is not that format's own error)."]
    flagged = [(c["id"], t["name"]) for c in results["configurations"] for t in c["tests"]
               if (t.get("tokens_per_s") or {}).get("flagged")]
    if flagged:
        parts += ["", "## Noisy measurements", ""] + [f"- {i} {n}: spread above {SPREAD_FLAG:.0%}" for i, n in flagged]
    problems = [c for c in results["configurations"] if c["status"] != "ok" or
                (c.get("perplexity") or {}).get("error") or (c.get("perplexity") or {}).get("skipped")]
    if problems:
        parts += ["", "## Not measured / failed", ""]
        for c in problems:
            if c["status"] != "ok":
                parts.append(f"- {c['id']}: **{c['status']}**: {c.get('error')}")
            if (c.get("perplexity") or {}).get("error"):
                parts.append(f"- {c['id']}: perplexity failed: {c['perplexity']['error']}")
            if (c.get("perplexity") or {}).get("skipped"):
                parts.append(f"- {c['id']}: no perplexity: {c['perplexity']['skipped']}")
    if plots:
        parts += ["", "## Plots", ""] + [f"![{k}]({name})" for k, name in plots.items()]
    elif results.get("plots_error"):
        parts += ["", results["plots_error"]]
    return "\n".join(parts) + "\n"


def terminal_summary(results: dict) -> str:
    parts = [speed_table(results), "", config_table(results)]
    cmp = comparison_table(results)
    if cmp:
        parts += ["", cmp]
    for a in perplexity_agreement(results):
        parts.append(f"\nperplexity {a['engine']}/{a['backend']} {a['ppl']:.4f} vs {a['reference']} "
                     f"{a['reference_ppl']:.4f}: {a['relative_difference'] * 100:+.3f}%")
    bad = [c for c in results["configurations"] if c["status"] != "ok"]
    if bad:
        parts.append("")
        parts += [f"{c['id']}: {c['status']}: {c.get('error')}" for c in bad]
    return "\n".join(parts)


CSV_FIELDS = ["model", "quant", "quantized", "bits_per_weight", "size_bytes", "engine", "backend", "status", "error",
              "test", "kind", "tokens", "tokens_per_s_median", "tokens_per_s_stddev", "tokens_per_s_min",
              "tokens_per_s_max", "spread", "flagged", "ttft_s_median", "tpot_s_median", "flop_per_s_median", "mbu",
              "weight_bytes_per_token", "kv_bytes_per_token", "ttlm_s_median", "perplexity", "peak_rss_bytes",
              "device_peak_bytes", "path"]


def write_csv(results: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for c in results["configurations"]:
            base = {k: c.get(k) for k in ("model", "quant", "quantized", "bits_per_weight", "size_bytes", "engine",
                                          "backend", "status", "error", "peak_rss_bytes", "device_peak_bytes", "path")}
            base["ttlm_s_median"] = (c.get("ttlm_s") or {}).get("median")
            base["perplexity"] = (c.get("perplexity") or {}).get("ppl")
            if not c["tests"]:
                w.writerow(base)
            for t in c["tests"]:
                tps = t.get("tokens_per_s") or {}
                w.writerow(dict(base, test=t["name"], kind=t["kind"], tokens=t["tokens"],
                                tokens_per_s_median=tps.get("median"), tokens_per_s_stddev=tps.get("stddev"),
                                tokens_per_s_min=tps.get("min"), tokens_per_s_max=tps.get("max"),
                                spread=tps.get("spread"), flagged=tps.get("flagged"),
                                ttft_s_median=(t.get("ttft_s") or {}).get("median"),
                                tpot_s_median=(t.get("tpot_s") or {}).get("median"),
                                flop_per_s_median=(t.get("flop_per_s") or {}).get("median"), mbu=t.get("mbu"),
                                weight_bytes_per_token=t.get("weight_bytes_per_token"),
                                kv_bytes_per_token=t.get("kv_bytes_per_token")))


# -- plots -----------------------------------------------------------------------------------------
def _bars(ax, groups: list[str], series: dict[str, dict[str, tuple[float, float, float]]], ylabel: str) -> None:
    """Grouped bars: series name -> group -> (value, low, high)."""
    import numpy as np

    n = max(len(series), 1)
    width = 0.8 / n
    x = np.arange(len(groups))
    for i, (name, vals) in enumerate(series.items()):
        ys = [vals.get(g, (np.nan, np.nan, np.nan)) for g in groups]
        v = np.array([y[0] for y in ys], dtype=float)
        err = np.array([[y[0] - y[1] for y in ys], [y[2] - y[0] for y in ys]], dtype=float)
        bars = ax.bar(x - 0.4 + width * (i + 0.5), v, width, yerr=np.nan_to_num(err), capsize=3, label=name)
        # the median on each bar (above its error bar); no label where a group has no value
        ax.bar_label(bars, labels=["" if not np.isfinite(y) else _short(y) for y in v], padding=2, fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels(groups, rotation=20 if len(groups) > 4 else 0, ha="right" if len(groups) > 4 else "center")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if series:
        ax.legend(fontsize=8)


def _short(y: float) -> str:
    """A bar's value in three significant digits or so: 1,234 / 98.7 / 0.512."""
    return f"{y:,.0f}" if abs(y) >= 100 else f"{y:.1f}" if abs(y) >= 10 else f"{y:.3g}"


def plot_subtitle(results: dict) -> str:
    """What the plots measured: the model(s), the device(s) and the date of the run."""
    models = ", ".join(dict.fromkeys(c["model"] for c in results["configurations"])) or "no model"
    devices = "; ".join(f"{b}: {d.get('device') or '?'}" for b, d in (results.get("devices") or {}).items())
    date = (results.get("started") or "")[:10]
    return " · ".join(x for x in (models, devices, date) if x)


def requantized_note(results: dict) -> str | None:
    """Which quantizations were made from an already-quantized file (their error includes the source's)."""
    by_source: dict[str, list[str]] = {}
    for c in results["configurations"]:
        if c.get("requantized_from"):
            qs = by_source.setdefault(f"{c['model']} ({c['requantized_from']})", [])
            if c["quant"] not in qs:
                qs.append(c["quant"])
    if not by_source:
        return None
    return ("re-quantized from an already-quantized file, so they carry its quantization error too: "
            + "; ".join(f"{', '.join(qs)} from {src}" for src, qs in by_source.items()))


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def make_figures(results: dict) -> dict:
    """The plots as matplotlib figures (key -> Figure; the caller closes them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multi = _multi_model(results)
    confs = results["configurations"]
    subtitle = plot_subtitle(results)

    def group(c):
        return (f"{c['model']} " if multi else "") + c["quant"]

    groups = list(dict.fromkeys(group(c) for c in confs if c["tests"]))
    figures = {}
    for key, kind, title, ylabel in (("prefill", "pp", "Prefill (pp) tokens/s", "tokens/s"),
                                     ("decode", "tg", "Decode (tg) tokens/s", "tokens/s"),
                                     ("mbu", "tg", "Decode memory bandwidth utilisation", "MBU (%)")):
        series: dict[str, dict[str, tuple]] = {}
        for c in confs:
            for t in c["tests"]:
                if t["kind"] != kind or not t.get("tokens_per_s"):
                    continue
                name = f"{c['engine']}/{c['backend']} {t['name']}"
                if key == "mbu":
                    ms = [m for m in (t.get("mbu_samples") or []) if m is not None]
                    if t.get("mbu") is None or not ms:
                        continue
                    series.setdefault(name, {})[group(c)] = (100 * t["mbu"], 100 * min(ms), 100 * max(ms))
                else:
                    s = t["tokens_per_s"]
                    series.setdefault(name, {})[group(c)] = (s["median"], s["min"], s["max"])
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 3), 4.6))
        if series:
            _bars(ax, groups, series, ylabel)
        else:
            _empty(ax, "no data")
        ax.set_title(f"{title} (median, min–max)\n{subtitle}", fontsize=10)
        fig.tight_layout()
        figures[key] = fig

    fig, ax = plt.subplots(figsize=(6.5, 4.6))
    pts: dict[str, list[tuple[float, float, str, str | None]]] = {}
    for c in confs:
        p = (c.get("perplexity") or {}).get("ppl")
        if p and c.get("bits_per_weight"):
            pts.setdefault(f"{c['engine']}/{c['backend']}" + (f" {c['model']}" if multi else ""), []).append(
                (c["bits_per_weight"], p, c["quant"], c.get("requantized_from")))
    if pts:
        for name, xs in pts.items():
            xs.sort()
            line, = ax.plot([x[0] for x in xs], [x[1] for x in xs], "o-", label=name)
            for bpw, p, q, src in xs:
                if src:  # hollow marker: made from a quantized file, not from the original weights
                    ax.plot([bpw], [p], "o", markersize=11, markerfacecolor="white", color=line.get_color())
                ax.annotate(q + (f" (from {src})" if src else ""), (bpw, p), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        ax.set_xlabel("bits per weight (file)")
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no perplexity measured")
    ax.set_title(f"Perplexity vs bits per weight\n{subtitle}", fontsize=10)
    note = requantized_note(results) if pts else None
    if note:  # under the axes, wrapped to the figure's width
        note = textwrap.fill("Hollow markers: " + note + ".", 100)
        fig.text(0.01, 0.01, note, fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.035 * (note.count("\n") + 1) + 0.01, 1, 1))
    else:
        fig.tight_layout()
    figures["ppl"] = fig
    return figures


def write_plots(results: dict, out_dir: Path) -> dict[str, str]:
    figures = make_figures(results)
    import matplotlib.pyplot as plt

    written = {}
    for key, fig in figures.items():
        fig.savefig(out_dir / PLOTS[key], dpi=110)
        plt.close(fig)
        written[key] = PLOTS[key]
    return written


def write_outputs(results: dict, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    if not any(c["tests"] for c in results["configurations"]):
        results["plots_error"] = "no plots: nothing was measured"
    else:
        try:
            plots = write_plots(results, out_dir)
        except ImportError as e:  # results matter more than pictures: keep the rest
            results["plots_error"] = f"no plots: matplotlib is not installed ({e})"
    files = ["results.json", "results.csv", "report.md"] + list(plots.values())
    results["files"] = files
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_csv(results, out_dir / "results.csv")
    (out_dir / "report.md").write_text(markdown(results, plots))
    return files
