"""Builds the benchmark dashboard: one static HTML page from the history, viewable offline.

  python -m bench.dashboard [--history bench/history.jsonl] [--out bench/out/site/index.html]

The page carries its data and its plotting code inline (no network, no CDN):
a table of every series' latest value against its baseline (flagged by the
regression rule of `bench.history.verdict`), and per op and benchmark, SVG
plots of the median device time per series over commits, the time relative to
XLA and to cuDNN in the same run, and the numerics drift against the reference
(in tolerance bounds). A series is one implementation measured by one timer
method ("xla [cupti]", "xla [wallclock]"): a change of timer starts a new
series and is never drawn as a speed-up or slowdown. A device selector,
hover read-outs and legend toggles make it interactive. When the script has
drawn everything it sets `data-status="ok"` and `data-plots` on <body>; a
JavaScript error sets `data-errors` (the headless-browser test reads both).
"""

import argparse
import html
import json
import os
import sys

from bench import history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Built, not committed (the folder is ignored).
OUT = os.path.join(ROOT, "bench", "out", "site", "index.html")

# Fields the page needs from each record.
FIELDS = (
  "run_id",
  "commit",
  "date",
  "device_kind",
  "jax_version",
  "op",
  "implementation",
  "case",
  "shape_key",
  "dtype",
  "mode",
  "device_time_median_ms",
  "device_time_method",
  "tflops_per_s",
  "gb_per_s",
  "peak_memory_bytes",
  "drift_ratio",
  "drift_ok",
)


def _device(r: dict) -> str:
  """The device entry of a record (CPU runs: one per kind of host)."""
  return f"{r.get('device_kind')} ({r['host']})" if r.get("host") else r.get("device_kind")


def series_table(
  records: list[dict],
  *,
  threshold: float = history.THRESHOLD,
  k: float = history.NOISE_K,
  window: int = history.WINDOW,
) -> list[dict]:
  """Per series (`history.IDENTITY`: timer method included), its latest value against its baseline.

  The baseline is the series' last `window` earlier runs; `status` is
  "SLOWER", "ok" or "no baseline yet" by `history.verdict`.
  """
  by_series: dict[tuple, list[dict]] = {}
  for r in sorted(records, key=lambda r: r.get("date", "")):
    if r.get("device_time_median_ms") is not None:
      by_series.setdefault(history.identity(r), []).append(r)
  rows = []
  for recs in by_series.values():
    latest = recs[-1]
    past = [h for h in recs if h.get("run_id") != latest.get("run_id")][-window:]
    v = history.verdict(latest, past, threshold=threshold, k=k)
    now = latest["device_time_median_ms"]
    rows.append(
      {
        "device_kind": _device(latest),
        "op": latest.get("op"),
        "implementation": latest.get("implementation"),
        "method": latest.get("device_time_method"),
        "bench": _bench(latest),
        "commit": latest.get("commit"),
        "latest_ms": now,
        "baseline_ms": v.baseline_ms,
        "ratio": now / v.baseline_ms if v.baseline_ms else None,
        "limit": v.limit,
        "runs": v.runs,
        "status": history.NO_BASELINE if v.slower is None else "SLOWER" if v.slower else "ok",
      }
    )
  rows.sort(key=lambda t: (t["status"] != "SLOWER", t["op"], t["bench"], t["implementation"]))
  return rows


def _bench(r: dict) -> str:
  shape = r.get("shape_key") or history.shape_key(r.get("shapes", {}))
  return f"{r.get('case')} {shape} {r.get('dtype')} {r.get('mode')}"


def page_data(records: list[dict]) -> dict:
  """The records, trimmed to what the page plots, ordered by date; the series table."""
  rows = []
  for r in sorted(records, key=lambda r: r.get("date", "")):
    row = {k: r.get(k) for k in FIELDS}
    row["shape_key"] = row["shape_key"] or history.shape_key(r.get("shapes", {}))
    row["device_kind"] = _device(r)
    rows.append(row)
  return {"records": rows, "table": series_table(records)}


