"""The consumed log's lineages: which trainings the model of the last learner start holds."""

import json

import pytest

from asyncrlhf.consumed import ConsumedLog, History, Kind, log_path, read_rows, rows_of

pytestmark = pytest.mark.unit


def test_the_history_follows_each_lineage_back_to_the_checkpoint_it_resumed():
    h = History(3, {1: (0, 0), 2: (1, 5), 3: (2, 7)})
    assert h.contains(3, 8) and h.contains(3, 100)
    assert h.contains(2, 7) and not h.contains(2, 8)  # lineage 2 trained version 8, lineage 3 resumed at 7
    assert h.contains(1, 5) and not h.contains(1, 6)
    assert not h.contains(0, 2)  # lineage 1 began from fresh weights


def test_a_restart_makes_groups_trained_after_the_checkpoint_trainable_again(tmp_path):
    log = ConsumedLog(log_path(tmp_path))
    assert log.begin(0, 0) == 1
    log.append(Kind.TRAINED, 2, ["g00000000", "g00000001"])
    log.append(Kind.DROPPED, 2, ["g00000002"])
    log.append(Kind.TRAINED, 3, ["g00000003"])  # the checkpoint is at version 2; version 3 dies with it
    again = ConsumedLog(log_path(tmp_path))  # the restarted learner
    assert again.ids == {"g00000000", "g00000001", "g00000002", "g00000003"}  # before its lineage begins
    assert again.begin(1, 2) == 2
    assert again.ids == {"g00000000", "g00000001", "g00000002"}
    assert again.trained_elsewhere() == {"g00000003"}
    again.append(Kind.TRAINED, 3, ["g00000003"])
    assert again.trained_elsewhere() == set() and "g00000003" in again.ids
    rows = read_rows(tmp_path)
    assert [r.get("lineage") for r in rows if r["kind"] is Kind.TRAINED] == [1, 1, 2]


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    path = log_path(tmp_path)
    row = {"kind": "trained", "version": 2, "group_ids": ["g00000000"]}
    path.write_text(json.dumps(row) + '\n{"kind": "tra')
    assert ConsumedLog(path).ids == {"g00000000"}


def test_every_reader_reads_the_log_one_way_whatever_its_spacing(tmp_path):
    assert read_rows(tmp_path) == [] and rows_of(tmp_path, Kind.TRAINED) == []  # before the first step
    log = ConsumedLog(log_path(tmp_path))
    log.begin(0, 0)
    log.append(Kind.TRAINED, 2, ["g00000000"], staleness=[0])
    with log_path(tmp_path).open("a") as f:  # another writer's spacing, a blank line, a torn last line
        f.write('{"kind":"dropped","version":2,"group_ids":["g00000001"]}\n\n{"kind": "tra')
    assert [r["kind"] for r in read_rows(tmp_path)] == [Kind.LINEAGE, Kind.TRAINED, Kind.DROPPED]
    assert all(type(r["kind"]) is Kind for r in read_rows(tmp_path))  # typed as read, whoever wrote it
    assert [r["group_ids"] for r in rows_of(tmp_path, Kind.TRAINED, Kind.DROPPED)] == [["g00000000"],
                                                                                     ["g00000001"]]
    assert '"kind": "trained"' in log_path(tmp_path).read_text()  # a kind is written as its plain name


def test_a_row_of_a_kind_this_version_does_not_know_names_its_line(tmp_path):
    log_path(tmp_path).write_text('{"kind": "trained", "version": 1, "group_ids": []}\n'
                                  '{"kind": "promoted", "version": 1, "group_ids": []}\n')
    with pytest.raises(ValueError, match=r"consumed.jsonl:2: unknown row kind 'promoted' \(known: lineage, "):
        read_rows(tmp_path)
