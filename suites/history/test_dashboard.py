"""The dashboard: built from a history, it loads in headless Chromium without errors and draws its plots."""

import os
import re
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