SCRIPT = r"""
"use strict";
(function () {
  const errors = [];
  window.addEventListener("error", (e) => {
    errors.push(String(e.message));
    document.body.dataset.errors = errors.join(" | ");
  });
  const DATA = JSON.parse(document.getElementById("data").textContent);
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                  "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
  const SVGNS = "http://www.w3.org/2000/svg";
  const hidden = new Set();  // implementations toggled off in the legends

  function el(tag, attrs, parent, text) {
    const node = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4))
                                        : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "-";
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : (+v.toPrecision(4)).toString();
  }
  function groupBy(items, key) {
    const m = new Map();
    for (const it of items) {
      const k = key(it);
      if (!m.has(k)) m.set(k, []);
      m.get(k).push(it);
    }
    return m;
  }

  // One line plot: series = [{name, color, points: [{x, y, label}]}]; x = run index.
  function plot(parent, title, series, runs, opts) {
    const W = 360, H = 230, L = 56, R = 28, T = 26, B = 42;
    const box = el("div", {class: "plotbox"}, parent);
    const svg = el("svg:svg", {class: "plot", width: W, height: H, viewBox: `0 0 ${W} ${H}`,
                               "data-title": title}, box);
    el("svg:text", {x: L, y: 16, class: "title"}, svg, title);
    const ys = series.flatMap((s) => s.points.map((p) => p.y)).filter((y) => isFinite(y));
    if (opts.ref !== undefined) ys.push(opts.ref);
    if (!ys.length) {
      el("svg:text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, svg,
         "no data");
      return;
    }
    let lo = Math.min(...ys), hi = Math.max(...ys);
    if (opts.zero) lo = Math.min(0, lo);
    if (hi === lo) { hi = hi + (Math.abs(hi) || 1) * 0.1; lo = lo - (Math.abs(lo) || 1) * 0.1; }
    const pad = (hi - lo) * 0.08; hi += pad; if (!opts.zero) lo -= pad;
    const n = Math.max(runs.length - 1, 1);
    const X = (i) => L + (W - L - R) * (runs.length === 1 ? 0.5 : i / n);
    const Y = (y) => T + (H - T - B) * (1 - (y - lo) / (hi - lo));
    for (let k = 0; k <= 4; k++) {
      const v = lo + (hi - lo) * k / 4;
      el("svg:line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid"}, svg);
      el("svg:text", {x: L - 4, y: Y(v) + 4, "text-anchor": "end", class: "tick"}, svg, fmt(v));
    }
    runs.forEach((run, i) => {
      el("svg:text", {x: X(i), y: H - B + 14, "text-anchor": "middle", class: "tick"}, svg,
         run.commit.slice(0, 7));
    });
    el("svg:text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis"}, svg,
       "commit (oldest to newest)");
    if (opts.ref !== undefined) {
      el("svg:line", {x1: L, x2: W - R, y1: Y(opts.ref), y2: Y(opts.ref), class: "refline"}, svg);
    }
    const tip = el("div", {class: "tip"}, box);
    for (const s of series) {
      if (hidden.has(s.name)) continue;
      const pts = s.points.filter((p) => isFinite(p.y));
      if (!pts.length) continue;
      const d = pts.map((p, j) => `${j ? "L" : "M"}${X(p.x).toFixed(1)},${Y(p.y).toFixed(1)}`);
      el("svg:path", {d: d.join(""), stroke: s.color, class: "line" + (s.dashed ? " dashed" : ""),
                      "data-series": s.name}, svg);
      for (const p of pts) {
        const c = el("svg:circle", {cx: X(p.x), cy: Y(p.y), r: 3.5, stroke: s.color,
                                     fill: p.hollow ? "#fff" : s.color, class: "pt"}, svg);
        c.addEventListener("mouseenter", () => {
          tip.textContent = `${s.name} @ ${runs[p.x].commit.slice(0, 10)}: ${p.label}`;
          tip.style.display = "block";
        });
        c.addEventListener("mouseleave", () => { tip.style.display = "none"; });
      }
    }
  }

  function legend(parent, names, color) {
    const div = el("div", {class: "legend"}, parent);
    for (const name of names) {
      const item = el("span", {class: "item" + (hidden.has(name) ? " off" : "")}, div);
      el("span", {class: "swatch", style: `background:${color(name)}`}, item);
      el("span", {}, item, name);
      item.addEventListener("click", () => {
        if (hidden.has(name)) hidden.delete(name); else hidden.add(name);
        render();
      });
    }
  }

  // A series: one implementation timed by one method (never joined across methods).
  const seriesName = (impl, method) => method ? `${impl} [${method}]` : impl;
  const nameOf = (r) => seriesName(r.implementation, r.device_time_method);

  function table(parent, rows) {
    const t = el("table", {id: "latest"}, parent);
    const head = el("tr", {}, el("thead", {}, t));
    for (const h of ["status", "op", "benchmark", "series (implementation [timer])",
                     "latest ms", "baseline median ms", "latest / baseline", "limit", "runs",
                     "commit"]) {
      el("th", {}, head, h);
    }
    const body = el("tbody", {}, t);
    for (const row of rows) {
      const tr = el("tr", {class: row.status === "SLOWER" ? "regressed" : "",
                           "data-status": row.status}, body);
      el("td", {}, tr, row.status);
      el("td", {}, tr, row.op);
      el("td", {}, tr, row.bench);
      el("td", {}, tr, seriesName(row.implementation, row.method));
      el("td", {}, tr, fmt(row.latest_ms));
      el("td", {}, tr, fmt(row.baseline_ms));
      el("td", {}, tr, row.ratio === null ? "-" : fmt(row.ratio));
      el("td", {}, tr, row.limit === null ? "-" : `+${(100 * row.limit).toFixed(1)}%`);
      el("td", {}, tr, String(row.runs));
      el("td", {}, tr, (row.commit || "").slice(0, 7));
    }
  }

  function render() {
    const main = document.getElementById("plots");
    main.textContent = "";
    const device = document.getElementById("device").value;
    const recs = DATA.records.filter((r) => r.device_kind === device);
    const rows = DATA.table.filter((t) => t.device_kind === device);
    el("h2", {}, main, "Latest value per series against its baseline");
    el("p", {class: "empty"}, main,
       "SLOWER: the latest median past max(threshold, 3 x noise) of the baseline runs' " +
       "median, three rounds in four past the threshold and its ratio to its anchor past " +
       "the baseline's likewise (bench.history's rule; noise: the baseline's spread, the " +
       "rounds' standard error, the timer's floor); " +
       "no verdict with fewer than 3 baseline runs.");
    table(main, rows);
    document.body.dataset.regressed = String(rows.filter((t) => t.status === "SLOWER").length);
    // One x position per commit (oldest first); a commit may hold several runs.
    const runIds = [...new Set(recs.map((r) => r.run_id))];
    const commits = [...new Set(recs.map((r) => r.commit))];
    const runs = commits.map((commit) => ({commit}));
    const runIndex = new Map(recs.map((r) => [r.run_id, commits.indexOf(r.commit)]));
    const impls = [...new Set(recs.map((r) => r.implementation))].sort();
    const color = (name) => COLORS[impls.indexOf(name) % COLORS.length];
    document.getElementById("summary").textContent =
      `${recs.length} measurements, ${runIds.length} runs at ${commits.length} commits: ` +
      commits.map((c) => c.slice(0, 7)).join(", ") +
      " (hollow points and dashed lines: wallclock time, a separate series from CUPTI time)";
    let count = 0;
    for (const [op, opRecs] of groupBy(recs, (r) => r.op)) {
      const section = el("section", {class: "op", id: "op-" + op}, main);
      el("h2", {}, section, op);
      const keyOf = (r) => `${r.case} ${r.shape_key} ${r.dtype} ${r.mode}`;
      for (const [bench, bRecs] of groupBy(opRecs, keyOf)) {
        el("h3", {}, section, bench);
        const names = [...new Set(bRecs.map(nameOf))].sort();
        const bySeries = groupBy(bRecs, nameOf);
        const implOf = (name) => bySeries.get(name)[0].implementation;
        legend(section, names, (name) => color(implOf(name)));
        const row = el("div", {class: "row"}, section);
        const timeOf = new Map(bRecs.map((r) => [r.run_id + "|" + nameOf(r),
                                                 r.device_time_median_ms]));
        const series = (value) => names.map((name) => ({
          name, color: color(implOf(name)),
          dashed: bySeries.get(name)[0].device_time_method === "wallclock",
          points: bySeries.get(name).map((r) => {
            const y = value(r);
            return {x: runIndex.get(r.run_id), y: y === null ? NaN : y,
                    hollow: r.device_time_method === "wallclock",
                    label: `${fmt(y)} (median ${fmt(r.device_time_median_ms)} ms ` +
                           `${r.device_time_method || ""}, ` +
                           `${r.tflops_per_s ? fmt(r.tflops_per_s) + " TFLOP/s, " : ""}` +
                           `${r.gb_per_s ? fmt(r.gb_per_s) + " GB/s, " : ""}` +
                           `jax ${r.jax_version})`};
          }),
        }));
        // Against the base implementation timed by the same method in the same run.
        const ratioTo = (base) => (r) => {
          const t = timeOf.get(r.run_id + "|" + seriesName(base, r.device_time_method));
          return t ? r.device_time_median_ms / t : null;
        };
        const impls = new Set(bRecs.map((r) => r.implementation));
        plot(row, "median device time (ms)", series((r) => r.device_time_median_ms), runs,
             {zero: true});
        count++;
        if (impls.has("xla") && impls.size > 1) {
          plot(row, "time / XLA (same run; < 1 is faster)", series(ratioTo("xla")), runs,
               {ref: 1, zero: true});
          count++;
        }
        if (impls.has("cudnn") && impls.size > 1) {
          plot(row, "time / cuDNN (same run; < 1 is faster)", series(ratioTo("cudnn")), runs,
               {ref: 1, zero: true});
          count++;
        }
        plot(row, "numerics drift (max error / tolerance bound)",
             series((r) => r.drift_ratio), runs, {ref: 1, zero: true});
        count++;
      }
    }
    if (!recs.length) el("p", {class: "empty"}, main, "No measurements for this device.");
    document.body.dataset.plots = String(count);
  }

  const select = document.getElementById("device");
  const devices = [...new Set(DATA.records.map((r) => r.device_kind))].sort(
    (a, b) => a.startsWith("cpu") - b.startsWith("cpu") || a.localeCompare(b));
  for (const d of devices) el("option", {value: d}, select, d);
  select.addEventListener("change", render);
  render();
  document.body.dataset.status = errors.length ? "error" : "ok";
})();
"""

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 8px; }
h2 { font-size: 17px; border-bottom: 1px solid #ccc; margin-top: 28px; }
h3 { font-size: 13px; font-weight: 600; margin: 14px 0 4px; font-family: monospace; }
.row { display: flex; flex-wrap: wrap; gap: 8px; }
.plotbox { position: relative; border: 1px solid #e4e4e4; border-radius: 4px; }
svg.plot .title { font-size: 12px; font-weight: 600; }
svg.plot .tick { font-size: 10px; fill: #555; }
svg.plot .axis { font-size: 10px; fill: #777; }
svg.plot .grid { stroke: #eee; }
svg.plot .refline { stroke: #999; stroke-dasharray: 4 3; }
svg.plot .line { fill: none; stroke-width: 2; }
svg.plot .line.dashed { stroke-dasharray: 5 3; }
table#latest { border-collapse: collapse; font-size: 12px; margin-bottom: 8px; }
table#latest th, table#latest td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
table#latest tr.regressed td { background: #fde2e2; font-weight: 600; }
svg.plot .pt { cursor: pointer; }
.tip { display: none; position: absolute; left: 60px; top: 24px; background: #fff;
       border: 1px solid #999; padding: 2px 6px; font-size: 11px; pointer-events: none; }
.legend { margin: 2px 0 4px; }
.legend .item { cursor: pointer; margin-right: 12px; user-select: none; }
.legend .item.off { opacity: 0.35; }
.legend .swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
.empty { color: #888; }
"""


def build(records: list[dict]) -> str:
  """The page's HTML."""
  data = json.dumps(page_data(records), separators=(",", ":")).replace("</", "<\\/")
  return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>tokamax benchmark history</title>
<style>{STYLE}</style></head>
<body data-status="loading">
<h1>tokamax benchmark history</h1>
<p>Device: <select id="device"></select> <span id="summary"></span></p>
<p class="empty">Median device time per series (an implementation and its timer method,
CUPTI or wallclock, never joined) over commits, time relative to XLA and cuDNN measured in the
same run by the same timer, and numerics drift against the high-precision reference
(above 1: past tolerance). Click a legend entry to hide or show a series; hover a
point for its values. Built from {html.escape(os.path.relpath(history.HISTORY, ROOT))}.</p>
<div id="plots"></div>
<script type="application/json" id="data">{data}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--history", default=history.HISTORY)
  parser.add_argument("--out", default=OUT)
  args = parser.parse_args(argv)
  records = history.load(args.history)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(build(records))
  runs = len({r.get("run_id") for r in records})
  print(f"wrote {args.out}: {len(records)} records, {runs} runs")
  return 0


if __name__ == "__main__":
  sys.exit(main())
