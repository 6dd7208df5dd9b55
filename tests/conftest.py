import faulthandler
import os
import sys

import pytest

# Keep every test single-threaded unless it splits the cores itself: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The default recipe logs an MLflow run; tests that do not test MLflow skip it (those that do set it to true
# or pick monitor=mlflow, which this does not affect).
os.environ.setdefault("DSRUN_MLFLOW", "false")


ESTIMATE_TABLE_PROPERTY = "dsrun_estimate_table"
_CORES_AT_START = frozenset(os.sched_getaffinity(0))


class _EstimateTables:
    """Collects the estimator table lines tests put in their ``ESTIMATE_TABLE_PROPERTY`` user property (from any xdist worker) and
    prints them in the terminal summary."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call":
            for name, value in report.user_properties:
                if name == ESTIMATE_TABLE_PROPERTY:
                    self.lines.extend(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.lines:
            terminalreporter.section("dsrun estimate-memory: predicted vs measured peak per rank")
            for line in self.lines:
                terminalreporter.write_line(line)


def pytest_configure(config):
    config.pluginmanager.register(_EstimateTables(), "dsrun-estimate-tables")
    config.pluginmanager.register(_HangWatchdog(), "dsrun-hang-watchdog")
    if not hasattr(config, "workerinput"):  # the xdist controller, or the one process of -n 0
        config.pluginmanager.register(_RepositoryUntouched(), "dsrun-repository-untouched")


class _HangWatchdog:
    """Bounds what pytest-timeout cannot. Its signal reaches a test only when the test's thread runs Python: one
    stuck in C++ (a collective whose peer is gone, a destructor joining its threads) would hold its worker, and CI,
    until CI's own limit, printing nothing. faulthandler's watchdog is a thread of its own: ``MARGIN_S`` after the
    test's time limit (pytest-timeout's, which covers its setup, call and teardown) it prints every thread's stack
    to the run's stderr and ends the process (pytest-xdist reports the worker's crash, which ends the run:
    pyproject.toml's ``--max-worker-restart=0``). The process's own exit, after the last test, gets ``EXIT_S``
    (threads that never end, ``atexit`` hooks). ``DSRUN_TESTS_HANG_MARGIN_S`` sets the margin (the watchdog's own
    test, tests/unit/test_repo.py)."""

    MARGIN_S = float(os.environ.get("DSRUN_TESTS_HANG_MARGIN_S", 120))
    EXIT_S = 300

    def __init__(self) -> None:
        # the run's own stderr (pytest_configure runs between capture's start and its first test), not the capture
        # file a test's output goes to, which is dropped when the process ends
        self.stderr = os.fdopen(os.dup(2), "w")

    @staticmethod
    def limit(item) -> float:
        """The test's pytest-timeout limit (its marker, ``--timeout``, pyproject's ``timeout``); 0 for none, and
        under a debugger (``--pdb``, a trace function), where a test may stop for as long as its user likes."""
        config = item.config
        if config.getoption("usepdb", False) or sys.gettrace() is not None:
            return 0.0
        marker = item.get_closest_marker("timeout")
        if marker is not None and (marker.args or "timeout" in marker.kwargs):
            return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
        given = config.getoption("timeout", None)
        return float(given if given is not None else config.getini("timeout") or 0)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        limit = self.limit(item)
        if limit > 0:
            faulthandler.dump_traceback_later(limit + self.MARGIN_S, exit=True, file=self.stderr)
        try:
            return (yield)
        finally:
            faulthandler.cancel_dump_traceback_later()

    def pytest_unconfigure(self, config) -> None:
        faulthandler.dump_traceback_later(self.EXIT_S, exit=True, file=self.stderr)


class _RepositoryUntouched:
    """Fails the run when the tests left a new file or folder in the repository (build/, dist/, *.egg-info,
    outputs/, mlruns/ ...): each test writes into its own temporary folder, so no two share a writable one."""

    # git's, worktrees, the user's venv, caches (pytest-benchmark, where installed, makes .benchmarks at start)
    SKIPPED = {".git", ".wt", ".venv", ".pytest_cache", ".benchmarks", "__pycache__"}

    def __init__(self) -> None:
        self.before = self.paths()
        self.written: list[str] = []

    def paths(self) -> set[str]:
        from tests.helpers import REPO

        found = set()
        for folder, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in self.SKIPPED]
            found.update(os.path.relpath(os.path.join(folder, name), REPO) for name in dirs + files)
        return found

    def pytest_sessionfinish(self, session) -> None:
        new = self.paths() - self.before
        self.written = sorted(path for path in new if os.path.dirname(path) not in new)  # new folders, not their files
        if self.written:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.written:
            terminalreporter.section("tests wrote into the repository (write into tmp_path instead)", red=True)
            for path in self.written:
                terminalreporter.write_line(path)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """The suite runs on two pytest-xdist workers (``--dist loadgroup``, pyproject.toml). The multi-host tests
    share one pair of network-namespace hosts (a session fixture, set up once per worker): keep them on one.
    The tests of a module that read a fixture shared beyond one test (module, class or package scope: the
    ``runs`` launches, a trained run, a tuned study) share what it built: keep them on one worker, so it is built
    once in the suite, not once per worker. A test that names its group itself keeps it (the real Slurm's tests,
    ``xdist_group("slurm")``: one worker starts the one cluster they share)."""
    for item in items:
        if item.get_closest_marker("multihost"):
            item.add_marker(pytest.mark.xdist_group("two_hosts"))
        elif _shares_a_fixture(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


_GROUP_TAG_LOST: list[str] = []


def pytest_collection_finish(session):
    """On a pytest-xdist worker under ``--dist loadgroup``: every test with an ``xdist_group`` must carry its
    group in its id (``...@group``), which is how the scheduler keeps a group on one worker. A pytest/xdist pair
    that loses the tag (pytest 9.2 with xdist 3.8) would split every group silently: the Slurm cluster, the
    two-host namespaces and each shared module fixture built once per worker, the suite far slower. Each such
    test then fails at setup, saying why (an error raised here would only crash the worker, without a word)."""
    config = session.config
    if hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False):  # xdist's own test
        _GROUP_TAG_LOST.extend(item.nodeid for item in session.items
                               if item.get_closest_marker("xdist_group") and "@" not in item.nodeid)


def pytest_runtest_setup(item):
    if _GROUP_TAG_LOST and item.nodeid in _GROUP_TAG_LOST:
        pytest.fail(f"pytest {pytest.__version__} with this pytest-xdist dropped the xdist_group tag from "
                    f"{len(_GROUP_TAG_LOST)} test ids: their groups are split over the workers; install the pytest "
                    "the dev extra names (pyproject.toml)", pytrace=False)


def _shares_a_fixture(item) -> bool:
    """Whether ``item`` uses a fixture of module, class or package scope (``module_root``, an empty folder,
    alone does not count)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in ("module", "class", "package")
               for name, defs in info.name2fixturedefs.items() if name != "module_root")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Errors the test whose run (its fixtures' setup and teardown included) leaves this process bound to other
    cores than it started on (an engine whose optimizer thread pinned the training threads, never destroyed):
    every later test of the same pytest-xdist worker, and every process it starts, would inherit the mask."""
    result = yield
    now = os.sched_getaffinity(0)
    if now != _CORES_AT_START:
        os.sched_setaffinity(0, _CORES_AT_START)
        raise AssertionError(f"{item.nodeid} (or a fixture it uses) left this process on cores {sorted(now)}; it "
                             f"started on {sorted(_CORES_AT_START)}: call engine.destroy() so the optimizer's core "
                             "split gives them back")
    return result


@pytest.fixture
def port():
    from tests.helpers import free_port

    return free_port()


def pytest_sessionstart(session):
    """Every compiled op (CPU Adam, Adagrad, Lion, async I/O) is built before the first test, once, outside
    every test's time limit, by the one process that starts the others (with pytest-xdist, the controller
    builds before its workers start; they load from the cache). ``tests/run`` builds them beforehand
    (``dsrun ops build --all``), so here each is a cache hit of well under a second; on a machine where
    nothing built them yet this compiles each once (a minute or more each), never inside a test. Without a
    compiler the ops' torch fallbacks are used."""
    if hasattr(session.config, "workerinput"):
        return
    from op_builder import ALL_OPS, CompilerUnavailableError, OpBuildError, get_builder

    for name in ALL_OPS:
        try:
            get_builder(name).load()
        except CompilerUnavailableError:
            return
        except OpBuildError:  # the tests of that op report the compiler's error
            continue
    # CPU Adam at the SIMD levels below this machine's too (tests/unit/ops/test_op_builder.py), each built once
    # per machine in a process of its own (the level is read at build time); a cache hit after the first run
    import subprocess
    import sys

    from op_builder.builder import cpu_flags

    for level in ["scalar"] + (["avx2"] if "avx2" in cpu_flags() else []):
        subprocess.run([sys.executable, "-m", "dsrun", "ops", "build", "cpu_adam"],
                       env={**os.environ, "DSRUN_SIMD": level}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=1200, check=False)


@pytest.fixture(scope="module")
def module_root(request, tmp_path_factory):
    """A temporary folder for the whole test module (its launches' checkpoints and NVMe files)."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def runs(request, module_root):
    """The one fixture of every multi-rank test module: its declared launches (``LAUNCHES``, or
    ``launches(root)`` of ``module_root``), each run once on first use (tests/harness/launch.py); what the
    module's ``collect(runs)`` returns where it declares one."""
    from tests.harness.launch import Runs

    module = request.module
    declared = getattr(module, "launches", None) or getattr(module, "LAUNCHES", {})
    launched = Runs(declared, module_root)
    collect = getattr(module, "collect", None)
    return collect(launched) if collect else launched
