"""A child process with a fresh tmpfs of its own: `run_on_tmpfs` mounts one (size, huge=...)
in a private mount namespace (`unshare -m`: root or CAP_SYS_ADMIN; `can_mount_tmpfs` says
whether this machine allows it), runs the child with the mount point as its first argument,
and the kernel tears the mount down when the child's processes end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs none /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def run_on_tmpfs(
    tmp_path: Path, options: str, child: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python child MOUNT *args` with a fresh tmpfs mounted at MOUNT (`tmp_path / "mnt"`)
    with `options` (`-o`: "size=40M,huge=never"); its stdout and stderr as text."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = 'o=$1; d=$2; shift 2; mount -t tmpfs -o "$o" maru-test "$d" && exec "$@"'
    argv = ["sh", options, str(mount), sys.executable, str(child), str(mount), *args]
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
