"""HTTP directory listings as servers write them: every file of the folder read once,
no link that is not one, each against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq

import torchgrain as tg
from tests.servers import RangeHTTPServer, parquet_bytes
from tests.servers import parquet_column as _rows


def test_a_file_linked_from_a_flat_index_and_its_folders_page_is_read_once(tmp_path):
    """A static index.html (as S3-website and CDN index generators write them) that
    links every file below it, those of its subfolders too, as well as each subfolder's
    own page: each file of the dataset is read once. The same URL found on two pages
    was refused with UnsafePathError ('names file 2 ... and file 1 ..., which are one
    file'), though both name one file of the folder, written alike."""
    (tmp_path / "ds" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    pq.write_table(pa.table({"x": [3, 4]}), tmp_path / "ds" / "sub" / "b.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            '<ul><li><a href="a.parquet">a.parquet</a></li>\n'
            '<li><a href="sub/">sub/</a></li>\n'
            '<li><a href="sub/b.parquet">sub/b.parquet</a></li></ul>\n'
        )
        assert _rows(srv.url + "/ds/") == [1, 2, 3, 4]


def test_a_link_in_an_html_comment_is_no_file_of_the_folder(tmp_path):
    """A generated index page that keeps a removed file's entry commented out
    (``<!-- <a href="old.parquet"> -->``): a browser shows no such link, the server has
    no such file; the dataset is the files the page links."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            "<html><body>\n"
            '<a href="a.parquet">a.parquet</a>\n'
            '<!-- <a href="old.parquet">old.parquet</a> -->\n'
            "</body></html>\n"
        )
        assert _rows(srv.url + "/ds/") == [1, 2]


def test_a_link_in_a_script_is_no_file_of_the_folder(tmp_path):
    """A listing page (Caddy's browse template, a CDN's index) with a script building
    markup in a string (``'<a href="' + name + '">'``, ``"<a href='x.parquet'>"``): a
    browser makes no link of a script's text; the dataset is the files the page links."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            "<html><head><script>\n"
            "const demo = \"<a href='example.parquet'>example</a>\";\n"
            "</script></head><body>\n"
            '<a href="a.parquet">a.parquet</a>\n'
            "</body></html>\n"
        )
        assert _rows(srv.url + "/ds/") == [1, 2]


def test_links_with_a_hash_fragment_name_the_files_before_it(tmp_path):
    """A "simple" index page (PEP 503's format, which many file mirrors write) links
    each file with its digest in the fragment: ``<a href="a.parquet#sha256=...">``. A
    fragment is never sent to the server: the link names ``a.parquet``, a file of the
    folder. The fragment was kept in the file's URL, and the listing refused as naming
    a file outside the dataset ('it has a query or a fragment')."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    pq.write_table(pa.table({"x": [3]}), tmp_path / "ds" / "b.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            "<!DOCTYPE html><html><body>\n"
            '<a href="a.parquet#sha256=00ff">a.parquet</a><br/>\n'
            '<a href="b.parquet#sha256=11ee">b.parquet</a><br/>\n'
            "</body></html>\n"
        )
        assert _rows(srv.url + "/ds/") == [1, 2, 3]


def test_spaces_around_a_link_are_not_part_of_the_file_name(tmp_path):
    """A hand-written or templated index page with spaces around a link
    (``<a href=" a.parquet ">``): a browser strips leading and trailing whitespace
    from a URL and fetches ``a.parquet``. The spaces were kept, ``%20a.parquet%20``
    requested, and opening the dataset failed ('does not exist')."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    pq.write_table(pa.table({"x": [3]}), tmp_path / "ds" / "b.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            '<ul>\n<li><a href=" a.parquet ">a.parquet</a></li>\n'
            '<li><a href="b.parquet ">b.parquet</a></li>\n</ul>\n'
        )
        assert _rows(srv.url + "/ds/") == [1, 2, 3]


class _HtmlTyped(BaseHTTPRequestHandler):
    """Serves one Parquet file's bytes (whole or a range) as ``text/html``, as a server
    with a wrong default type does."""

    data = b""

    def _answer(self, body: bool) -> None:
        data = self.data
        rng = self.headers.get("Range")
        status, start, end = 200, 0, len(data) - 1
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            if a:
                start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
            else:
                start = len(data) - int(b)
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start : end + 1])

    def do_HEAD(self) -> None:
        self._answer(False)

    def do_GET(self) -> None:
        self._answer(True)

    def log_message(self, *args: object) -> None:
        pass


def test_a_parquet_file_served_as_text_html_is_read_as_the_file(tmp_path):
    """A server with a wrong default Content-Type (text/html for every file) serving
    one Parquet file, opened by its URL: the file's bytes hold no link, it is a file,
    and its rows are read (the listing page of a folder is HTML; a file is not one)."""
    _HtmlTyped.data = parquet_bytes(3)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _HtmlTyped)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        src = tg.ParquetSource(f"http://127.0.0.1:{srv.server_address[1]}/data/a.parquet")
        try:
            assert len(src) == 3
        finally:
            src.close()
    finally:
        srv.shutdown()
        srv.server_close()
