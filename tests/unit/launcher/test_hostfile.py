"""Hostfile parsing and the --include/--exclude filters, with every error case."""
from __future__ import annotations

import pytest

from dsrun.launcher.hostfile import apply_filters, parse_core_list, parse_filter, parse_hostfile, read_hostfile
from dsrun.utils.errors import UserError

POOL = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


def problems(excinfo: pytest.ExceptionInfo) -> list[str]:
    return [str(p) for p in excinfo.value.problems]


# ---- hostfile ------------------------------------------------------------------------------------------

def test_hostfile_keeps_order_and_ignores_comments_and_blank_lines():
    text = ("# cluster\n\nworker-1 slots=4\n   \nworker-0 slots=2   # the small one\n10.0.0.7 slots=1\n"
            "root@gpu-3 slots=8\n")
    assert list(parse_hostfile(text).items()) == [("worker-1", 4), ("worker-0", 2), ("10.0.0.7", 1), ("root@gpu-3", 8)]


@pytest.mark.parametrize("line, expected", [
    ("worker-1", "hf:2: bad entry 'worker-1' (expected 'HOST slots=N')"),
    ("worker-1 slots=", "hf:2: bad entry 'worker-1 slots=' (expected 'HOST slots=N')"),
    ("worker-1 slots=two", "hf:2: bad entry 'worker-1 slots=two'"),
    ("worker-1 slots=-1", "hf:2: bad entry 'worker-1 slots=-1'"),
    ("worker-1 slots=2 extra", "hf:2: bad entry 'worker-1 slots=2 extra'"),
    ("worker-1 gpus=2", "hf:2: bad entry 'worker-1 gpus=2'"),
    ("worker-1 slots=0", "hf:2: host 'worker-1' has slots=0 (slots must be at least 1)"),
])
def test_malformed_lines_are_errors_naming_the_line(line, expected):
    with pytest.raises(UserError) as excinfo:
        parse_hostfile(f"a slots=1\n{line}\n", source="hf")
    assert len(excinfo.value.problems) == 1
    assert problems(excinfo)[0].startswith(expected)


def test_duplicate_host_names_both_lines():
    with pytest.raises(UserError) as excinfo:
        parse_hostfile("a slots=1\nb slots=2\na slots=4\n", source="hf")
    assert problems(excinfo) == ["hf:3: host 'a' is listed more than once (first listed on line 1)"]


@pytest.mark.parametrize("host", ["worker;reboot", "$(id)", "a|b", "w`x`", "a&&b", "-oProxyCommand=x", "a>b",
                                  "h'q", 'h"q', "a\\b", "a*", "a{b,c}", "~root", "a!b"])
def test_host_names_with_shell_metacharacters_are_rejected(host):
    with pytest.raises(UserError) as excinfo:
        parse_hostfile(f"ok slots=1\n{host} slots=1\n", source="hf")
    (problem,) = problems(excinfo)
    assert problem.startswith("hf:2: host ") and "not allowed in a host name" in problem


def test_every_bad_line_is_reported_at_once():
    with pytest.raises(UserError) as excinfo:
        parse_hostfile("a slots=1\nbroken\nb slots=0\na slots=2\n$(x) slots=1\n", source="hf")
    assert [p.split(":")[1] for p in problems(excinfo)] == ["2", "3", "4", "5"]


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_a_hostfile_without_hosts_is_an_error(text):
    with pytest.raises(UserError, match="hf: lists no hosts"):
        parse_hostfile(text, source="hf")


def test_missing_hostfile_is_an_error(tmp_path):
    with pytest.raises(UserError, match="--hostfile: .*does not exist"):
        read_hostfile(tmp_path / "nope")


def test_read_hostfile_names_the_file_in_errors(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("good slots=2\nbad\n")
    with pytest.raises(UserError) as excinfo:
        read_hostfile(path)
    assert problems(excinfo)[0].startswith(f"{path}:2: bad entry")


# ---- filters -------------------------------------------------------------------------------------------

def test_filter_grammar():
    assert parse_filter("worker-0:0,2@worker-1@worker-0:3", "--include") == {"worker-0": [0, 2, 3], "worker-1": None}


def test_include_whole_hosts_and_single_slots_in_hostfile_order():
    assert apply_filters(POOL, include="worker-2@worker-0:1,3") == {"worker-0": [1, 3], "worker-2": [0, 1]}


def test_exclude_slots_and_whole_hosts():
    assert apply_filters(POOL, exclude="worker-0:0@worker-1") == {"worker-0": [1, 2, 3], "worker-2": [0, 1]}


def test_exclude_every_slot_of_a_host_drops_the_host():
    assert apply_filters(POOL, exclude="worker-2:0,1") == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


def test_no_filter_keeps_the_pool():
    assert apply_filters(POOL) == POOL


def test_include_and_exclude_are_mutually_exclusive():
    with pytest.raises(UserError, match="--include/--exclude: are mutually exclusive"):
        apply_filters(POOL, include="worker-0", exclude="worker-1")


def test_unknown_host_suggests_the_closest():
    with pytest.raises(UserError) as excinfo:
        apply_filters(POOL, include="gpu-7:0@wroker-1")
    assert problems(excinfo) == [
        "--include: host 'gpu-7' is not in the hostfile (known hosts: worker-0, worker-1, worker-2)",
        "--include: host 'wroker-1' is not in the hostfile (did you mean 'worker-1'?)",
    ]


def test_unknown_slot_is_an_error():
    with pytest.raises(UserError) as excinfo:
        apply_filters(POOL, exclude="worker-2:5")
    assert problems(excinfo) == ["--exclude: host 'worker-2' has no slot 5 (its slots are 0,1)"]


@pytest.mark.parametrize("spec, message", [
    ("worker-0@@worker-1", "has an empty host entry"),
    ("worker-0:", "slot '' of host 'worker-0' is not a slot number"),
    ("worker-0:a", "slot 'a' of host 'worker-0' is not a slot number"),
    ("worker-0:-1", "slot '-1' of host 'worker-0' is not a slot number"),
    ("worker-0:0,,1", "slot '' of host 'worker-0' is not a slot number"),
    ("$(id):0", "not allowed in a host name"),
    ("  ", "is empty"),
])
def test_malformed_filters_are_errors(spec, message):
    with pytest.raises(UserError) as excinfo:
        apply_filters(POOL, include=spec)
    assert any(message in p for p in problems(excinfo)), problems(excinfo)


@pytest.mark.parametrize("exclude", ["worker-0@worker-1@worker-2", "worker-0@worker-1@worker-2:0,1"])
def test_a_filter_that_leaves_nothing_is_an_error(exclude):
    with pytest.raises(UserError, match="leaves no slots to run on"):
        apply_filters(POOL, exclude=exclude)


# ---- core lists ----------------------------------------------------------------------------------------

def test_core_list_ranges():
    assert parse_core_list("0-3, 8,10-11,2") == [0, 1, 2, 3, 8, 10, 11]


@pytest.mark.parametrize("text, message", [("0-", "is not a core id or range"), ("a", "is not a core id"),
                                           ("5-2", "runs backwards")])
def test_bad_core_lists(text, message):
    with pytest.raises(UserError, match=message):
        parse_core_list(text)
