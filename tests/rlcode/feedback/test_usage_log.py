"""The usage log: its line format, torn / duplicated / corrupted records, writers in several
processes, and the join of out-of-order outcome events into settled interactions."""

import json
import multiprocessing
import os
import random
import zlib

import pytest

from rlcode.feedback.usage_log import (Interaction, LogFormatError, LogReader, LogWriter, Outcome,
                                       UnauthenticatedRecord, UsageWindows, decode_record, encode_record,
                                       outcome_reward)


def interaction(i, t=0.0, version=0, logged_at=None, n=3):
    return Interaction(id=f"i{i}", version=version, time=t, user="u1", request="def f(x):\n",
                       prompt_ids=(1, 2, 3), completion="    return x\n", completion_ids=tuple(range(4, 4 + n)),
                       logprobs=tuple(-0.5 for _ in range(n)), logged_at=t if logged_at is None else logged_at)


def outcome(i, kind, t, logged_at=None, value=1.0):
    return Outcome(id=f"i{i}-{kind}", interaction=f"i{i}", kind=kind, time=t, value=value,
                   logged_at=t if logged_at is None else logged_at)


def test_records_round_trip_and_every_malformed_line_is_refused():
    for rec in (interaction(1, 5.0), outcome(1, "latency", 7.5, value=2.25)):
        line = encode_record(rec.record())
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert decode_record(line[:-1]) == rec
    good = interaction(1).record()
    text = lambda r: json.dumps(r).encode()  # noqa: E731
    framed = lambda b: f"{zlib.crc32(b):08x}\t".encode() + b  # noqa: E731
    bad = [
        encode_record(good)[:-10],  # torn
        b"00000000\t" + text(good),  # checksum mismatch
        framed(b"{not json"),
        framed(text({k: v for k, v in good.items() if k != "logprobs"})),
        framed(text(dict(good, logprobs=[-0.5, -0.5]))),  # fewer log-probs than tokens
        framed(text(dict(good, logprobs=[-0.5, 0.5, -0.5]))),  # a probability above 1
        framed(text(dict(good, completion_ids=[4, -1, 5]))),
        framed(text(dict(good, version="3"))),
        framed(text(dict(good, type="other"))),
        framed(text(dict(outcome(1, "accepted", 1.0).record(), kind="liked"))),
        framed(text(dict(outcome(1, "accepted", 1.0).record(), time=None))),
        framed(text(dict(good, logged_at=True))),
        framed(b'{"id": "x", "logged_at": NaN, "type": "outcome"}'),
        b"",
    ]
    for line in bad:
        with pytest.raises(LogFormatError):
            decode_record(line)


def test_reader_skips_torn_and_duplicate_records_and_waits_for_an_unfinished_line(tmp_path):
    path = tmp_path / "usage.jsonl"
    w = LogWriter(path)
    r = LogReader(path)
    w.append(interaction(1))
    line = encode_record(interaction(2).record())
    w.write_raw(line[:25])  # a writer dies mid-record
    w.append(interaction(3))  # the next writer ends the torn line first
    w.append(interaction(1))  # delivered twice
    got = r.poll()
    assert [x.id for x in got] == ["i1", "i3"]
    assert r.counts == {"records": 2, "torn": 1, "unauthenticated": 0, "duplicates": 1}
    # A record being written (no newline yet) is not consumed until it is complete.
    with open(path, "ab") as f:
        f.write(line[:30])
    assert r.poll() == []
    with open(path, "ab") as f:
        f.write(line[30:])
    assert [x.id for x in r.poll()] == ["i2"]
    assert r.poll() == []


def test_random_corruption_never_yields_a_record_that_was_not_written(tmp_path):
    # Bytes flipped, dropped, duplicated and garbage inserted at random: the reader never raises
    # and every record it yields is one that was written, at most once.
    written = {}
    lines = []
    for i in range(200):
        rec = interaction(i, t=float(i)) if i % 2 else outcome(i - 1, "accepted", float(i))
        written[rec.id] = rec
        lines.append(encode_record(rec.record()))
    rng = random.Random(0)
    for trial in range(20):
        data = bytearray(b"".join(lines))
        for _ in range(40):
            op, pos = rng.randrange(4), rng.randrange(len(data))
            if op == 0:
                data[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[pos:pos + rng.randrange(1, 50)]
            elif op == 2:
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30)))
            else:
                end = data.find(b"\n", pos)
                if end > 0:
                    data[end + 1:end + 1] = data[pos:end + 1]
        path = tmp_path / f"corrupt{trial}.jsonl"
        path.write_bytes(bytes(data))
        r = LogReader(path)
        got = r.poll()
        ids = [x.id for x in got]
        assert len(ids) == len(set(ids))
        for x in got:
            assert x == written[x.id]
        assert 100 < len(got) < 200 and r.counts["torn"] > 0


