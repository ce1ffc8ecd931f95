"""The rules for a request whose engine process died, and the progress-report plumbing, without
processes (the end-to-end checks are in test_workers.py and test_ray.py)."""

from __future__ import annotations

import json

import pytest

from deltazip.runtime.cluster.progress import (
    SseEvents,
    after_death,
    read_report,
    report_line,
    stream_error,
    traits,
)


@pytest.mark.parametrize("stream, state, replay, resubmitted, want", [
    # nothing reached the client: resubmitted once, whatever it is
    (False, "queued", False, False, "resubmit"),
    (True, "queued", False, False, "resubmit"),
    (True, "prefilling", False, False, "resubmit"),
    (True, "generating", False, False, "resubmit"),
    # a non-streamed request that had started: only when its output is reproducible
    (False, "prefilling", True, False, "resubmit"),
    (False, "generating", True, False, "resubmit"),
    (False, "prefilling", False, False, "refuse"),
    (False, "generating", False, False, "refuse"),
    # once only
    (False, "queued", True, True, "refuse"),
    (True, "queued", True, True, "refuse"),
    # bytes sent: a stream ends with an error event
    (True, "answering", True, False, "error_event"),
    (True, "answering", False, True, "error_event"),
])
def test_after_death(stream, state, replay, resubmitted, want):
    assert after_death(stream, state, replay, resubmitted) == want


def test_traits_of_a_request_body():
    assert traits(b'{"model": "m", "temperature": 0}') == (False, True)
    assert traits(b'{"model": "m", "temperature": 0.0, "stream": true}') == (True, True)
    assert traits(b'{"model": "m", "seed": 3, "temperature": 1.2}') == (False, True)
    assert traits(b'{"model": "m", "stream": true}') == (True, False)  # unset temperature: 1
    assert traits(b'{"model": "m", "temperature": 0.01, "seed": null}') == (False, False)
    assert traits(b"{not json") == (False, True) and traits(b"[1]") == (False, True)  # refused before generating


def test_sse_events_are_cut_at_event_boundaries_and_the_error_ends_with_done():
    ev = SseEvents()
    assert ev.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert ev.feed(b': 2}\n') == b"" and ev.tail == b'data: {"b": 2}\n'
    assert ev.feed(b"\n") == b'data: {"b": 2}\n\n' and ev.tail == b""
    end = stream_error("gone").decode().split("\n\n")
    assert json.loads(end[0][6:])["error"]["code"] == "worker_failed" and end[1:] == ["data: [DONE]", ""]


def test_sse_events_know_when_the_answer_is_whole():
    """``done`` once the ``[DONE]`` event went out whole, not while it is half-sent: a relay whose engine
    dies after it ends the stream as it is, where an error event would follow a finished answer."""
    ev = SseEvents()
    assert ev.feed(b'data: {"a": 1}\n\ndata: [DO') == b'data: {"a": 1}\n\n' and not ev.done
    assert ev.feed(b"NE]\n") == b"" and not ev.done
    assert ev.feed(b"\n") == b"data: [DONE]\n\n" and ev.done


def _relayed(items: list, die: bool) -> list[bytes]:
    """What the Ray ingress relays of a stream whose held-back chunk is ``items[0]`` and whose replica
    then sends ``items[1:]`` (body chunks) and, with ``die``, dies."""
    import asyncio
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from deltazip.runtime.cluster.ray_app import Ingress

    async def gen():
        for b in items[1:]:
            yield ("body", b)
        if die:
            raise RayActorError()

    async def run():
        return [c async for c in Ingress._relay(ingress, gen(), [items[0]])]

    ingress = SimpleNamespace(faults={"stream_errors": 0})
    return asyncio.run(run()), ingress.faults["stream_errors"]


def test_a_replica_dying_after_the_answer_went_out_whole_adds_nothing_to_the_stream():
    pytest.importorskip("ray")
    whole = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
             b"data: [DONE]\n\n"]
    out, errors = _relayed(whole, die=True)
    assert b"".join(out) == b"".join(whole) and errors == 0
    out, errors = _relayed(whole[:2], die=True)  # died before [DONE]: the error event, then [DONE]
    text = b"".join(out).decode().split("\n\n")
    assert json.loads(text[2][6:])["error"]["code"] == "worker_failed" and text[3:] == ["data: [DONE]", ""]
    assert errors == 1
    out, errors = _relayed(whole, die=False)
    assert b"".join(out) == b"".join(whole) and errors == 0


def test_report_lines_round_trip_and_reject_anything_else():
    assert read_report(report_line("ab12", "prefilling").rstrip(b"\n")) == ("ab12", "prefilling")
    for bad in (b"", b"prefilling", b"done ab12", b"prefilling a b", b"generating a\x00b", b'{"port": 1}'):
        assert read_report(bad) is None, bad
