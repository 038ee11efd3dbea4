"""What is left of a process group: tests that stop a command check that nothing it
started outlives it (a child of a child included, as long as it kept the group)."""

from __future__ import annotations

from pathlib import Path


def process_group_members(pgid: int) -> list[int]:
    """The pids of live (not zombie) processes in process group ``pgid``, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members