def _writer_process(path, name, count, die_midway):
    w = LogWriter(path)
    for i in range(count):
        rec = interaction(f"{name}-{i}", t=float(i))
        if die_midway and i == count // 2:
            w.write_raw(encode_record(rec.record())[:40])
            os._exit(0)  # dies holding nothing: the record stays torn
        w.append(rec)
    w.close()


@pytest.mark.slow
def test_writers_in_several_processes_and_a_concurrent_reader(tmp_path):
    path = str(tmp_path / "usage.jsonl")
    ctx = multiprocessing.get_context("spawn")
    count = 300
    procs = [ctx.Process(target=_writer_process, args=(path, f"w{k}", count, k == 3)) for k in range(4)]
    for p in procs:
        p.start()
    r = LogReader(path)
    got = []
    while any(p.is_alive() for p in procs):
        got += r.poll()
    for p in procs:
        p.join()
    got += r.poll()
    LogWriter(path).append(interaction("last"))  # a later writer ends the dead writer's torn record
    got += r.poll()
    ids = [x.id for x in got]
    expected = {f"iw{k}-{i}" for k in range(3) for i in range(count)} | {f"iw3-{i}" for i in range(count // 2)}
    assert len(ids) == len(set(ids)) and set(ids) == expected | {"ilast"}
    assert r.counts["torn"] == 1 and r.counts["duplicates"] == 0


def test_outcomes_join_in_any_order_and_settle_by_the_watermark():
    w = UsageWindows(settle_s=100.0, orphan_s=500.0)
    # The outcome is logged before its interaction; the interaction settles at t = 110.
    w.add([outcome(1, "accepted", 20.0, logged_at=25.0), interaction(1, t=10.0, logged_at=30.0),
           interaction(2, t=50.0, logged_at=55.0)])
    assert w.settled() == 0 and w.take(10) == []
    w.add([outcome(1, "kept", 105.0, logged_at=109.0), outcome(2, "followup", 60.0, logged_at=111.0)])
    assert w.settled() == 1
    (it, outs), = w.take(10)
    assert it.id == "i1" and sorted(o.kind for o in outs) == ["accepted", "kept"]
    # An outcome of an interaction already handed out is late: counted, never applied.
    w.add([outcome(1, "reverted", 120.0, logged_at=160.0)])
    assert w.counts["late"] == 1
    (it, outs), = w.take(10)  # watermark 160 >= 50 + 100
    assert it.id == "i2" and [o.kind for o in outs] == ["followup"]
    # An outcome whose interaction never arrives is dropped once the watermark is orphan_s past it.
    w.add([outcome(9, "accepted", 200.0, logged_at=201.0)])
    assert w.counts["orphans"] == 0
    w.add([interaction(3, t=700.0, logged_at=701.0)])
    assert w.counts["orphans"] == 1 and "i9" not in w.outcomes
    # Oldest first, at most the number asked for.
    w.add([interaction(5, t=900.0, logged_at=902.0), interaction(4, t=800.0, logged_at=903.0),
           interaction(6, t=1000.0, logged_at=2000.0)])
    assert [it.id for it, _ in w.take(2)] == ["i3", "i4"]
    assert w.counts["handed"] == 4


def test_outcome_reward_counts_each_kind_once_and_scales_the_latency():
    weights = {"accepted": 1.0, "kept": 1.0, "reverted": -1.0, "followup": -0.5, "latency": -0.1}
    outs = [outcome(1, "accepted", 1.0), outcome(1, "accepted", 2.0), outcome(1, "kept", 3.0),
            outcome(1, "latency", 0.5, value=2.0)]
    assert outcome_reward(outs, weights) == pytest.approx(1.0 + 1.0 - 0.2)
    assert outcome_reward([outcome(2, "followup", 1.0)], weights) == -0.5
    assert outcome_reward([], weights) == 0.0


def test_with_a_key_only_records_signed_with_it_are_read(tmp_path):
    path = tmp_path / "usage.jsonl"
    key = b"shared secret of the serving system"
    LogWriter(path, key=key).append(interaction(1))
    LogWriter(path).append(outcome(1, "accepted", 1.0))  # a writer without the key: a valid checksum only
    LogWriter(path, key=b"another key").append(outcome(1, "kept", 2.0))
    signed = encode_record(outcome(1, "reverted", 3.0).record(), key)
    forged = signed.replace(b'"reverted"', b'"kept"')  # the signature no longer matches the text
    LogWriter(path).write_raw(forged)
    LogWriter(path, key=key).append(interaction(2))
    r = LogReader(path, key=key)
    assert [x.id for x in r.poll()] == ["i1", "i2"]
    assert r.counts["unauthenticated"] == 3 and r.counts["records"] == 2
    with pytest.raises(UnauthenticatedRecord):
        decode_record(forged[:-1], key)
    assert decode_record(signed[:-1], key).kind == "reverted"
    # Without a key the signed lines are not checksummed lines: a reader without the key reads none of them.
    plain = LogReader(path)
    assert [x.id for x in plain.poll()] == ["i1-accepted"]
