"""Directory listings over HTTP as real servers write them, validators and garbled
answers: what a dataset finds and reads is what the server holds, each against a real
HTTP server on 127.0.0.1."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.servers import parquet_column as _rows


def test_a_raw_ampersand_in_a_go_file_server_link_names_the_file(tmp_path):
    """Go's ``net/http`` FileServer writes a listing's links unescaped for HTML
    (``<a href="r&notes.parquet">``): in an attribute, a browser reads ``&not`` followed
    by a letter as the text it is, and so must the listing. The link was read as
    ``r¬es.parquet``, a file the server does not have, and the dataset's
    ``r&notes.parquet`` was never read."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    pq.write_table(pa.table({"x": [3, 4]}), tmp_path / "ds" / "r&notes.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            '<pre>\n<a href="a.parquet">a.parquet</a>\n'
            '<a href="r&notes.parquet">r&amp;notes.parquet</a>\n</pre>\n'
        )
        assert _rows(srv.url + "/ds/") == [1, 2, 3, 4]


def test_an_apostrophe_in_an_apache_listing_link_keeps_the_file(tmp_path):
    """Apache's mod_autoindex leaves ``'`` in its links (``<a href="it's.parquet">``, a
    valid double-quoted attribute). The link was cut at the apostrophe, listed as a file
    ``it`` (skipped: not data), and the rows of ``it's.parquet`` were silently lost."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    pq.write_table(pa.table({"x": [3, 4]}), tmp_path / "ds" / "it's.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = (
            "<table>\n"
            '<tr><td><a href="/">Parent Directory</a></td></tr>\n'
            '<tr><td><a href="a.parquet">a.parquet</a></td></tr>\n'
            "<tr><td><a href=\"it's.parquet\">it's.parquet</a></td></tr>\n"
            "</table>\n"
        )
        assert _rows(srv.url + "/ds/") == [1, 2, 3, 4]


def test_links_from_the_servers_root_list_a_folder_named_with_a_space(tmp_path):
    """A listing whose links are paths from the server's root, percent-encoded (as
    Node's http-server and other static servers write them: ``/my%20data/a.parquet``),
    opened at ``http://host/my data/``, the URL a user types (and one every request to
    it reads: relative links list the same folder). The links were compared with the
    folder's URL character by character and all dropped: the listing page itself was
    then read as a Parquet file ('Parquet magic bytes not found')."""
    folder = tmp_path / "my data"
    folder.mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), folder / "a.parquet")
    pq.write_table(pa.table({"x": [3]}), folder / "b.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/my data"] = (
            '<ul>\n<li><a href="/">../</a></li>\n'
            '<li><a href="/my%20data/a.parquet">a.parquet</a></li>\n'
            '<li><a href="/my%20data/b.parquet">b.parquet</a></li>\n</ul>\n'
        )
        assert _rows(srv.url + "/my%20data/") == [1, 2, 3]  # (encoded as the links: read)
        assert _rows(srv.url + "/my data/") == [1, 2, 3]


def test_an_empty_folders_listing_page_is_never_read_as_a_shard(tmp_path):
    """An empty folder as nginx's autoindex lists it (one link, to ``../``), opened at
    its URL with a trailing slash: a dataset with no file, a DatasetNotFoundError naming
    the folder, as for an empty local folder. The listing's HTML page was read as a
    Parquet shard: a CorruptDataError ('Parquet magic bytes not found') for a file the
    server never had."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(tg.DatasetNotFoundError, match="empty"):
        tg.ParquetSource(tmp_path / "empty")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/empty"] = (
            "<html><head><title>Index of /empty/</title></head><body>\n"
            '<h1>Index of /empty/</h1><hr><pre><a href="../">../</a>\n'
            "</pre><hr></body></html>\n"
        )
        with pytest.raises(tg.DatasetNotFoundError, match="empty"):
            tg.ParquetSource(srv.url + "/empty/")


def test_a_listing_page_with_a_long_a_tag_is_read_in_time(tmp_path):
    """A listing page of under 1 KB whose second ``<a`` tag holds 600 spaces before its
    ``>`` (a broken page, or a hostile one): the listing is one pass over the page, in
    well under a second. The link pattern backtracked over the spaces in cubic time:
    seconds for this page (the request's deadline cannot stop a regular expression
    holding the interpreter), days for a 32 KB page."""
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "ds" / "a.parquet")
    with RangeHTTPServer(tmp_path) as srv:
        srv.listings["/ds"] = '<a href="a.parquet">a.parquet</a>\n<a' + " " * 600 + ">notes</a>\n"
        start = time.monotonic()
        assert _rows(srv.url + "/ds/") == [1, 2]
        assert time.monotonic() - start < 3.0
