"""Hostfiles and the ``--include`` / ``--exclude`` resource filters, as DeepSpeed documents them.

A hostfile lists one machine per line as ``HOST slots=N`` (OpenMPI/Horovod style); ``#`` starts a comment,
blank lines are ignored. A *pool* is the ordered mapping ``{host: [slot ids]}`` that a hostfile describes;
filters narrow a pool down to the slots a job runs on:

- ``--include "worker-1:0,1@worker-2"`` keeps only the named hosts (all slots of a host named without
  ``:SLOTS``, otherwise only the listed slot ids);
- ``--exclude "worker-1:0@worker-3"`` drops the listed slots, or whole hosts named without ``:SLOTS``.

Every mistake is a :class:`~dsrun.utils.errors.Problem` naming the file and line or the flag and the part of
the filter that is wrong; nothing here raises anything but :class:`~dsrun.utils.errors.UserError`.
"""
from __future__ import annotations

import re
from pathlib import Path

from dsrun.utils.errors import Problem, UserError, show
from dsrun.utils.suggest import did_you_mean

Pool = dict[str, list[int]]

# A host is a DNS name, an IPv4 address or a bracket-less IPv6 address, optionally user@host. Anything else,
# in particular shell metacharacters, is refused so a hostfile can never inject a command into ssh/pdsh.
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_.:%-]+$")
_SLOTS_RE = re.compile(r"^slots=(\d+)$")


def host_problem(host: str) -> str | None:
    """Why ``host`` is not an acceptable host name, or None when it is."""
    if not host:
        return "is empty"
    if not _HOST_RE.match(host) or host.startswith("-"):
        return ("contains characters that are not allowed in a host name "
                "(letters, digits, '.', '-', '_', ':', '%', one 'user@' prefix)")
    return None


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parse hostfile ``text`` into ``{host: slots}`` in file order.

    Raises :class:`UserError` with one problem per bad line: a line that is not ``HOST slots=N``, a slot
    count below 1, a host name with characters outside the allowed set, a host listed twice, or a file with
    no hosts at all.
    """
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    problems: list[Problem] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        fields = line.split()
        match = _SLOTS_RE.match(fields[1]) if len(fields) == 2 else None
        if match is None:
            problems.append(Problem(where, f"bad entry {show(raw.strip())}", "expected 'HOST slots=N'"))
            continue
        host, slots = fields[0], int(match.group(1))
        why = host_problem(host)
        if why:
            problems.append(Problem(where, f"host {show(host)} {why}"))
            continue
        if slots < 1:
            problems.append(Problem(where, f"host {host!r} has slots={slots}", "slots must be at least 1"))
            continue
        if host in hosts:
            problems.append(Problem(where, f"host {host!r} is listed more than once",
                                    f"first listed on line {first_line[host]}"))
            continue
        hosts[host] = slots
        first_line[host] = number
    if problems:
        raise UserError(problems)
    if not hosts:
        raise UserError(Problem(source, "lists no hosts", "add lines such as 'worker-1 slots=4'"))
    return hosts


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse the hostfile at ``path``; a missing or unreadable file is a :class:`UserError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(Problem("--hostfile", f"{str(path)!r} does not exist")) from None
    except OSError as err:
        raise UserError(Problem("--hostfile", f"cannot read {str(path)!r}: {err.strerror}")) from None
    return parse_hostfile(text, source=str(path))


def parse_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse a filter ``NAME[:SLOT[,SLOT...]][@NAME...]`` into ``{host: [slots] or None}``.

    ``None`` means "the whole host". A host named twice has its slot lists merged.
    """
    result: dict[str, list[int] | None] = {}
    problems: list[Problem] = []
    if not spec.strip():
        raise UserError(Problem(flag, "is empty", "expected HOST[:SLOT,SLOT]@HOST..."))
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            problems.append(Problem(flag, f"{show(spec)} has an empty host entry", "remove the extra '@'"))
            continue
        host, sep, slot_text = part.partition(":")
        why = host_problem(host)
        if why:
            problems.append(Problem(flag, f"host {show(host)} {why}"))
            continue
        if not sep:
            slots: list[int] | None = None
        else:
            slots = []
            for item in slot_text.split(","):
                item = item.strip()
                if not item.isdigit():
                    problems.append(Problem(flag, f"slot {show(item)} of host {host!r} is not a slot number",
                                            "slots are non-negative integers such as 0,1"))
                    slots = None
                    break
                slots.append(int(item))
            if slots is None:
                continue
        if host in result:
            previous = result[host]
            result[host] = None if previous is None or slots is None else sorted(set(previous) | set(slots))
        else:
            result[host] = slots
    if problems:
        raise UserError(problems)
    return result


def _check_known(flag: str, wanted: dict[str, list[int] | None], pool: Pool) -> list[Problem]:
    problems = []
    for host, slots in wanted.items():
        if host not in pool:
            problems.append(Problem(flag, f"host {host!r} is not in the hostfile",
                                    did_you_mean(host, pool) or f"known hosts: {', '.join(pool)}"))
            continue
        for slot in slots or []:
            if slot not in pool[host]:
                problems.append(Problem(flag, f"host {host!r} has no slot {slot}",
                                        f"its slots are {_ranges(pool[host])}"))
    return problems


def _ranges(slots: list[int]) -> str:
    return ",".join(str(s) for s in slots) if slots else "none"


def apply_filters(pool: Pool, include: str | None = None, exclude: str | None = None) -> Pool:
    """Narrow ``pool`` with an include or an exclude filter (not both); host order is kept.

    Unknown hosts or slots are errors, and so is a filter that leaves nothing to run on.
    """
    if include and exclude:
        raise UserError(Problem("--include/--exclude", "are mutually exclusive", "use one of them"))
    if not include and not exclude:
        return {host: list(slots) for host, slots in pool.items()}
    flag = "--include" if include else "--exclude"
    wanted = parse_filter(include or exclude or "", flag)
    problems = _check_known(flag, wanted, pool)
    if problems:
        raise UserError(problems)
    result: Pool = {}
    for host, slots in pool.items():
        if include:
            if host in wanted:
                chosen = wanted[host]
                result[host] = list(slots) if chosen is None else [s for s in slots if s in chosen]
        else:
            dropped = wanted.get(host, [])
            if dropped is None:
                continue
            kept = [s for s in slots if s not in dropped]
            if kept:
                result[host] = kept
    if not any(result.values()):
        raise UserError(Problem(flag, f"{show(include or exclude)} leaves no slots to run on"))
    return result


def parse_core_list(text: str, flag: str = "--bind_core_list") -> list[int]:
    """Parse a core list such as ``"0-3,8,10-11"`` into sorted unique core ids."""
    cores: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match:
            raise UserError(Problem(flag, f"{show(item)} in {show(text)} is not a core id or range",
                                    "expected a list such as 0-3,8,10-11"))
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise UserError(Problem(flag, f"range {item!r} runs backwards", f"write {high}-{low}"))
        cores.update(range(low, high + 1))
    return sorted(cores)
