"""The dashboard: built from a history, it loads in headless Chromium without errors and draws its plots."""

import json
import os
import re
import shutil
import subprocess

import pytest

from bench import dashboard, history

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHROMIUM = "/usr/bin/chromium"
FLAGS = (
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--enable-logging=stderr",
  "--v=0",
  "--virtual-time-budget=5000",
)


def _records() -> list[dict]:
  """Two commits of one device: xla, a second implementation, and a cuDNN stand-in."""
  out = []
  base = {
    "device_kind": "NVIDIA H200",
    "jax_version": "0.11.2",
    "op": "dot_product_attention",
    "case": "plain",
    "shapes": {"b": 4, "t": 4096},
    "shape_key": "b=4,t=4096",
    "dtype": "bfloat16",
    "mode": "fwd",
    "tflops_per_s": 600.0,
    "gb_per_s": None,
    "peak_memory_bytes": 1 << 30,
    "drift_ok": True,
  }
  for i, commit in enumerate(("1111111aaaa", "2222222bbbb")):
    for impl, ms, drift in (("xla", 3.0, 0.2), ("cudnn", 1.6, 0.3), ("triton", 2.0 - i, 0.25)):
      out.append(
        dict(
          base,
          run_id=f"{commit}@{i}",
          commit=commit,
          date=f"2026-01-0{i + 1}T00:00:00+00:00",
          implementation=impl,
          device_time_median_ms=ms,
          drift_ratio=drift,
        )
      )
  out.append(dict(out[0], op="layer_norm", implementation="xla", host="x86 x2", device_kind="cpu"))
  return out


def test_page_is_offline_and_carries_its_data(tmp_path):
  page = dashboard.build(_records())
  assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page loads nothing"
  assert "1111111aaaa" in page and "<svg" not in page.split("<script")[0]


