"""`download-eval-bundle` against an HTTP server on 127.0.0.1 serving a zip built here: a whole fetch
with progress, a broken-off transfer resumed by a Range request, a corrupted or foreign zip refused,
and the one-line error when the server cannot be reached."""

import io
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import free_port
from core_bundle import write_word_bundle

from raychat.common import RaychatError
from raychat.evaluation.download import download_eval_bundle

REPO = Path(__file__).resolve().parents[1]


def bundle_zip(tmp_path: Path, top: str = "eval_bundle") -> bytes:
    """nanochat's layout: the zip holds one directory eval_bundle/ (stored, so bytes can be flipped)."""
    source = write_word_bundle(tmp_path / "source")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for path in sorted(source.rglob("*")):
            if path.is_file():
                archive.write(path, f"{top}/{path.relative_to(source)}")
    return buffer.getvalue()


class ZipServer:
    """Serves `data` at /eval_bundle.zip, honouring Range. `cut_first`: the first GET announces the
    whole length but the connection closes after that many bytes."""

    def __init__(self, data: bytes, cut_first: int | None = None):
        self.data, self.cut_first, self.ranges = data, cut_first, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                start = 0
                if (header := self.headers.get("Range")) is not None:
                    server.ranges.append(header)
                    start = int(header.removeprefix("bytes=").rstrip("-"))
                body = server.data[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.cut_first is not None:
                    body, server.cut_first = body[:server.cut_first], None
                    self.close_connection = True
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/eval_bundle.zip"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "ZipServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.integration  # a local server, a subprocess
def test_fetch_from_the_command_line(tmp_path):
    with ZipServer(bundle_zip(tmp_path)) as server:
        out = tmp_path / "home" / "eval_bundle"
        command = ["download-eval-bundle", "--out", str(out), "--url", server.url]
        result = subprocess.run([sys.executable, "-m", "raychat.corpus", *command], capture_output=True,
                                text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert f"eval bundle: fetching {server.url}" in result.stdout
    assert f"eval bundle: 3 tasks, 12 examples in {out}" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["core.yaml", "eval_data", "eval_meta_data.csv"]
    assert [p.name for p in out.parent.iterdir()] == ["eval_bundle"]  # no .part, no staging left


@pytest.mark.integration  # a local server
def test_a_broken_transfer_resumes_where_it_stopped(tmp_path):
    data = bundle_zip(tmp_path)
    lines: list[str] = []
    with ZipServer(data, cut_first=1000) as server:
        with pytest.raises(RaychatError, match="got 1,000 of .* bytes: re-run to resume"):
            download_eval_bundle(tmp_path / "b", url=server.url, log=lines.append)
        assert (tmp_path / "b.zip.part").stat().st_size == 1000
        bundle = download_eval_bundle(tmp_path / "b", url=server.url, log=lines.append)
    assert server.ranges == ["bytes=1000-"]
    assert [task.label for task in bundle.tasks] == ["capitals", "pronouns", "continuations"]
    assert bundle.directory == tmp_path / "b" and not (tmp_path / "b.zip.part").exists()
    assert any("from byte 1,000" in line for line in lines)


@pytest.mark.integration  # a local server
@pytest.mark.parametrize("spoil, message", [
    (lambda data: data.replace(b"Paris", b"Pariz", 1), "fails its CRC check: deleted"),
    (lambda data: b"<html>a captive portal's sign-in page</html>", "is not a zip archive"),
    (None, "holds no eval_bundle/core.yaml"),
])
def test_a_bad_zip_is_refused_and_nothing_is_put_in_place(tmp_path, spoil, message):
    data = spoil(bundle_zip(tmp_path)) if spoil else bundle_zip(tmp_path, top="other")
    with ZipServer(data) as server, pytest.raises(RaychatError, match=message):
        download_eval_bundle(tmp_path / "b", url=server.url, log=lambda _: None)
    assert not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".eval_bundle_")]


@pytest.mark.unit
def test_unreachable_says_where_to_put_it(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/eval_bundle.zip"
    where = tmp_path / "b" / "core.yaml"
    with pytest.raises(RaychatError, match=f"unzip it so that {where} exists") as error:
        download_eval_bundle(tmp_path / "b", url=url, log=lambda _: None)
    assert url in str(error.value) and "\n" not in str(error.value)
