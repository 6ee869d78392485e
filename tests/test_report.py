"""``pdfsm report``: one self-contained HTML page, checked as text and as a headless-Chromium screenshot."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from helpers import run_cli

from pdfsm.report import STATE_COLOURS, TIMELINE_BG


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("report")
    assert run_cli("demo-sim", "--requests", "6", "--log-dir", str(d / "logs"), "--quiet", "--fault",
                 "drop-notification") == 0
    assert run_cli("report", str(d / "logs"), "-o", str(d / "report.html")) == 0
    return d / "report.html"


def test_the_page_is_self_contained(report: Path) -> None:
    page = report.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    assert 'id="timeline"' in page and page.count("<svg") == 4  # the timeline and three state diagrams
    assert "lease expired before every consumer part notified" in page
    assert page.count("stateDiagram-v2") == 3


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA PNG; enough for a screenshot."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = colour = 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if colour == 2 else 4
    raw, stride, prev = zlib.decompress(idat), width * bpp, bytearray(width * bpp)
    rows: list[bytes] = []
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rows.append(bytes(line[j] for i in range(0, stride, bpp) for j in range(i, i + 3)))
    return width, height, rows


def _rgb(hex_colour: str) -> bytes:
    return bytes.fromhex(hex_colour.lstrip("#"))


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_a_headless_browser_shows_the_timeline(report: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary (apt-get install chromium)")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    # The page is self-contained: resolve no name. Chromium's resolver otherwise bound
                    # some 25 UDP sockets on 0.0.0.0 per run (seen with a bind() shim over the suite).
                    "--host-resolver-rules=MAP * ~NOTFOUND",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1400,1600",
                    report.as_uri()], check=True, capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000
    width, height, rows = _png_pixels(shot)
    assert (width, height) == (1400, 1600)
    bg, holding = _rgb(TIMELINE_BG), _rgb(STATE_COLOURS["HOLDING"])
    pixels = [_px(row) for row in rows]
    timeline = [y for y, line in enumerate(pixels) if line.count(bg) > 300]  # rows crossing the timeline
    assert len(timeline) > 150, "the timeline's background is not on screen"
    region = pixels[min(timeline):max(timeline) + 1]
    assert sum(px == bg for line in region for px in line) > 150_000
    # inside it: state bars (req-3's long HOLDING bar on prefill-tp0) and a violation marker
    assert sum(px == holding for line in region for px in line) > 5_000
    assert sum(px == _rgb("#ff8c00") for line in region for px in line) > 20


def _px(row: bytes) -> list[bytes]:
    return [row[i:i + 3] for i in range(0, len(row), 3)]