def _chromium(tmp_path, *args) -> subprocess.CompletedProcess:
  profile = tmp_path / "profile"
  profile.mkdir(exist_ok=True)
  return subprocess.run(
    [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=tmp_path,
  )


def _console_messages(stderr: str) -> list[str]:
  """Every console message the page logged (the dashboard logs none: any is a fault)."""
  return [line for line in stderr.splitlines() if ":CONSOLE" in line]


needs_chromium = pytest.mark.skipif(
  not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"
)


@needs_chromium
def test_a_planted_script_error_is_seen(tmp_path):
  page = tmp_path / "index.html"
  page.write_text(
    dashboard.build(_records()).replace("</body>", "<script>noSuchFn()</script></body>")
  )
  dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
  assert any("noSuchFn" in m for m in _console_messages(dom.stderr)), dom.stderr[-2000:]
  assert "data-errors" in re.search(r"<body[^>]*>", dom.stdout).group(0)


@pytest.mark.skipif(
  not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"
)
def test_dashboard_loads_in_chromium_and_shows_its_plots(tmp_path):
  hist = tmp_path / "history.jsonl"
  history.append(_records(), str(hist))
  page = tmp_path / "index.html"
  assert dashboard.main(["--history", str(hist), "--out", str(page)]) == 0
  url = page.as_uri()
  dom = _chromium(tmp_path, "--dump-dom", url)
  assert dom.returncode == 0, dom.stderr[-2000:]
  assert not _console_messages(dom.stderr), _console_messages(dom.stderr)
  body = re.search(r"<body[^>]*>", dom.stdout).group(0)
  assert 'data-status="ok"' in body and "data-errors" not in body, body
  # The H200 device: time, time/XLA, time/cuDNN and drift plots for one benchmark.
  assert 'data-plots="4"' in body, body
  plots = re.findall(r'<svg class="plot".*?</svg>', dom.stdout, re.S)
  assert len(plots) == 4
  for svg in plots:
    assert svg.count('class="line"') == 3, svg[:300]  # One line per implementation.
  shot = _chromium(tmp_path, "--screenshot=shot.png", "--window-size=1400,900", url)
  assert shot.returncode == 0 and not _console_messages(shot.stderr)
  png = (tmp_path / "shot.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_committed_history_builds(tmp_path):
  records = history.load()
  out = tmp_path / "index.html"
  assert dashboard.main(["--out", str(out)]) == 0
  assert out.read_text().count('"run_id"') == len(records)


@needs_chromium
def test_page_of_the_committed_history_loads_in_chromium(tmp_path):
  """The real history (H200 runs at several commits where committed): loads clean, draws every op."""
  records = history.load()
  if not records:
    pytest.skip("bench/history.jsonl holds no records yet")
  page = tmp_path / "index.html"
  assert dashboard.main(["--out", str(page)]) == 0
  dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
  assert dom.returncode == 0 and not _console_messages(dom.stderr), dom.stderr[-2000:]
  body = re.search(r"<body[^>]*>", dom.stdout).group(0)
  assert 'data-status="ok"' in body and "data-errors" not in body, body
  # The first device in the selector (an accelerator where there is one) has a section per op.
  kinds = sorted({r["device_kind"] for r in records if not r.get("host")})
  if kinds:
    mine = [r for r in records if r["device_kind"] == kinds[0]]
    for op in {r["op"] for r in mine}:
      assert f'id="op-{op}"' in dom.stdout, op
    commits = {r["commit"] for r in mine}
    summary = re.search(r'<span id="summary">([^<]*)</span>', dom.stdout).group(1)
    assert f"at {len(commits)} commits" in summary, summary
  plots = re.findall(r'<svg class="plot".*?</svg>', dom.stdout, re.S)
  assert plots and all("<circle" in p or "no data" in p for p in plots)


# --- series by timer method, and the table (the page's script run in Node with a small DOM) ----

NODE = shutil.which("node")

DOM_SHIM = r"""
class Node {
  constructor(tag) { this.tag = tag; this.children = []; this.attrs = {}; this.dataset = {};
                     this.style = {}; this.text = ""; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  appendChild(c) { this.children.push(c); return c; }
  set textContent(t) { this.text = String(t); this.children = []; }
  get textContent() { return this.text + this.children.map((c) => c.textContent).join(""); }
  get value() { return this._value ?? (this.children[0] ? this.children[0].attrs.value : ""); }
  set value(v) { this._value = v; }
  addEventListener() {}
}
const nodes = {};
for (const id of ["device", "plots", "summary"]) nodes[id] = new Node("x");
nodes.data = {textContent: require("fs").readFileSync(process.argv[2], "utf8")};
global.window = {addEventListener() {}};
global.document = {
  body: new Node("body"),
  getElementById: (id) => nodes[id],
  createElement: (tag) => new Node(tag),
  createElementNS: (ns, tag) => new Node(tag),
};
"""

DOM_DUMP = r"""
const all = [];
(function walk(n) { all.push(n); n.children.forEach(walk); })(nodes.plots);
const plots = all.filter((n) => n.tag === "svg").map((svg) => ({
  title: svg.attrs["data-title"],
  series: svg.children.filter((c) => c.tag === "path").map((c) => c.attrs["data-series"]),
}));
const legend = all.filter((n) => n.attrs.class && n.attrs.class.startsWith("item"))
  .map((n) => n.textContent);
const rows = all.filter((n) => n.tag === "tr" && n.attrs["data-status"] !== undefined)
  .map((n) => ({status: n.attrs["data-status"], cls: n.attrs.class,
                cells: n.children.map((c) => c.textContent)}));
console.log(JSON.stringify({body: document.body.dataset, plots, legend, rows}));
"""


def _run_page_script(tmp_path, records: list[dict]) -> dict:
  """The page's script run in Node against a small DOM: its plots, legend and table."""
  data = tmp_path / "data.json"
  data.write_text(json.dumps(dashboard.page_data(records)))
  script = tmp_path / "page.js"
  script.write_text(DOM_SHIM + dashboard.SCRIPT + DOM_DUMP)
  out = subprocess.run(
    [NODE, str(script), str(data)], capture_output=True, text=True, timeout=60, check=True
  )
  return json.loads(out.stdout)


def _timed(commit: str, day: int, ms: float, method: str, impl: str = "xla") -> dict:
  return {
    "run_id": f"{commit}@{day}",
    "commit": commit,
    "date": f"2026-01-{day:02d}T00:00:00+00:00",
    "device_kind": "NVIDIA H200",
    "jax_version": "0.11.2",
    "op": "layer_norm",
    "case": "plain",
    "shapes": {"n": 4096},
    "shape_key": "n=4096",
    "dtype": "bfloat16",
    "mode": "fwd",
    "implementation": impl,
    "device_time_median_ms": ms,
    "device_time_min_ms": ms * 0.98,
    "device_time_method": method,
    "drift_ratio": 0.1,
    "drift_ok": True,
  }


def test_wallclock_then_cupti_gives_two_series(tmp_path):
  """A change of timer (wallclock 6 ms, then CUPTI 1 ms) is two series, not a 6x speed-up."""
  records = [_timed("aaaaaaa1", 1, 6.0, "wallclock"), _timed("bbbbbbb2", 2, 1.0, "cupti")]
  table = dashboard.series_table(records)
  assert sorted(t["method"] for t in table) == ["cupti", "wallclock"]
  assert all(t["runs"] == 0 and t["status"] == "no baseline yet" for t in table), table
  if NODE is None:
    pytest.skip("node is absent: the page's script is not run")
  page = _run_page_script(tmp_path, records)
  time_plot = next(p for p in page["plots"] if p["title"].startswith("median device time"))
  assert sorted(time_plot["series"]) == ["xla [cupti]", "xla [wallclock]"], page
  assert sorted(page["legend"]) == ["xla [cupti]", "xla [wallclock]"], page
  assert page["body"]["regressed"] == "0" and len(page["rows"]) == 2


def test_baseline_is_the_latest_runs_and_cpu_hosts_are_named():
  """The baseline is the last `window` runs before the latest (2 here), not the first ones; a CPU
  series names its host."""
  records = [_timed(f"w{d}", d, ms, "cupti") for d, ms in enumerate((1.0, 1.0, 2.0, 2.0, 2.0), 1)]
  (row,) = dashboard.series_table(records, window=2)
  assert (row["baseline_ms"], row["ratio"], row["runs"]) == (2.0, 1.0, 2)
  cpu = [dict(r, device_kind="cpu", host=h) for r in records[:1] for h in ("x86 x2", "arm x4")]
  assert sorted(t["device_kind"] for t in dashboard.series_table(cpu)) == [
    "cpu (arm x4)",
    "cpu (x86 x2)",
  ]


def test_table_flags_a_planted_regression(tmp_path):
  """Four quiet CUPTI runs at 1.0 ms, then 1.3 ms: flagged; the unchanged series is not."""
  records = []
  for day, ms in enumerate((1.0, 1.01, 0.99, 1.0, 1.3), start=1):
    records.append(_timed(f"c{day}", day, ms, "cupti"))
    records.append(_timed(f"c{day}", day, 2.0, "cupti", impl="triton"))
  rows = dashboard.series_table(records)
  assert [t["status"] for t in rows] == ["SLOWER", "ok"]  # Regressions lead the table.
  table = {t["implementation"]: t for t in rows}
  assert table["xla"]["status"] == "SLOWER" and table["xla"]["baseline_ms"] == 1.0
  assert table["xla"]["ratio"] == pytest.approx(1.3) and table["xla"]["runs"] == 4
  assert table["triton"]["status"] == "ok" and table["triton"]["ratio"] == 1.0
  # Noise within the baseline's own spread is not flagged (the rule of bench.history).
  noisy = [_timed(f"n{d}", d, ms, "cupti") for d, ms in enumerate((0.8, 1.2, 1.0, 1.1, 1.25), 1)]
  assert dashboard.series_table(noisy)[0]["status"] == "ok"
  if NODE is None:
    pytest.skip("node is absent: the page's script is not run")
  page = _run_page_script(tmp_path, records)
  assert page["body"]["regressed"] == "1" and page["body"]["status"] == "ok", page["body"]
  flagged = [r for r in page["rows"] if r["cls"] == "regressed"]
  assert len(flagged) == 1 and flagged[0]["cells"][:4] == [
    "SLOWER",
    "layer_norm",
    "plain n=4096 bfloat16 fwd",
    "xla [cupti]",
  ], page["rows"]


@pytest.mark.skipif(NODE is None, reason="node is absent: the page's script is not run")
def test_ratio_plots_only_beside_another_implementation(tmp_path):
  """A benchmark with XLA alone or cuDNN alone draws no time / XLA or time / cuDNN plot (a
  ratio to itself, 1 throughout); one with both draws each."""
  time_title, drift_title = "median device time (ms)", "numerics drift"
  for impls, ratio_plots in (
    (("xla",), []),
    (("cudnn",), []),
    (("xla", "cudnn"), ["time / XLA", "time / cuDNN"]),
  ):
    records = [_timed("aaaaaaa1", 1, 1.0, "cupti", impl=impl) for impl in impls]
    page = _run_page_script(tmp_path, records)
    titles = [p["title"] for p in page["plots"]]
    assert len(titles) == 2 + len(ratio_plots) == int(page["body"]["plots"]), (impls, titles)
    assert titles[0] == time_title and titles[-1].startswith(drift_title), (impls, titles)
    for title, prefix in zip(titles[1:-1], ratio_plots, strict=True):
      assert title.startswith(prefix), (impls, titles)


def test_page_data_keeps_what_the_script_plots():
  """Each record reaches the page with every field its script reads (listed here by hand), in
  date order; an older record without shape_key gets one from its shapes."""
  newer = dict(_timed("bbbbbbb2", 2, 1.5, "cupti"), tflops_per_s=3.0, gb_per_s=40.0)
  older = dict(_timed("aaaaaaa1", 1, 2.0, "cupti"), shapes={"rows": 8, "d": 256}, gb_per_s=30.0)
  del older["shape_key"]
  data = dashboard.page_data([newer, older])
  rows = data["records"]
  assert [r["commit"] for r in rows] == ["aaaaaaa1", "bbbbbbb2"]
  read_by_the_script = (
    "run_id",
    "commit",
    "device_kind",
    "jax_version",
    "op",
    "implementation",
    "case",
    "dtype",
    "mode",
    "device_time_median_ms",
    "device_time_method",
    "tflops_per_s",
    "gb_per_s",
    "drift_ratio",
  )
  for got, record in zip(rows, (older, newer), strict=True):
    assert {k: got[k] for k in read_by_the_script} == {k: record.get(k) for k in read_by_the_script}
  assert rows[1]["gb_per_s"] == 40.0 and rows[0]["drift_ratio"] == 0.1
  assert rows[1]["shape_key"] == "n=4096"
  assert rows[0]["shape_key"] == "d=256,rows=8"
  assert len(data["table"]) == 2  # Two shapes: two series.
  # The series table names the older one's benchmark by its shapes too.
  assert sorted(t["bench"] for t in data["table"]) == [
    "plain d=256,rows=8 bfloat16 fwd",
    "plain n=4096 bfloat16 fwd",
  ]
