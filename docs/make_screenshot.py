"""Screenshot of JupyterLab running the explorer widget on a recorded run, in headless Chromium.

Starts a token-less JupyterLab on 127.0.0.1 in a scratch folder holding a two-cell notebook that opens STORE and
displays ``explore(ds)``, opens it in headless Chromium (Debian's ``chromium``) driven over the DevTools protocol,
runs all cells, waits for the widget's image, selects a step pair and colour floor, and saves a PNG::

    mar-probe record --out runs/demo.zarr --labels 0,7 --num-samples 2 --num-iter 32 --vars dec_k,dec_v,enc_k,z
    python docs/make_screenshot.py runs/demo.zarr --out docs/explorer_jupyterlab.png

Needs ``pip install -e '.[notebooks]'``, ``apt-get install chromium`` and websocket-client (a JupyterLab
dependency). Everything it starts is stopped at the end.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat

NOTEBOOK = [
    nbformat.v4.new_markdown_cell("# Exploring a recorded run\nCosine stability of the decoder keys on the token "
                                  "grid, beside the canvas the model holds at that step (no model loaded)."),
    nbformat.v4.new_code_cell("import mar_probe\nfrom mar_probe.widgets import explore\n\n"
                              "ds = mar_probe.open_run({store!r})\nexplorer = explore(ds, var='dec_k')\nexplorer"),
]
PANEL = "Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.sessionContext)"
SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


class DevTools:
    """The smallest Chrome DevTools protocol client: call(method, **params) -> result."""

    def __init__(self, port: int, timeout: float):
        import websocket
        wait_http(f"http://127.0.0.1:{port}/json/version", timeout)
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.ws = websocket.create_connection(url, timeout=timeout, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method} failed: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return res["result"].get("value")

    def wait_js(self, expression: str, timeout: float, what: str):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = self.js(expression)
            if value:
                return value
            time.sleep(1)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_lab(root: Path, port: int, settings_dir: Path, log) -> subprocess.Popen:
    for name, values in SETTINGS.items():
        plugin, file = name.rsplit("/", 1)
        (settings_dir / plugin).mkdir(parents=True, exist_ok=True)
        (settings_dir / plugin / file).write_text(json.dumps(values))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings_dir), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True", "--allow-root"]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_chromium(port: int, size: tuple[int, int], profile: Path, log) -> subprocess.Popen:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise FileNotFoundError("chromium not found; install Debian's package: apt-get install -y chromium")
    cmd = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--remote-debugging-port={port}", "--remote-allow-origins=*", f"--user-data-dir={profile}",
           f"--window-size={size[0]},{size[1]}", "about:blank"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def drive(dt: DevTools, url: str, size, steps, floor, timeout: float) -> bytes:
    """Open the notebook, run it, wait for the widget's image, pick a step pair, return the PNG."""
    dt.call("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1, mobile=False)
    dt.call("Page.enable")
    dt.call("Page.navigate", url=url)
    dt.wait_js("!!(window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell'))", timeout, "JupyterLab")
    # a headless window has no focus, so activate the notebook panel explicitly before running it
    dt.wait_js(f"(() => {{ const w = {PANEL}; if (!w) return false; window.jupyterapp.shell.activateById(w.id); "
               "const k = w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel; "
               "return !!(k && k.status === 'idle'); })()", timeout, "an idle kernel")
    dt.js("window.jupyterapp.commands.execute('notebook:run-all-cells').then(() => true)")
    dt.wait_js("!!document.querySelector('.jp-OutputArea .widget-image, .jp-OutputArea img')", timeout,
               "the explorer's figure")
    if steps:
        s0, s1 = steps
        code = f"explorer.controls['steps'].value = ({s0}, {s1})"
        if floor is not None:
            code += f"; explorer.controls['floor'].value = {floor}"
        dt.js(f"(async () => {{ const w = {PANEL}; "
              f"await w.sessionContext.session.kernel.requestExecute({{code: {json.dumps(code)}}}).done; "
              "return true; })()")
        dt.wait_js(f"document.body.innerText.includes('{s0}-{s1}')", timeout, "the new step pair")
    time.sleep(4)  # let the widget views update and fonts settle
    shot = dt.call("Page.captureScreenshot", format="png")
    return base64.b64decode(shot["data"])


def write_notebook(folder: Path, store: Path) -> None:
    """The two-cell notebook that opens ``store`` and displays the explorer."""
    nb = nbformat.v4.new_notebook(cells=[c.copy() for c in NOTEBOOK])
    nb.cells[1].source = nb.cells[1].source.format(store=str(store))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / "explorer.ipynb")


def stop(*procs) -> None:
    """Terminate the processes this script started (then kill those that do not exit)."""
    for proc in procs:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def screenshot(store: Path, size, steps, floor, timeout: float) -> bytes:
    """Start JupyterLab and Chromium in a scratch folder, drive them, stop them, return the PNG."""
    with tempfile.TemporaryDirectory(prefix="mar_probe_shot_") as tmp:
        tmp = Path(tmp)
        write_notebook(tmp / "lab", store)
        lab_port, cdp_port = free_port(), free_port()
        with open(tmp / "lab.log", "wb") as lab_log, open(tmp / "chromium.log", "wb") as cr_log:
            lab, chromium = start_lab(tmp / "lab", lab_port, tmp / "settings", lab_log), None
            try:
                wait_http(f"http://127.0.0.1:{lab_port}/api", timeout)
                chromium = start_chromium(cdp_port, size, tmp / "profile", cr_log)
                dt = DevTools(cdp_port, timeout)
                return drive(dt, f"http://127.0.0.1:{lab_port}/lab/tree/explorer.ipynb", size, steps, floor, timeout)
            except Exception:
                sys.stderr.write((tmp / "lab.log").read_text(errors="replace")[-3000:])
                raise
            finally:
                stop(chromium, lab)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store", help="a run store written by `mar-probe record` (with dec_k)")
    p.add_argument("--out", default="docs/explorer_jupyterlab.png", help="PNG to write")
    p.add_argument("--size", default="1600,1000", help="browser viewport WIDTH,HEIGHT (default: 1600,1000)")
    p.add_argument("--steps", default="20,21", help="step pair to select after start (S0,S1; '' keeps the default)")
    p.add_argument("--floor", type=float, default=0.99, help="colour floor of the cosine map (default: 0.99)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each wait (default: 600)")
    args = p.parse_args(argv)
    store = Path(args.store).resolve()
    if not store.is_dir():
        raise SystemExit(f"store {str(store)!r} not found; record one first (see this script's docstring)")
    size = tuple(int(v) for v in args.size.split(","))
    steps = tuple(int(v) for v in args.steps.split(",")) if args.steps else None
    png = screenshot(store, size, steps, args.floor, args.timeout)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    print(f"wrote {out} ({len(png) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
