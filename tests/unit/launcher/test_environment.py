"""Environment export: prefixes, .dsrun_env / .deepspeed_env files, precedence and errors."""
from __future__ import annotations

import pytest

from dsrun.launcher.environment import exported_environment, parse_env_file
from dsrun.utils.errors import UserError


def test_env_file_accepts_comments_blank_lines_export_and_quotes():
    text = "# network\n\nNCCL_IB_DISABLE=1\nexport NCCL_SOCKET_IFNAME=eth0\nGREETING='a = b'\nEMPTY=\nURL=x=y\n"
    assert parse_env_file(text, "f") == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0", "GREETING": "a = b",
                                          "EMPTY": "", "URL": "x=y"}


def test_env_file_errors_name_each_bad_line():
    with pytest.raises(UserError) as excinfo:
        parse_env_file("OK=1\njust words\n1BAD=2\n", "proj/.dsrun_env")
    assert [str(p) for p in excinfo.value.problems] == [
        "proj/.dsrun_env:2: bad line 'just words' (expected KEY=VALUE)",
        "proj/.dsrun_env:3: bad line '1BAD=2' (expected KEY=VALUE)",
    ]


def test_prefixes_and_files_from_home_then_working_directory(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home\n")
    (work / ".deepspeed_env").write_text("SHARED=work-ds\n")
    (work / ".dsrun_env").write_text("SHARED=work-dsrun\nNCCL_DEBUG=INFO\n")
    environ = {"HOME": str(home), "NCCL_DEBUG": "WARN", "PYTHONPATH": "/x", "MLFLOW_TRACKING_URI": "file:/m",
               "UCX_TLS": "tcp", "MV2_X": "1", "OMP_NUM_THREADS": "3", "GLOO_SOCKET_IFNAME": "eth1",
               "SECRET_TOKEN": "nope", "PATH": "/bin"}
    assert exported_environment(work, environ) == {
        "FROM_HOME": "1", "GLOO_SOCKET_IFNAME": "eth1", "MLFLOW_TRACKING_URI": "file:/m", "MV2_X": "1",
        "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "3", "PYTHONPATH": "/x", "SHARED": "work-dsrun", "UCX_TLS": "tcp",
    }


def test_env_file_named_by_variable_is_read_last(tmp_path):
    (tmp_path / ".dsrun_env").write_text("A=cwd\n")
    extra = tmp_path / "cluster.env"
    extra.write_text("A=named\n")
    assert exported_environment(tmp_path, {"DS_ENV_FILE": str(extra)}) == {"A": "named"}
