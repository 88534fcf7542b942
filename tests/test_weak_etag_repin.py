"""A source opened before another opening pinned the same file anew through a proxy that
weakens its ETag (W/"x") reads on: the object is the same."""

from __future__ import annotations

from torchgrain.io import responses


def test_a_weakened_etag_pinned_anew_is_the_same_version():
    path = "h://weak/a"
    responses.pin(path, 10, fresh=True)
    responses.check_file_answer(path, 10, '"x"', None)
    seen = responses.unchanged_since(path, None)
    responses.pin(path, 10, fresh=True)  # another opening, through a compressing proxy
    responses.check_file_answer(path, 10, 'W/"x"', None)
    assert responses.unchanged_since(path, seen)[0] == 10


def test_another_etag_pinned_anew_is_still_refused():
    path = "h://weak/b"
    responses.pin(path, 10, fresh=True)
    responses.check_file_answer(path, 10, '"x"', None)
    seen = responses.unchanged_since(path, None)
    responses.pin(path, 10, fresh=True)
    responses.check_file_answer(path, 10, 'W/"y"', None)
    try:
        responses.unchanged_since(path, seen)
    except responses.RangeAnswerError as e:
        assert "changed since it was read from" in str(e)
    else:
        raise AssertionError("another ETag was accepted")
